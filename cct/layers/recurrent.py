"""Recurrent layers: ``LSTMUnit``, and ``LSTM`` / ``RNN`` through Caffe's RecurrentLayer contract.

Caffe builds an unrolled net for ``LSTM`` and ``RNN``; cct runs the same arithmetic as one loop
over time steps on ``xp`` arrays, keeping Caffe's contract and parameter layout:

* Bottoms ``x`` (T, N, ...) time-major, ``cont`` (T, N) sequence continuation (0 starts a new
  sequence: it multiplies ``h_{t-1}``, and for LSTM also the forget gate), optionally ``x_static``
  (N, ...) added to every step's gate input, then with ``expose_hidden`` the initial states
  (``h_0``, LSTM also ``c_0``, each (1, N, num_output)).
* Tops ``h`` (LSTM) or ``o`` (RNN), (T, N, num_output); with ``expose_hidden`` also the final
  states ``h_T`` (and ``c_T``), (1, N, num_output).
* Without ``expose_hidden`` the initial state is the previous forward's final state (zeros in a
  fresh layer or after the batch size changed), as Caffe's unrolled net carries it over.
* Parameters in the unrolled net's order, so Caffe-trained weights load: LSTM ``W_xc`` (4H, D),
  ``b_c`` (4H), [``W_xc_static`` (4H, D_static)], ``W_hc`` (4H, H), gate rows in blocks i, f, o, g;
  RNN ``W_xh`` (H, D), ``b_h`` (H), [``W_xh_static`` (H, D_static)], ``W_hh`` (H, H), ``W_ho``
  (H, H), ``b_o`` (H).
* No gradient to ``cont`` (Caffe refuses it), and, as in Caffe (the exposed states are only
  data-shared with the unrolled net's inputs), none to ``h_0`` / ``c_0`` nor from ``h_T`` /
  ``c_T``: their diffs are set to zero.
"""
from __future__ import annotations

from collections.abc import Sequence

from .. import blas
from ..blob import Blob
from ..proto import caffe_pb2
from .base import Layer, register


def _sigmoid(xp, x):
    """Overflow-free logistic function."""
    return 0.5 * xp.tanh(0.5 * x) + 0.5


def lstm_unit_forward(xp, c_prev, gates, cont):
    """One LSTM step as Caffe's LSTMUnit: ``c_prev`` (N, D), ``gates`` (N, 4D) pre-activation in
    blocks i, f, o, g, ``cont`` (N,). Returns ``(c, h)``; f is 0 where cont is 0, else cont * f."""
    d = c_prev.shape[-1]
    i = _sigmoid(xp, gates[:, :d])
    f = _sigmoid(xp, gates[:, d:2 * d]) * cont[:, None]
    o = _sigmoid(xp, gates[:, 2 * d:3 * d])
    g = xp.tanh(gates[:, 3 * d:])
    c = f * c_prev + i * g
    return c, o * xp.tanh(c)


def lstm_unit_backward(xp, c_prev, gates, cont, c, dc, dh):
    """Caffe's LSTMUnit backward for one step: ``(dc_prev, dgates)``.

    ``dc``/``dh``: the diffs of the step's c and h. As Caffe, the f block uses ``f (1 - f)`` with
    f = cont * sigmoid (the exact derivative for binary cont)."""
    d = c_prev.shape[-1]
    i = _sigmoid(xp, gates[:, :d])
    f = _sigmoid(xp, gates[:, d:2 * d]) * cont[:, None]
    o = _sigmoid(xp, gates[:, 2 * d:3 * d])
    g = xp.tanh(gates[:, 3 * d:])
    tanh_c = xp.tanh(c)
    c_term = dc + dh * o * (1 - tanh_c * tanh_c)
    dgates = xp.empty_like(gates)
    dgates[:, :d] = c_term * g * i * (1 - i)
    dgates[:, d:2 * d] = c_term * c_prev * f * (1 - f)
    dgates[:, 2 * d:3 * d] = dh * tanh_c * o * (1 - o)
    dgates[:, 3 * d:] = c_term * i * (1 - g * g)
    return c_term * f, dgates


