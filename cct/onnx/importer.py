"""Import an ONNX model as a Caffe net (prototxt) and weights (caffemodel) where BVLC layers express it exactly.

Each ONNX node becomes one BVLC layer, or a few nodes one layer (Pad folded into Conv/AveragePool,
MatMul + Add into InnerProduct, Mul + Add into Scale with bias, Mul-by-constant inputs of Sum into
Eltwise coefficients, and the exporter's multi-node forms: :mod:`cct.onnx.import_patterns`). Weights
are copied bit for bit. A node no BVLC layer computes exactly stops the import with an
:class:`OnnxImportError` naming the node and op. :data:`IMPORTABLE_OPS` lists the ONNX ops handled.
"""
from __future__ import annotations

import os

from ..io.atomic import atomic_write_bytes
from ..io.prototxt import to_text
from ..proto import caffe_pb2
from .graph import require
from .import_patterns import HANDLERS, claim_batchnorm_stats
from .import_state import ImportState, OnnxImportError
from .records import recorded_layer

__all__ = ["IMPORTABLE_OPS", "OnnxImportError", "from_onnx", "import_onnx"]

IMPORTABLE_OPS = sorted(HANDLERS) + ["Constant"]


def _walk(imp: ImportState) -> tuple[caffe_pb2.NetParameter, caffe_pb2.NetParameter]:
    """Convert every node in graph order (Input layers first); the net and weights built."""
    claim_batchnorm_stats(imp)
    for vi in imp.graph.input:
        if vi.name in imp.consts:
            continue
        if vi.type.tensor_type.elem_type != imp.onnx.TensorProto.FLOAT:
            raise OnnxImportError(f"graph input '{vi.name}' is not float32 (Caffe blobs are float)")
        dims = imp.shape(vi.name)
        if not dims:
            raise OnnxImportError(f"graph input '{vi.name}' has no static rank")
        lp = imp.net.layer.add(name=vi.name, type="Input")
        imp.layer_names.add(vi.name)
        lp.top.append(vi.name)
        lp.input_param.shape.add().dim.extend([d if d else 1 for d in dims])  # symbolic batch -> 1
    for i, node in enumerate(imp.graph.node):
        if i in imp.done:
            continue
        if node.domain not in ("", "ai.onnx"):
            raise imp.fail(node, f"custom domain '{node.domain}' has no BVLC layer")
        if node.op_type == "Constant":
            imp.consts[node.output[0]] = imp.onnx.numpy_helper.to_array(imp.attr(node, "value"))
            continue
        if node.doc_string.startswith("unrolled "):  # cct's step-by-step LSTM/RNN: no layer of its own
            raise imp.fail(node, "no BVLC layer stands for one step of a recurrent layer")
        if recorded_layer(imp, i, node):  # a layer the exporter recorded, matching its nodes exactly
            continue
        handler = HANDLERS.get(node.op_type)
        if handler is None:
            raise imp.fail(node, "no BVLC Caffe layer computes this op")
        handler(imp, i, node)
    for out in imp.graph.output:
        if imp.alias.get(out.name, out.name) != out.name:
            # an output that is an alias of another blob (Identity): copy it under its own name
            imp.layer(imp.onnx.helper.make_node("Identity", [], [out.name], name=f"{out.name}_split"),
                      "Split", [imp.alias[out.name]], [out.name])
    return imp.net, imp.weights


def from_onnx(model) -> tuple[caffe_pb2.NetParameter, caffe_pb2.NetParameter]:
    """The Caffe net (``NetParameter`` for the prototxt) and weights (``NetParameter`` with blobs) of ``model``."""
    return _walk(ImportState(model))


def import_onnx(path: str | os.PathLike, out_model: str | os.PathLike, out_weights: str | os.PathLike) -> None:
    """Convert the ONNX file ``path`` into a deploy prototxt and a caffemodel (both written atomically)."""
    onnx = require("onnx")
    try:
        model = onnx.load(os.fspath(path))
    except Exception as e:  # a missing file, or bytes that do not parse as a ModelProto
        raise OnnxImportError(f"{os.fspath(path)}: cannot read an ONNX model: {e}") from None
    net, weights = from_onnx(model)
    atomic_write_bytes(out_model, to_text(net).encode())
    atomic_write_bytes(out_weights, weights.SerializeToString())
