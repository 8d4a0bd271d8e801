"""Layers the exporter records on their first ONNX node, and the importer's exact check of such a record.

Some layers' ONNX forms are also other layers' (Flatten is a Reshape; Exp is Power + Exp + Power; LRN within
channels and SPP are chains of pooling and arithmetic). The exporter writes the layer (name, type and its own
parameters, as prototxt) into the ``doc_string`` of the layer's first node. The importer takes the recorded
layer back only where converting it again, on the same bottom shape, gives exactly the nodes that follow
(same ops, attributes and wiring, bit-identical constants): a record that does not match is not trusted, and
the nodes are imported one by one (with the same semantics).
"""
from __future__ import annotations

from ..blob import Blob
from ..errors import CctError
from ..io.prototxt import parse_text, to_text
from ..layers.base import create_layer
from ..proto import caffe_pb2
from .graph import GraphBuilder
from .import_state import ImportState
from .layers import CONVERTERS, LayerContext

# the recorded layer types -> the LayerParameter field of their own parameters
RECORDED = {"Exp": "exp_param", "Log": "log_param", "Flatten": "flatten_param", "LRN": "lrn_param",
            "SPP": "spp_param"}
RECORD_PREFIX = "cct layer: "
_TOP = "__cct_recorded_top"


def record_layer(lp: caffe_pb2.LayerParameter) -> str:
    """The doc_string recording layer ``lp`` (name, type and its own parameters, as prototxt)."""
    kept = caffe_pb2.LayerParameter(name=lp.name, type=lp.type)
    getattr(kept, RECORDED[lp.type]).CopyFrom(getattr(lp, RECORDED[lp.type]))
    return RECORD_PREFIX + to_text(kept)


def recorded_layer(imp: ImportState, index: int, node) -> bool:
    """Emit the layer recorded on ``node`` (graph node ``index``) where it matches the nodes exactly (those
    nodes are then marked converted): True; False where there is no record or it does not match."""
    if not node.doc_string.startswith(RECORD_PREFIX) or not node.input:
        return False
    lp = caffe_pb2.LayerParameter()
    try:
        parse_text(node.doc_string[len(RECORD_PREFIX):], lp)
    except CctError:
        return False
    if lp.type not in RECORDED:
        return False
    x = node.input[0]
    top = _replay(imp, index, lp, x)
    if top is None:
        return False
    out = imp.layer(node, lp.type, [imp.blob(node, x)], [top])
    getattr(out, RECORDED[lp.type]).CopyFrom(getattr(lp, RECORDED[lp.type]))
    return True


def _replay(imp: ImportState, index: int, lp: caffe_pb2.LayerParameter, x: str) -> str | None:
    """Convert ``lp`` again on ``x``'s shape and compare node by node with the graph from ``index``: the top's
    value when every node matches (the matched nodes marked), else None."""
    shape = imp.shape(x)
    if not shape or None in shape[1:]:
        return None
    shape = [1 if shape[0] is None else shape[0]] + list(shape[1:])
    built = caffe_pb2.LayerParameter()
    built.CopyFrom(lp)
    built.phase = caffe_pb2.TEST
    try:
        layer = create_layer(built)
        bottom, top = Blob(shape), Blob()
        layer.setup([bottom], [top])
        g = GraphBuilder(imp.opset)
        g.reserve(x)
        g.reserve(_TOP)
        CONVERTERS[lp.type](LayerContext(g, layer, [x], [_TOP], [tuple(shape)], [tuple(top.shape)], False))
    except (CctError, ValueError, ArithmeticError):  # a record Caffe would not build: not trusted
        return None
    consts = {t.name: imp.onnx.numpy_helper.to_array(t) for t in g.initializers}
    nodes = list(imp.graph.node[index:index + len(g.nodes)])
    if len(nodes) != len(g.nodes):
        return None
    names = {x: x}
    for want, have in zip(g.nodes, nodes):
        if want.op_type != have.op_type or have.domain not in ("", "ai.onnx") or \
                len(want.input) != len(have.input) or len(want.output) != len(have.output) or \
                sorted(a.SerializeToString() for a in want.attribute) != \
                sorted(a.SerializeToString() for a in have.attribute):
            return None
        for w, h in zip(want.input, have.input):
            if w in consts:
                c = imp.const(h)
                if c is None or c.dtype != consts[w].dtype or c.shape != consts[w].shape or \
                        c.tobytes() != consts[w].tobytes():
                    return None
            elif names.get(w) != h:
                return None
        names.update(zip(want.output, have.output))
    result = names.get(_TOP)
    inner = {v for n in nodes for v in n.output} - {result}
    if result is None or any(v in imp.graph_outputs or any(all(u is not n for n in nodes)
                                                            for u in imp.consumers.get(v, [])) for v in inner):
        return None  # an inner value read outside the layer: not only this layer's arithmetic
    for n in nodes[1:]:
        imp.mark(n)
    return result
