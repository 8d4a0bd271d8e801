"""ONNX export and import (the ``[onnx]`` extra: ``onnx`` and ``onnxruntime``).

``cct.onnx.export(net, path, opset=17, dynamic_batch=False)`` writes a built :class:`cct.Net` as an
ONNX model whose forward equals cct's (each Caffe layer converted exactly, or refused with an error
naming it); ``cct export_onnx`` is the command-line form. ``cct.onnx.import_onnx(path, prototxt, caffemodel)``
(``cct import_onnx``) converts the ONNX ops that BVLC layers express exactly (:data:`IMPORTABLE_OPS`).
"""
from .export import DEFAULT_OPSET, export, exportable_layer_types, refused_layer_types, to_onnx
from .importer import IMPORTABLE_OPS, OnnxImportError, from_onnx, import_onnx

__all__ = ["DEFAULT_OPSET", "IMPORTABLE_OPS", "OnnxImportError", "export", "exportable_layer_types", "from_onnx",
           "import_onnx", "refused_layer_types", "to_onnx"]
