"""ONNX export and import (the ``[onnx]`` extra: ``onnx`` and ``onnxruntime``).

``cct.onnx.export(net, path, opset=17, dynamic_batch=False)`` writes a built :class:`cct.Net` as an
ONNX model whose forward equals cct's (each Caffe layer converted exactly, or refused with an error
naming it); ``cct export_onnx`` is the command-line form.
"""
from .export import DEFAULT_OPSET, export, exportable_layer_types, refused_layer_types, to_onnx

__all__ = ["DEFAULT_OPSET", "export", "exportable_layer_types", "refused_layer_types", "to_onnx"]
