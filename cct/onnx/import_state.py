"""The state of one ONNX import: the graph, its constants and inferred shapes, and the Caffe net being built.

:class:`ImportState` is what every op handler (:mod:`cct.onnx.import_ops`, :mod:`cct.onnx.import_patterns`)
reads and writes; :class:`OnnxImportError` is the clean error naming the node and op that does not map.
"""
from __future__ import annotations

import numpy as np

from ..errors import CctError
from ..io.blobproto import array_to_blobproto
from ..proto import caffe_pb2
from .graph import require


class OnnxImportError(CctError):
    """An ONNX node (or model) that no BVLC Caffe layer expresses exactly."""


class ImportState:
    """One import: the ONNX graph, its constants and shapes, and the NetParameter being built."""

    def __init__(self, model):
        self.onnx = require("onnx")
        from onnx import numpy_helper, shape_inference

        try:
            self.onnx.checker.check_model(model)
            model = shape_inference.infer_shapes(model, strict_mode=True)
        except Exception as e:  # onnx raises several checker/inference error types
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise OnnxImportError(f"the ONNX model is not valid: {first}") from None
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
        self.graph = model.graph
        self.consts: dict[str, np.ndarray] = {t.name: numpy_helper.to_array(t) for t in self.graph.initializer}
        self.shapes: dict[str, list[int | None]] = {}
        for vi in list(self.graph.input) + list(self.graph.value_info) + list(self.graph.output):
            if vi.type.tensor_type.HasField("shape"):
                self.shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else None
                                        for d in vi.type.tensor_type.shape.dim]
        self.consumers: dict[str, list] = {}
        for node in self.graph.node:
            for v in dict.fromkeys(node.input):  # a node reading a value twice (x * x) is one consumer
                self.consumers.setdefault(v, []).append(node)
        self.graph_outputs = {o.name for o in self.graph.output}
        self.net = caffe_pb2.NetParameter(name=self.graph.name)
        self.weights = caffe_pb2.NetParameter(name=self.graph.name)
        self.alias: dict[str, str] = {}
        self.done: set[int] = set()
        self.layer_names: set[str] = set()
        # value -> (blob, axis, layer name): bottom[1] of a two-bottom Scale/Bias, reshaped for ONNX's broadcast
        self.operands: dict[str, tuple[str, int, str]] = {}
        # value -> (raw blob, moving-average factor): BatchNorm statistics the exporter divides explicitly
        self.bn_stats: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def producer(self, v: str):
        """The node writing value ``v`` (None for graph inputs and initializers)."""
        return next((n for n in self.graph.node if v in n.output), None)

    # -- helpers --------------------------------------------------------------------------------------
    def fail(self, node, why: str) -> OnnxImportError:
        """The clean error for ``node`` (named with its op) and why it does not map."""
        if node.doc_string.startswith("unrolled "):  # cct's export of a recurrent layer, step by step
            why += f" (part of an {node.doc_string}: recurrent layers unrolled into ONNX nodes are not imported)"
        return OnnxImportError(f"ONNX node '{node.name or node.output[0]}' (op {node.op_type}): {why}")

    def const(self, v: str):
        """The constant value of ``v`` (an initializer or Constant node), else None."""
        return self.consts.get(v) if v else None

    def blob(self, node, v: str) -> str:
        """The Caffe blob holding value ``v`` (read by ``node``); a constant there is an error."""
        if v in self.consts:
            raise self.fail(node, f"input '{v}' is a constant where BVLC layers take a blob")
        return self.alias.get(v, v)

    def only_consumer(self, v: str):
        """The one node reading ``v`` (None when several do or ``v`` is a graph output)."""
        users = self.consumers.get(v, [])
        return users[0] if len(users) == 1 and v not in self.graph_outputs else None

    def shape(self, v: str) -> list[int | None]:
        """The inferred shape of ``v`` (None for a symbolic dimension; [] when unknown)."""
        return self.shapes.get(v, [])

    def attr(self, node, name: str, default=None):
        """Attribute ``name`` of ``node`` (``default`` when absent)."""
        for a in node.attribute:
            if a.name == name:
                return self.onnx.helper.get_attribute_value(a)
        return default

    def layer(self, node, type_: str, bottoms: list[str], tops: list[str] | None = None,
              blobs: list[np.ndarray] = (), name: str | None = None) -> caffe_pb2.LayerParameter:
        """Append a layer (named after ``node`` unless ``name``, made unique) and its weight blobs, bits kept."""
        name = name or node.name or node.output[0]
        base, k = name, 1
        while name in self.layer_names:
            name, k = f"{base}_{k}", k + 1
        self.layer_names.add(name)
        lp = self.net.layer.add(name=name, type=type_)
        lp.bottom.extend(bottoms)
        lp.top.extend(tops if tops is not None else [node.output[0]])
        if blobs:
            wl = self.weights.layer.add(name=name, type=type_)
            for b in blobs:
                wl.blobs.append(array_to_blobproto(np.asarray(b, dtype=np.float32)))
        return lp

    def scalar(self, node, v: str) -> float | None:
        """The value of a one-element constant ``v``, else None."""
        c = self.const(v)
        return float(c.reshape(-1)[0]) if c is not None and c.size == 1 else None

    # -- the walk ---------------------------------------------------------------------------------------
    def mark(self, node) -> None:
        """Mark ``node`` as converted (part of a layer emitted at another node)."""
        self.done.add(next(i for i, n in enumerate(self.graph.node) if n is node))

    def users(self, v: str) -> list:
        """The nodes reading ``v`` (none when it is also a graph output: then it must stay a blob)."""
        return [] if v in self.graph_outputs else self.consumers.get(v, [])

    def ints(self, v: str) -> list[int] | None:
        """A constant integer tensor as a list (None when not a constant)."""
        c = self.const(v)
        return None if c is None or c.dtype.kind not in "iu" else [int(x) for x in c.reshape(-1)]
