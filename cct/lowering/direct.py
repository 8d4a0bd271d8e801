"""Direct convolution (ZNNi IV-A.1): no lowered matrix, the kernel taps applied in place.

For thin layers (few channels), 1x1 kernels and small outputs the lowered matrix of a GEMM
lowering costs more memory traffic than the multiply-adds themselves; the direct kernels of
:mod:`cct.kernels.direct` read a zero-padded copy of the input and accumulate straight into the
output, register-blocked over output channels and vectorised over output positions. 1-, 2- and
3-D convolutions with groups, stride, padding and dilation; every geometry runs as a 3-D one
(leading unit axes). numpy float arrays with the kernels enabled take the compiled path; other
arrays (cupy, or ``CCT_KERNELS=numpy``) the array-module path below, one batched contraction per
kernel tap.

Operations declared to the cost model (:meth:`DirectConvolution.pass_ops`): the padding copy
(``copy``/``zero`` sweeps) and ``("direct", multiply_adds)``, priced with the calibrated direct
kernel rate; workspace: the padded input (and its gradient in the data pass).
"""
from __future__ import annotations

import itertools
import math
from typing import Any

from .. import kernels
from ..backend import get_array_module
from .base import LoweringStrategy, register_strategy
from .geometry import ConvGeometry


def _as3(values: tuple[int, ...], fill: int) -> tuple[int, ...]:
    return (fill,) * (3 - len(values)) + tuple(values)


def pad_input(x: Any, geom: ConvGeometry) -> Any:
    """``(N, C, *used_extent)``: ``x`` zero-padded and cropped to the region the windows touch."""
    xp = get_array_module(x)
    ext = geom.used_extent
    dst, src = geom.interior(ext)
    full = all(d.start == 0 and d.stop == e for d, e in zip(dst, ext))
    buf = (xp.empty if full else xp.zeros)(x.shape[:2] + tuple(ext), dtype=x.dtype)
    buf[(slice(None), slice(None)) + dst] = x[(slice(None), slice(None)) + src]
    return buf


def _to3(a: Any, nd: int) -> Any:
    """View ``(N, C, *spatial)`` with exactly three spatial axes (leading unit axes added)."""
    return a.reshape(a.shape[:2] + (1,) * (3 - nd) + a.shape[2:])


def _taps(geom: ConvGeometry):
    """``(kernel offset, slices into the padded input)`` per kernel tap."""
    for k in itertools.product(*(range(v) for v in geom.kernel)):
        yield k, tuple(slice(o * d, o * d + (n - 1) * s + 1, s)
                       for o, d, n, s in zip(k, geom.dilation, geom.out_shape, geom.stride))