@register("LSTMUnit")
class LSTMUnitLayer(Layer):
    """Caffe's LSTMUnit: bottoms c_prev (1, N, D), gates (1, N, 4D), cont (1, N); tops c, h (1, N, D)."""

    exact_num_bottom = 3
    exact_num_top = 2

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        n = bottom[0].shape[1] if bottom[0].num_axes > 1 else -1
        for i, b in enumerate(bottom):
            axes = 2 if i == 2 else 3
            if b.num_axes != axes or b.shape[0] != 1 or b.shape[1] != n:
                want = "(1, N)" if i == 2 else "(1, N, D)" if i == 0 else "(1, N, 4D)"
                raise self.error(f"bottom[{i}] must have shape {want} with N = {n} taken from bottom[0]; "
                                 f"got shapes {[list(x.shape) for x in bottom]}")
        self.hidden_dim = bottom[0].shape[2]
        if bottom[1].shape[2] != 4 * self.hidden_dim:
            raise self.error(f"bottom[1] (gates) must have 4 * {self.hidden_dim} = {4 * self.hidden_dim} "
                             f"entries per instance, got shape {list(bottom[1].shape)}")
        top[0].reshape_like(bottom[0])
        top[1].reshape_like(bottom[0])

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        xp = bottom[0].xp
        c, h = lstm_unit_forward(xp, bottom[0].data[0], bottom[1].data[0], bottom[2].data[0])
        top[0].data[0] = c
        top[1].data[0] = h

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if propagate_down[2]:
            raise self.error("Cannot backpropagate to sequence indicators.")
        if not (propagate_down[0] or propagate_down[1]):
            return
        xp = bottom[0].xp
        dc_prev, dgates = lstm_unit_backward(xp, bottom[0].data[0], bottom[1].data[0], bottom[2].data[0],
                                             top[0].data[0], top[0].diff[0], top[1].diff[0])
        if propagate_down[0]:
            bottom[0].diff[0] = dc_prev
        if propagate_down[1]:
            bottom[1].diff[0] = dgates

    def allow_force_backward(self, bottom_index: int) -> bool:
        return bottom_index != 2


