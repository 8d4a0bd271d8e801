"""A small ONNX graph builder: nodes, constant initializers and unique value names, nothing else.

The exporter (:mod:`cct.onnx.export`) and the layer converters (:mod:`cct.onnx.layers`) add nodes
through one :class:`GraphBuilder`; :meth:`GraphBuilder.model` assembles the ``ModelProto``.
"""
from __future__ import annotations

import importlib
from collections.abc import Sequence

import numpy as np

from .. import __version__
from ..errors import CctError


def require(module: str):
    """Import an optional dependency of the ONNX tools, or raise a CctError naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise CctError(f"ONNX support needs '{module}' (install the [onnx] extra: pip install 'cct[onnx]'): {e}") \
            from None


class GraphBuilder:
    """Collects the nodes and initializers of one ONNX graph; hands out unique value names."""

    def __init__(self, opset: int):
        self.onnx = require("onnx")
        self.opset = opset
        self.nodes: list = []
        self.initializers: list = []
        self.inputs: list = []
        self.outputs: list = []
        self.value_info: list = []
        self._used: set[str] = set()
        self._node_names: set[str] = set()

    def reserve(self, name: str) -> str:
        """Mark ``name`` as taken (graph inputs and blob values are named before they are produced)."""
        self._used.add(name)
        return name

    def fresh(self, hint: str) -> str:
        """A value name not used so far, ``hint`` itself when free."""
        name, k = hint, 1
        while name in self._used:
            name = f"{hint}_{k}"
            k += 1
        return self.reserve(name)

    def const(self, hint: str, array, dtype=np.float32) -> str:
        """An initializer holding ``array`` (converted to ``dtype``, bits kept when already that dtype)."""
        arr = np.asarray(array)
        if arr.dtype != dtype:
            arr = arr.astype(dtype)
        name = self.fresh(hint)
        arr = np.array(arr, order="C")  # (np.ascontiguousarray would turn a 0-d scalar into shape (1,))
        self.initializers.append(self.onnx.numpy_helper.from_array(arr, name))
        return name

    def ints(self, hint: str, values: Sequence[int]) -> str:
        """An int64 1-D initializer (shapes, axes, split sizes, repeats)."""
        return self.const(hint, np.asarray(list(values), dtype=np.int64), np.int64)

    def node(self, op: str, inputs: Sequence[str], outputs: Sequence[str] | str | None = None,
             name: str = "", **attrs) -> list[str]:
        """Append node ``op``; ``outputs`` given names, a count hint string, or None (one fresh value)."""
        if outputs is None or isinstance(outputs, str):
            outputs = [self.fresh(outputs or f"{name or op}_out")]
        node = self.onnx.helper.make_node(op, list(inputs), list(outputs), name=self._node_name(name or op), **attrs)
        self.nodes.append(node)
        return list(outputs)

    def _node_name(self, hint: str) -> str:
        """Node names are unique among nodes (a layer's first node carries the layer's name)."""
        name, k = hint, 1
        while name in self._node_names:
            name = f"{hint}_{k}"
            k += 1
        self._node_names.add(name)
        return name

    def one(self, op: str, inputs: Sequence[str], output: str | None = None, name: str = "", **attrs) -> str:
        """:meth:`node` for a single-output node; returns that output's name."""
        return self.node(op, inputs, [output] if output else None, name=name, **attrs)[0]

    def add_input(self, name: str, shape: Sequence[int | str]) -> None:
        """A float32 graph input of ``shape`` (a str entry is a symbolic dimension)."""
        self.inputs.append(self.onnx.helper.make_tensor_value_info(name, self.onnx.TensorProto.FLOAT, list(shape)))

    def add_output(self, name: str, shape: Sequence[int | str] | None) -> None:
        """A float32 graph output; ``shape`` None leaves it to shape inference."""
        self.outputs.append(self.onnx.helper.make_tensor_value_info(
            name, self.onnx.TensorProto.FLOAT, None if shape is None else list(shape)))

    def add_value_info(self, name: str, shape: Sequence[int | str]) -> None:
        """Declare the float32 shape of an inner value (where shape inference cannot derive it)."""
        self.value_info.append(self.onnx.helper.make_tensor_value_info(name, self.onnx.TensorProto.FLOAT, list(shape)))

    def model(self, graph_name: str, doc: str = ""):
        """The ``ModelProto`` of everything added so far."""
        helper = self.onnx.helper
        graph = helper.make_graph(self.nodes, graph_name or "cct", self.inputs, self.outputs, self.initializers,
                                  value_info=self.value_info)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)],
                                  producer_name="cct", producer_version=__version__, doc_string=doc)
        model.ir_version = helper.find_min_ir_version_for(model.opset_import)  # runtimes refuse newer IRs
        return model
