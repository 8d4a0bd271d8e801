"""ONNX converters for Caffe's LSTM and RNN layers, unrolled over their (fixed) number of time steps.

ONNX's LSTM/RNN ops cannot reset the state inside a sequence, which Caffe's per-step ``cont`` input
does (``h_{t-1}`` and, for LSTM, the forget gate are multiplied by ``cont_t``), and they order the
LSTM gates differently: so the layers are written out step by step with Caffe's arithmetic
(gate blocks i, f, o, g; the parameters in Caffe's unrolled-net layout, each used through one
Transpose so the stored bits are kept). The graph is one forward of a fresh layer: its initial state
is zero, or the ``h_0`` (``c_0``) inputs with ``expose_hidden``; the state a Caffe layer without
``expose_hidden`` carries from one forward call to the next is not part of a stateless ONNX graph.
"""
from __future__ import annotations

import numpy as np

from .layers import LayerContext


def _weight_t(c: LayerContext, i: int) -> str:
    """Parameter blob ``i`` (G, D) as the (D, G) right operand of a MatMul, bits kept."""
    return c.g.one("Transpose", [c.param(i)], name=f"{c.name}/w{i}_t", perm=[1, 0])


def _step(c: LayerContext, values: str, t: int) -> str:
    """Step ``t`` of a time-major value (T, N, ...) -> (N, ...)."""
    return c.node("Gather", [values, c.g.const(f"{c.name}.t{t}", np.int64(t), np.int64)], axis=0)


def _input_gates(c: LayerContext) -> tuple[str, str | None]:
    """``W_x x_t + b`` for all steps (T, N, G) and the static input's term (N, G) or None."""
    layer = c.layer
    x = c.node("Reshape", [c.bottoms[0], c.g.ints(f"{c.name}.x_shape", [0, 0, layer.D])])
    gx = c.node("Add", [c.node("MatMul", [x, _weight_t(c, 0)]), c.param(1)])
    static = None
    if layer.static_input:
        xs = c.node("Reshape", [c.bottoms[2], c.g.ints(f"{c.name}.xs_shape", [0, layer.D_static])])
        static = c.node("MatMul", [xs, _weight_t(c, 2)])
    return gx, static


def _initial_state(c: LayerContext, j: int) -> str:
    """State ``j`` at t = 0 (N, H): the exposed input, or zeros shaped after the batch."""
    layer = c.layer
    if layer.expose_hidden:
        off = 2 + int(layer.static_input)
        return c.node("Reshape", [c.bottoms[off + j], c.g.ints(f"{c.name}.state_shape", [-1, layer.H])])
    n = c.node("Slice", [c.node("Shape", [c.bottoms[1]]), c.g.ints(f"{c.name}.one", [1]),
                         c.g.ints(f"{c.name}.two", [2])])
    shape = c.node("Concat", [n, c.g.ints(f"{c.name}.h", [layer.H])], axis=0)
    return c.node("ConstantOfShape", [shape], value=c.g.onnx.numpy_helper.from_array(np.zeros(1, np.float32)))


def _finish(c: LayerContext, steps: list[str], finals: list[str]) -> None:
    """Stack the per-step outputs into top 0 (T, N, H); exposed final states into tops 1.. (1, N, H)."""
    axis0 = c.g.ints(f"{c.name}.axis0", [0])
    stacked = [c.node("Unsqueeze", [s, axis0]) for s in steps]
    if len(stacked) > 1:
        c.node("Concat", stacked, 0, axis=0)
    else:
        c.node("Identity", stacked, 0)
    if c.layer.expose_hidden:
        for j, f in enumerate(finals):
            c.node("Unsqueeze", [f, axis0], 1 + j)


def _lstm_cell(c: LayerContext, gates: str, c_prev: str, cont: str, axis: int, tag: str,
               outputs: tuple[int | None, int | None] = (None, None)) -> tuple[str, str]:
    """Caffe's LSTMUnit arithmetic on gate blocks i, f, o, g along ``axis``: (c, h)."""
    hidden = c.layer.H if c.lp.type == "LSTM" else c.layer.hidden_dim
    split = c.g.ints(f"{c.name}.gate_split", [hidden] * 4)
    i, f, o, g = c.g.node("Split", [gates, split], [c.g.fresh(f"{c.name}.{k}{tag}") for k in "ifog"],
                          name=c.name, axis=axis)
    f = c.node("Mul", [c.node("Sigmoid", [f]), cont])
    ig = c.node("Mul", [c.node("Sigmoid", [i]), c.node("Tanh", [g])])
    cell = c.node("Add", [c.node("Mul", [f, c_prev]), ig], outputs[0])
    h = c.node("Mul", [c.node("Sigmoid", [o]), c.node("Tanh", [cell])], outputs[1])
    return cell, h


def convert_lstm_unit(c: LayerContext) -> None:
    """Caffe's LSTMUnit: bottoms c_prev (1, N, D), gates (1, N, 4D), cont (1, N); tops c, h."""
    cont = c.node("Unsqueeze", [c.bottoms[2], c.g.ints(f"{c.name}.axis2", [2])])  # (1, N, 1)
    _lstm_cell(c, c.bottoms[1], c.bottoms[0], cont, 2, "", (0, 1))


def convert_lstm(c: LayerContext) -> None:
    """Caffe's LSTM: gates = W_x x_t + b [+ W_s x_static] + W_h (cont_t h_{t-1}); c = cont_t f c_{t-1} + i g."""
    layer = c.layer
    gx, static = _input_gates(c)
    w_h = _weight_t(c, layer._cell_offset)
    cont = c.node("Unsqueeze", [c.bottoms[1], c.g.ints(f"{c.name}.axis2", [2])])  # (T, N, 1)
    h, cell = _initial_state(c, 0), _initial_state(c, 1)
    steps = []
    for t in range(layer.T):
        cont_t = _step(c, cont, t)
        gates = c.node("Add", [c.node("MatMul", [c.node("Mul", [h, cont_t]), w_h]), _step(c, gx, t)])
        if static is not None:
            gates = c.node("Add", [gates, static])
        cell, h = _lstm_cell(c, gates, cell, cont_t, 1, str(t))
        steps.append(h)
    _finish(c, steps, [h, cell])


def convert_rnn(c: LayerContext) -> None:
    """Caffe's RNN: h_t = tanh(W_x x_t + b [+ W_s x_static] + W_hh (cont_t h_{t-1})), o_t = tanh(W_ho h_t + b_o)."""
    layer = c.layer
    gx, static = _input_gates(c)
    k = layer._cell_offset
    w_hh, w_ho, b_o = _weight_t(c, k), _weight_t(c, k + 1), c.param(k + 2)
    cont = c.node("Unsqueeze", [c.bottoms[1], c.g.ints(f"{c.name}.axis2", [2])])
    h = _initial_state(c, 0)
    outputs = []
    for t in range(layer.T):
        pre = c.node("Add", [c.node("MatMul", [c.node("Mul", [h, _step(c, cont, t)]), w_hh]), _step(c, gx, t)])
        if static is not None:
            pre = c.node("Add", [pre, static])
        h = c.node("Tanh", [pre])
        outputs.append(c.node("Tanh", [c.node("Add", [c.node("MatMul", [h, w_ho]), b_o])]))
    _finish(c, outputs, [h])