class DirectConvolution(LoweringStrategy):
    """Direct convolution (see module docstring)."""

    name = "direct"

    def supports(self, geom: ConvGeometry) -> bool:
        """1-, 2- and 3-D convolutions with a non-empty output."""
        return 1 <= geom.num_spatial <= 3 and geom.out_size > 0

    # -- the three passes -------------------------------------------------------------------
    def forward(self, x: Any, w: Any, b: Any, geom: ConvGeometry) -> Any:
        xp = get_array_module(x)
        n, nd = x.shape[0], geom.num_spatial
        y = xp.zeros((n, geom.channels_out) + tuple(geom.out_shape), dtype=x.dtype)
        if n and x.size:
            xpad = pad_input(x, geom)
            km = self._kernels(xpad, w, y)
            if km is not None:
                s, d = _as3(geom.stride, 1), _as3(geom.dilation, 1)
                w3 = w.reshape(w.shape[:2] + (1,) * (3 - nd) + w.shape[2:])
                km.forward(_to3(xpad, nd), km.blocked_weights(w3, geom.group), _to3(y, nd), geom.group, *s, *d)
            else:
                self._forward_xp(xpad, w, y, geom)
        if b is not None:
            y += b.reshape((1, -1) + (1,) * nd)
        return y

    def backward_data(self, dy: Any, w: Any, geom: ConvGeometry) -> Any:
        xp = get_array_module(dy)
        n, nd = dy.shape[0], geom.num_spatial
        dxp = xp.zeros((n, geom.channels_in) + tuple(geom.used_extent), dtype=dy.dtype)
        if n and dy.size:
            km = self._kernels(dy, w, dxp)
            if km is not None:
                s, d = _as3(geom.stride, 1), _as3(geom.dilation, 1)
                w3 = xp.ascontiguousarray(w.reshape(w.shape[:2] + (1,) * (3 - nd) + w.shape[2:]))
                km.backward_data(_to3(xp.ascontiguousarray(dy), nd), w3, _to3(dxp, nd), geom.group, *s, *d)
            else:
                self._backward_data_xp(dy, w, dxp, geom)
        dx = xp.zeros((n, geom.channels_in) + tuple(geom.in_shape), dtype=dy.dtype)
        dst, src = geom.interior()
        dx[(slice(None), slice(None)) + src] = dxp[(slice(None), slice(None)) + dst]
        return dx

    def backward_weights(self, dy: Any, x: Any, geom: ConvGeometry) -> tuple[Any, Any]:
        xp = get_array_module(dy)
        nd = geom.num_spatial
        dw = xp.zeros(geom.weight_shape, dtype=dy.dtype)
        db = dy.sum(axis=(0,) + tuple(range(2, 2 + nd))) if geom.bias_term else None
        if dy.shape[0] and dy.size:
            xpad = pad_input(x, geom)
            km = self._kernels(dy, xpad, dw)
            if km is not None:
                s, d = _as3(geom.stride, 1), _as3(geom.dilation, 1)
                dw3 = dw.reshape(dw.shape[:2] + (1,) * (3 - nd) + dw.shape[2:])
                km.backward_weights(_to3(xp.ascontiguousarray(dy), nd), _to3(xpad, nd), dw3, geom.group, *s, *d)
            else:
                self._backward_weights_xp(dy, xpad, dw, geom)
        return dw, db

    # -- array-module path (cupy, or kernels off) ---------------------------------------------
    @staticmethod
    def _kernels(*arrays: Any):
        return kernels.get("direct") if kernels.usable(*arrays) else None

    @staticmethod
    def _forward_xp(xpad: Any, w: Any, y: Any, geom: ConvGeometry) -> None:
        xp = get_array_module(xpad)
        g, n = geom.group, xpad.shape[0]
        cg, mg = geom.channels_in // g, geom.channels_out // g
        yg = y.reshape((n, g, mg, geom.out_size))
        for k, sl in _taps(geom):
            win = xpad[(slice(None), slice(None)) + sl].reshape(n, g, cg, geom.out_size)
            wk = w[(slice(None), slice(None)) + k].reshape(g, mg, cg)
            yg += xp.einsum("gmc,ngcp->ngmp", wk, win)

    @staticmethod
    def _backward_data_xp(dy: Any, w: Any, dxp: Any, geom: ConvGeometry) -> None:
        xp = get_array_module(dy)
        g, n = geom.group, dy.shape[0]
        cg, mg = geom.channels_in // g, geom.channels_out // g
        dyg = dy.reshape(n, g, mg, geom.out_size)
        for k, sl in _taps(geom):
            wk = w[(slice(None), slice(None)) + k].reshape(g, mg, cg)
            contrib = xp.einsum("gmc,ngmp->ngcp", wk, dyg).reshape((n, geom.channels_in) + tuple(geom.out_shape))
            dxp[(slice(None), slice(None)) + sl] += contrib

    @staticmethod
    def _backward_weights_xp(dy: Any, xpad: Any, dw: Any, geom: ConvGeometry) -> None:
        xp = get_array_module(dy)
        g, n = geom.group, dy.shape[0]
        cg, mg = geom.channels_in // g, geom.channels_out // g
        dyg = dy.reshape(n, g, mg, geom.out_size)
        for k, sl in _taps(geom):
            win = xpad[(slice(None), slice(None)) + sl].reshape(n, g, cg, geom.out_size)
            dw[(slice(None), slice(None)) + k] += xp.einsum("ngmp,ngcp->gmc", dyg, win).reshape(
                geom.channels_out, cg)

    # -- what the cost model prices -------------------------------------------------------------
    def pass_ops(self, geom: ConvGeometry, batch: int, pass_: str) -> list[tuple]:
        """``copy``/``zero`` sweeps of the padding and ``("direct", multiply-adds)``."""
        macs = batch * geom.channels_out * (geom.channels_in // geom.group) * geom.kernel_size * geom.out_size
        padded = batch * geom.channels_in * math.prod(geom.used_extent)
        inp = batch * geom.channels_in * geom.in_size
        if pass_ == "fwd":
            return [("zero", padded), ("copy", inp), ("direct", macs)]
        if pass_ == "bwd_data":
            return [("zero", padded), ("direct", macs), ("copy", inp)]
        if pass_ == "bwd_weights":
            return [("zero", padded), ("copy", inp), ("direct", macs),
                    ("add", batch * geom.channels_out * geom.out_size)]
        raise ValueError(f"unknown pass {pass_!r}")

    def workspace_bytes(self, geom: ConvGeometry, batch: int, itemsize: int = 4) -> int:
        """The padded input (or its gradient) and the blocked weights."""
        return int(itemsize * (batch * geom.channels_in * math.prod(geom.used_extent)
                               + 2 * math.prod(geom.weight_shape)))


register_strategy("direct", DirectConvolution)