class RecurrentLayer(Layer):
    """Caffe's RecurrentLayer contract (see the module docstring); subclasses give the cell."""

    param_fields = ("recurrent_param",)
    # Names of the recurrent states (Caffe's RecurrentInputBlobNames order), set by subclasses.
    state_names: tuple[str, ...] = ()
    # Gate rows per hidden unit in the x and h transforms (LSTM 4, RNN 1).
    gate_factor = 1

    def __init__(self, param: caffe_pb2.LayerParameter):
        super().__init__(param)
        rp = param.recurrent_param
        self.expose_hidden = bool(rp.expose_hidden)
        exposed = len(self.state_names) if self.expose_hidden else 0
        self.min_num_bottom = 2 + exposed
        self.max_num_bottom = 3 + exposed
        self.exact_num_top = 1 + exposed

    # -- setup -----------------------------------------------------------------------------
    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        rp = self.param.recurrent_param
        if rp.debug_info:
            raise self.unsupported("recurrent_param.debug_info (the unrolled net's debug output)")
        self.H = int(rp.num_output)
        if self.H <= 0:
            raise self.error("recurrent_param.num_output must be positive")
        x = bottom[0]
        if x.num_axes < 2:
            raise self.error(f"bottom[0] must have at least 2 axes -- (#timesteps, #streams, ...); "
                             f"got shape {list(x.shape)}")
        self.T = x.shape[0]
        self._check_cont(bottom)
        exposed = len(self.state_names) if self.expose_hidden else 0
        self.static_input = len(bottom) > 2 + exposed
        self.D = x.count_range(2)
        if self.static_input:
            xs = bottom[2]
            if xs.num_axes < 1 or xs.shape[0] != x.shape[1]:
                raise self.error(f"bottom[2] (x_static) must have shape (N, ...) with N = {x.shape[1]}; "
                                 f"got {list(xs.shape)}")
            self.D_static = xs.count_range(1)
        shapes = self.param_shapes()
        if self.params_given(len(shapes)):
            for j, (b, s) in enumerate(zip(self.blobs, shapes)):
                if tuple(b.shape) != s:
                    raise self.error(f"parameter {j} has shape {list(b.shape)}; expected {list(s)} "
                                     f"(Caffe's unrolled-net layout)")
        else:
            self.blobs = [self.make_param(s, rp.bias_filler if len(s) == 1 else rp.weight_filler, like=x)
                          for s in shapes]
        self.param_propagate_down = [True] * len(self.blobs)
        self._state: list = []

    def param_shapes(self) -> list[tuple[int, ...]]:
        """Parameter shapes in Caffe's order: W_x, b, [W_x_static], then the cell's own."""
        g = self.gate_factor * self.H
        shapes = [(g, self.D), (g,)]
        if self.static_input:
            shapes.append((g, self.D_static))
        return shapes + self.cell_param_shapes()

    def cell_param_shapes(self) -> list[tuple[int, ...]]:
        raise NotImplementedError

    def _check_cont(self, bottom: Sequence[Blob]) -> None:
        x, cont = bottom[0], bottom[1]
        if cont.num_axes != 2 or cont.shape != tuple(x.shape[:2]):
            raise self.error(f"bottom[1] (cont) must have exactly 2 axes -- (#timesteps, #streams) = "
                             f"{list(x.shape[:2])}; got {list(cont.shape)}")

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        x = bottom[0]
        if x.num_axes < 2:
            raise self.error(f"bottom[0] must have at least 2 axes -- (#timesteps, #streams, ...); "
                             f"got shape {list(x.shape)}")
        if x.shape[0] != self.T:
            raise self.error(f"input number of timesteps changed: {self.T} at setup, now {x.shape[0]}")
        if x.count_range(2) != self.D:
            raise self.error(f"bottom[0] has {x.count_range(2)} inputs per step, the weights expect {self.D}")
        self._check_cont(bottom)
        self.N = x.shape[1]
        if self.static_input:
            xs = bottom[2]
            if xs.num_axes < 1 or xs.shape[0] != self.N or xs.count_range(1) != self.D_static:
                raise self.error(f"bottom[2] (x_static) must be ({self.N}, ...) with {self.D_static} inputs per "
                                 f"stream; got {list(xs.shape)}")
        state_shape = (1, self.N, self.H)
        if self.expose_hidden:
            off = 2 + int(self.static_input)
            for j, name in enumerate(self.state_names):
                b = bottom[off + j]
                if tuple(b.shape) != state_shape:
                    raise self.error(f"shape mismatch - {name} (bottom[{off + j}]) must be {list(state_shape)}; "
                                     f"got {list(b.shape)}")
            for j in range(len(self.state_names)):
                top[1 + j].reshape(state_shape)
        if not self._state or tuple(self._state[0].shape) != state_shape:
            self._state = [x.xp.zeros(state_shape, dtype=x.dtype) for _ in self.state_names]
        top[0].reshape((self.T, self.N, self.H))

    def allow_force_backward(self, bottom_index: int) -> bool:
        return bottom_index != 1

    def reset(self) -> None:
        """Zero the carried-over hidden state (Caffe's RecurrentLayer::Reset)."""
        for s in self._state:
            s[...] = 0

    # -- shared pieces of forward/backward ----------------------------------------------------
    def _initial_states(self, bottom: Sequence[Blob]) -> list:
        if self.expose_hidden:
            off = 2 + int(self.static_input)
            return [bottom[off + j].data[0] for j in range(len(self.state_names))]
        return [s[0] for s in self._state]

    def _finish_forward(self, finals: Sequence, top: Sequence[Blob]) -> None:
        for j, f in enumerate(finals):
            if self.expose_hidden:
                top[1 + j].data[0] = f
            else:
                self._state[j][0] = f

    def _input_transform(self, bottom: Sequence[Blob]):
        """``W_x x_t + b`` for every step (T, N, G), plus the static term (N, G) or None."""
        xp = bottom[0].xp
        w, b = self.blobs[0].data, self.blobs[1].data
        x = bottom[0].data.reshape(self.T * self.N, self.D)
        xw = blas.matmul(x, w.T)
        xw += b
        static = None
        if self.static_input:
            xs = bottom[2].data.reshape(self.N, self.D_static)
            static = blas.matmul(xs, self.blobs[2].data.T)
        return xp.ascontiguousarray(xw).reshape(self.T, self.N, -1), static

    def _input_backward(self, dgates, propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        """Gradients of W_x, b, [W_x_static], x and x_static from the gate-input diffs (T, N, G)."""
        g = dgates.reshape(self.T * self.N, -1)
        x = bottom[0].data.reshape(self.T * self.N, self.D)
        ppd = self.param_propagate_down
        if ppd[0]:
            self.blobs[0].diff += blas.matmul(g.T, x)
        if ppd[1]:
            self.blobs[1].diff += g.sum(axis=0)
        if propagate_down[0]:
            bottom[0].diff[...] = blas.matmul(g, self.blobs[0].data).reshape(bottom[0].shape)
        if self.static_input:
            gs = dgates.sum(axis=0)
            if ppd[2]:
                self.blobs[2].diff += blas.matmul(gs.T, bottom[2].data.reshape(self.N, self.D_static))
            if propagate_down[2]:
                bottom[2].diff[...] = blas.matmul(gs, self.blobs[2].data).reshape(bottom[2].shape)
        if self.expose_hidden:
            off = 2 + int(self.static_input)
            for j in range(len(self.state_names)):
                if propagate_down[off + j]:
                    bottom[off + j].diff[...] = 0

    def _check_backward(self, propagate_down: Sequence[bool]) -> None:
        if propagate_down[1]:
            raise self.error("Cannot backpropagate to sequence indicators.")

    @property
    def _cell_offset(self) -> int:
        """Index in ``self.blobs`` of the first recurrent (cell) parameter."""
        return 3 if self.static_input else 2


@register("LSTM")
class LSTMLayer(RecurrentLayer):
    """Caffe's LSTM: gates = W_hc (cont_t h_{t-1}) + W_xc x_t + b_c [+ W_xc_static x_static];
    c_t = cont_t f c_{t-1} + i g; h_t = o tanh(c_t). Top h (T, N, H)."""

    state_names = ("h_0", "c_0")
    gate_factor = 4

    def cell_param_shapes(self) -> list[tuple[int, ...]]:
        return [(4 * self.H, self.H)]

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        xp = bottom[0].xp
        w_hc = self.blobs[self._cell_offset].data
        xw, static = self._input_transform(bottom)
        cont = bottom[1].data
        h_prev, c_prev = (s.copy() for s in self._initial_states(bottom))
        T, N, H = self.T, self.N, self.H
        dt = bottom[0].dtype
        self.h_conted = xp.empty((T, N, H), dtype=dt)
        self.gates = xp.empty((T, N, 4 * H), dtype=dt)
        self.c = xp.empty((T + 1, N, H), dtype=dt)
        self.c[0] = c_prev
        out = top[0].data
        for t in range(T):
            hc = self.h_conted[t]
            xp.multiply(h_prev, cont[t][:, None], out=hc)
            gates = self.gates[t]
            blas.matmul(hc, w_hc.T, out=gates)
            gates += xw[t]
            if static is not None:
                gates += static
            c, h = lstm_unit_forward(xp, self.c[t], gates, cont[t])
            self.c[t + 1] = c
            out[t] = h
            h_prev = out[t]
        self._finish_forward([out[T - 1], self.c[T]], top)

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        self._check_backward(propagate_down)
        xp = bottom[0].xp
        k = self._cell_offset
        w_hc = self.blobs[k].data
        cont = bottom[1].data
        dh_top = top[0].diff
        T, N, H = self.T, self.N, self.H
        dgates = xp.empty_like(self.gates)
        dh_next = xp.zeros((N, H), dtype=dh_top.dtype)
        dc_next = xp.zeros((N, H), dtype=dh_top.dtype)
        for t in range(T - 1, -1, -1):
            dc_prev, dgates[t] = lstm_unit_backward(xp, self.c[t], self.gates[t], cont[t], self.c[t + 1],
                                                    dc_next, dh_top[t] + dh_next)
            dh_next = blas.matmul(dgates[t], w_hc) * cont[t][:, None]
            dc_next = dc_prev
        if self.param_propagate_down[k]:
            self.blobs[k].diff += blas.matmul(dgates.reshape(T * N, 4 * H).T, self.h_conted.reshape(T * N, H))
        self._input_backward(dgates, propagate_down, bottom)


@register("RNN")
class RNNLayer(RecurrentLayer):
    """Caffe's RNN: h_t = tanh(W_hh (cont_t h_{t-1}) + W_xh x_t + b_h [+ W_xh_static x_static]);
    o_t = tanh(W_ho h_t + b_o). Top o (T, N, H)."""

    state_names = ("h_0",)
    gate_factor = 1

    def cell_param_shapes(self) -> list[tuple[int, ...]]:
        return [(self.H, self.H), (self.H, self.H), (self.H,)]

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        xp = bottom[0].xp
        k = self._cell_offset
        w_hh, w_ho, b_o = (b.data for b in self.blobs[k:k + 3])
        xw, static = self._input_transform(bottom)
        cont = bottom[1].data
        (h_prev,) = (s.copy() for s in self._initial_states(bottom))
        T, N, H = self.T, self.N, self.H
        dt = bottom[0].dtype
        self.h_conted = xp.empty((T, N, H), dtype=dt)
        self.h = xp.empty((T, N, H), dtype=dt)
        for t in range(T):
            hc = self.h_conted[t]
            xp.multiply(h_prev, cont[t][:, None], out=hc)
            pre = blas.matmul(hc, w_hh.T)
            pre += xw[t]
            if static is not None:
                pre += static
            xp.tanh(pre, out=self.h[t])
            h_prev = self.h[t]
        o = blas.matmul(self.h.reshape(T * N, H), w_ho.T)
        o += b_o
        top[0].data[...] = xp.tanh(o).reshape(T, N, H)
        self._finish_forward([self.h[T - 1]], top)

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        self._check_backward(propagate_down)
        xp = bottom[0].xp
        k = self._cell_offset
        w_hh, w_ho = self.blobs[k].data, self.blobs[k + 1].data
        cont = bottom[1].data
        T, N, H = self.T, self.N, self.H
        o = top[0].data.reshape(T * N, H)
        do = top[0].diff.reshape(T * N, H) * (1 - o * o)
        h_all = self.h.reshape(T * N, H)
        ppd = self.param_propagate_down
        if ppd[k + 1]:
            self.blobs[k + 1].diff += blas.matmul(do.T, h_all)
        if ppd[k + 2]:
            self.blobs[k + 2].diff += do.sum(axis=0)
        dh_o = blas.matmul(do, w_ho).reshape(T, N, H)
        dpre = xp.empty((T, N, H), dtype=do.dtype)
        dh_next = xp.zeros((N, H), dtype=do.dtype)
        for t in range(T - 1, -1, -1):
            h = self.h[t]
            dpre[t] = (dh_o[t] + dh_next) * (1 - h * h)
            dh_next = blas.matmul(dpre[t], w_hh) * cont[t][:, None]
        if ppd[k]:
            self.blobs[k].diff += blas.matmul(dpre.reshape(T * N, H).T, self.h_conted.reshape(T * N, H))
        self._input_backward(dpre, propagate_down, bottom)


__all__ = ["LSTMLayer", "LSTMUnitLayer", "RNNLayer", "RecurrentLayer", "lstm_unit_backward",
           "lstm_unit_forward"]
