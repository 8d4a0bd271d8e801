"""FFT convolution with pruned kernel transforms (ZNNi sections III and IV-A.2), 1-, 2- and 3-D.

Every spatial axis is transformed at ``F = next_fast_len(E)`` points, ``E`` the padded extent the
windows touch (:attr:`ConvGeometry.used_extent`); ``F >= E`` makes the circular products equal the
linear ones on every position used. Per group and frequency the channel sums are complex GEMMs:

* forward: ``Y[n, m] = sum_c X[n, c] * conj(W[m, c])`` (a correlation), ``y`` = the first
  ``(out - 1) * s + 1`` positions of ``irfft(Y)`` taken every ``s`` (stride);
* data gradient: ``dX[n, c] = sum_m DY[n, m] * W[m, c]`` with ``dy`` spread ``s`` apart;
* weight gradient: ``dW[m, c] = sum_n conj(DY[n, m]) * X[n, c]``, the first kernel-extent
  positions of its inverse taken every ``d`` (dilation).

Pruned transforms (ZNNi Figure 2): a kernel only fills ``k`` of the ``F`` points per axis, so it is
transformed one axis at a time (real FFT of the last axis first), each stage only over the lines
that are not all zero; inverse transforms keep, axis by axis, only the lines whose outputs are
used. The kernel's transform is cached from the forward pass for the data gradient of the same
iteration (reused while the weights are unchanged: they are compared with a kept copy).

Transforms run through the array module: ``scipy.fft`` for numpy (``workers`` = the BLAS thread
count), ``cupy.fft`` for cupy. Operations declared to the cost model follow ZNNi Table I
(``("fft", flops)`` per transform stage and complex GEMMs ``("cgemm", m, n, k, count)``); the
workspace follows Table II (input, kernel and output transforms of one chunk).
"""
from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any

import numpy as np

from .. import blas
from ..backend import get_array_module
from .base import LoweringStrategy, register_strategy
from .direct import pad_input
from .geometry import ConvGeometry


def _fft_module(xp: Any) -> tuple[Any, dict]:
    if xp is np:
        import scipy.fft as sfft

        return sfft, {"workers": max(1, blas.get_num_threads())}
    return xp.fft, {}


def rfftn(a: Any, shape: tuple[int, ...]) -> Any:
    """``rfftn(a, s=shape)`` over the trailing ``len(shape)`` axes (no pruning)."""
    f, kw = _fft_module(get_array_module(a))
    return f.rfftn(a, s=shape, axes=tuple(range(a.ndim - len(shape), a.ndim)), **kw)


def fft_shape(geom: ConvGeometry) -> tuple[int, ...]:
    """Transform size per spatial axis: the next fast length >= the used extent."""
    import scipy.fft as sfft

    return tuple(int(sfft.next_fast_len(max(1, e), real=True)) for e in geom.used_extent)


def _complex(dtype: Any) -> Any:
    return np.complex64 if np.dtype(dtype) == np.float32 else np.complex128


def pruned_rfftn(a: Any, shape: tuple[int, ...]) -> Any:
    """``rfftn(a, s=shape)`` over the trailing ``len(shape)`` axes, one axis at a time, each stage
    over only the lines the zero padding leaves non-zero (ZNNi Figure 2)."""
    f, kw = _fft_module(get_array_module(a))
    nd = len(shape)
    out = f.rfft(a, n=shape[-1], axis=-1, **kw)
    for i in range(nd - 2, -1, -1):
        out = f.fft(out, n=shape[i], axis=a.ndim - nd + i, **kw)
    return out


def pruned_irfftn(a: Any, shape: tuple[int, ...], keep: tuple[int, ...]) -> Any:
    """The first ``keep[i]`` positions per axis of ``irfftn(a, s=shape)``: each inverse stage runs on
    the lines later stages need, and keeps only ``keep[i]`` of its outputs."""
    f, kw = _fft_module(get_array_module(a))
    nd = len(shape)
    lead = a.ndim - nd
    out = a
    for i in range(nd - 1):
        out = f.ifft(out, n=shape[i], axis=lead + i, **kw)
        out = out[(slice(None),) * (lead + i) + (slice(0, keep[i]),)]
    return f.irfft(out, n=shape[-1], axis=-1, **kw)[..., : keep[-1]]


def _dilated(w: Any, geom: ConvGeometry) -> Any:
    """Weights spread ``dilation`` apart: ``(M, Cg, *kernel_extent)``."""
    if all(d == 1 for d in geom.dilation):
        return w
    xp = get_array_module(w)
    out = xp.zeros(w.shape[:2] + tuple(geom.kernel_extent), dtype=w.dtype)
    out[(slice(None), slice(None)) + tuple(slice(None, None, d) for d in geom.dilation)] = w
    return out


def _channel_products(a: Any, b: Any, conj_b: bool, xp: Any) -> Any:
    """Per frequency ``sum_j a[.., j, f] * op(b)[j, .., f]`` for each group: ``a`` ``(G, P, J, F)``,
    ``b`` ``(G, J, Q, F)`` -> ``(G, P, Q, F)`` (one stacked complex GEMM per group)."""
    at = xp.ascontiguousarray(a.transpose(0, 3, 1, 2))  # (G, F, P, J)
    bt = b.transpose(0, 3, 1, 2)  # (G, F, J, Q)
    bt = xp.conj(bt) if conj_b else xp.ascontiguousarray(bt)  # never conjugates the caller's (cached) array
    return xp.matmul(at, bt).transpose(0, 2, 3, 1)  # (G, P, Q, F)


class FFTConvolution(LoweringStrategy):
    """FFT convolution (see module docstring)."""

    name = "fft"

    def __init__(self) -> None:
        self._tls = threading.local()

    def supports(self, geom: ConvGeometry) -> bool:
        """1-, 2- and 3-D convolutions with a non-empty output."""
        return 1 <= geom.num_spatial <= 3 and geom.out_size > 0

    # -- kernel transform, cached while the weights are unchanged ------------------------------
    def kernel_transform(self, w: Any, geom: ConvGeometry) -> Any:
        """``(G, Mg, Cg, *freq)``: the pruned transform of the (dilated) weights."""
        xp = get_array_module(w)
        shape = fft_shape(geom)
        hit = getattr(self._tls, "wcache", None)
        if hit is not None and hit[0] == (geom, shape) and hit[1].shape == w.shape and \
                get_array_module(hit[1]) is xp and bool(xp.array_equal(hit[1], w)):
            return hit[2]
        wt = pruned_rfftn(_dilated(w, geom), shape)
        g = geom.group
        wt = wt.reshape((g, geom.channels_out // g) + wt.shape[1:])
        self._tls.wcache = ((geom, shape), w.copy(), wt)
        return wt

    # -- the three passes -------------------------------------------------------------------
    def forward(self, x: Any, w: Any, b: Any, geom: ConvGeometry) -> Any:
        xp = get_array_module(x)
        n, nd, g = x.shape[0], geom.num_spatial, geom.group
        if n == 0 or x.size == 0:
            y = xp.zeros((n, geom.channels_out) + tuple(geom.out_shape), dtype=x.dtype)
            return y if b is None else y + b.reshape((1, -1) + (1,) * nd)
        shape = fft_shape(geom)
        xt = rfftn(pad_input(x, geom), shape)
        fp = math.prod(xt.shape[2:])
        xg = xt.reshape(n, g, geom.channels_in // g, fp).transpose(1, 0, 2, 3)  # (G, N, Cg, F)
        wt = self.kernel_transform(w, geom).reshape(g, geom.channels_out // g, -1, fp).transpose(0, 2, 1, 3)
        yt = _channel_products(xg, wt, True, xp)  # (G, N, Mg, F)
        yt = yt.transpose(1, 0, 2, 3).reshape((n, geom.channels_out) + xt.shape[2:])
        keep = tuple((o - 1) * s + 1 for o, s in zip(geom.out_shape, geom.stride))
        full = pruned_irfftn(yt, shape, keep)
        y = xp.ascontiguousarray(full[(slice(None), slice(None)) + tuple(slice(None, None, s) for s in geom.stride)],
                                 dtype=x.dtype)
        if b is not None:
            y += b.reshape((1, -1) + (1,) * nd)
        return y

    def _dy_transform(self, dy: Any, geom: ConvGeometry, shape: tuple[int, ...]) -> Any:
        """``rfftn`` of ``dy`` spread ``stride`` apart on the stride-1 output grid."""
        xp = get_array_module(dy)
        if any(s > 1 for s in geom.stride):
            full = tuple((o - 1) * s + 1 for o, s in zip(geom.out_shape, geom.stride))
            up = xp.zeros(dy.shape[:2] + full, dtype=dy.dtype)
            up[(slice(None), slice(None)) + tuple(slice(None, None, s) for s in geom.stride)] = dy
            dy = up
        return rfftn(dy, shape)

    def backward_data(self, dy: Any, w: Any, geom: ConvGeometry, dyt: Any = None) -> Any:
        xp = get_array_module(dy)
        n, g = dy.shape[0], geom.group
        dx = xp.zeros((n, geom.channels_in) + tuple(geom.in_shape), dtype=dy.dtype)
        if n == 0 or dy.size == 0:
            return dx
        shape = fft_shape(geom)
        if dyt is None:
            dyt = self._dy_transform(dy, geom, shape)
        fp = math.prod(dyt.shape[2:])
        dyg = dyt.reshape(n, g, geom.channels_out // g, fp).transpose(1, 0, 2, 3)  # (G, N, Mg, F)
        wt = self.kernel_transform(w, geom).reshape(g, geom.channels_out // g, -1, fp)  # (G, Mg, Cg, F)
        dxt = _channel_products(dyg, wt, False, xp)  # (G, N, Cg, F)
        dxt = dxt.transpose(1, 0, 2, 3).reshape((n, geom.channels_in) + dyt.shape[2:])
        dxp = pruned_irfftn(dxt, shape, tuple(geom.used_extent))
        dst, src = geom.interior()
        dx[(slice(None), slice(None)) + src] = dxp[(slice(None), slice(None)) + dst]
        return dx

    def backward_weights(self, dy: Any, x: Any, geom: ConvGeometry, dyt: Any = None) -> tuple[Any, Any]:
        xp = get_array_module(dy)
        n, nd, g = dy.shape[0], geom.num_spatial, geom.group
        db = dy.sum(axis=(0,) + tuple(range(2, 2 + nd))) if geom.bias_term else None
        if n == 0 or dy.size == 0:
            return xp.zeros(geom.weight_shape, dtype=dy.dtype), db
        shape = fft_shape(geom)
        xt = rfftn(pad_input(x, geom), shape)
        if dyt is None:
            dyt = self._dy_transform(dy, geom, shape)
        fp = math.prod(xt.shape[2:])
        cg, mg = geom.channels_in // g, geom.channels_out // g
        dyg = dyt.reshape(n, g, mg, fp).transpose(1, 2, 0, 3)  # (G, Mg, N, F)
        xg = xt.reshape(n, g, cg, fp).transpose(1, 0, 2, 3)  # (G, N, Cg, F)
        dyg = xp.conj(dyg)
        dwt = _channel_products(dyg, xg, False, xp)  # (G, Mg, Cg, F)
        dwt = dwt.reshape((geom.channels_out, cg) + xt.shape[2:])
        dwd = pruned_irfftn(dwt, shape, tuple(geom.kernel_extent))
        dw = xp.ascontiguousarray(dwd[(slice(None), slice(None)) + tuple(slice(None, None, d) for d in geom.dilation)],
                                  dtype=dy.dtype)
        return dw, db

    def backward_into(self, dy: Any, x: Any, w: Any, geom: ConvGeometry, dw: Any = None, db: Any = None,
                      dx: Any = None) -> None:
        """Both gradients of a chunk from one transform of ``dy``: ``dw += ...``, ``db += ...``,
        ``dx[...] = ...`` (each None to skip)."""
        n, nd = dy.shape[0], geom.num_spatial
        if db is not None:
            db += dy.sum(axis=(0,) + tuple(range(2, 2 + nd)))
        if dw is None and dx is None:
            return
        dyt = None
        if n and dy.size:
            dyt = self._dy_transform(dy, geom, fft_shape(geom))
        if dw is not None:
            gw, _ = self.backward_weights(dy, x, dataclasses.replace(geom, bias_term=False), dyt=dyt)
            dw += gw.reshape(dw.shape)
        if dx is not None:
            dx[...] = self.backward_data(dy, w, geom, dyt=dyt)

    # -- what the cost model prices (ZNNi Tables I and II) -----------------------------------------
    def pass_ops(self, geom: ConvGeometry, batch: int, pass_: str) -> list[tuple]:
        """Transform stages as ``("fft", flops, points per axis)`` (``("ifft", flops)`` for inverse ones), the
        per-frequency channel sums as ``("cgemm", m, n, k, frequencies * groups)``, and the padding/spreading
        sweeps."""
        shape = fft_shape(geom)
        g, c, m = geom.group, geom.channels_in, geom.channels_out
        cg, mg = c // g, m // g
        freq = math.prod(shape[:-1]) * (shape[-1] // 2 + 1)
        full = _fft_flops(shape, shape)  # an input-sized transform (nothing to prune)
        kern = _fft_flops(shape, geom.kernel_extent)  # pruned kernel transform
        out_keep = tuple((o - 1) * s + 1 for o, s in zip(geom.out_shape, geom.stride))
        inv_out = _fft_flops(shape, out_keep)
        inv_in = _fft_flops(shape, geom.used_extent)
        inv_kern = _fft_flops(shape, geom.kernel_extent)
        padded = batch * c * math.prod(geom.used_extent)
        spread = batch * m * math.prod(out_keep) if any(s > 1 for s in geom.stride) else 0
        cplx = batch * (c + m) * freq  # transposes of the transforms around the channel GEMMs
        pts = max(shape)  # the transforms' rate depends on their size
        if pass_ == "fwd":
            return [("zero", padded), ("copy", batch * c * geom.in_size), ("fft", batch * c * full, pts),
                    ("fft", m * cg * kern, pts), ("copy", 2 * cplx), ("cgemm", batch, mg, cg, freq * g),
                    ("ifft", batch * m * inv_out), ("copy", batch * m * geom.out_size)]
        if pass_ == "bwd_data":
            return [("zero", spread), ("fft", batch * m * full, pts), ("copy", 2 * cplx),
                    ("cgemm", batch, cg, mg, freq * g), ("ifft", batch * c * inv_in),
                    ("zero", batch * c * geom.in_size), ("copy", batch * c * geom.in_size)]
        if pass_ == "bwd_weights":
            return [("zero", padded + spread), ("copy", batch * c * geom.in_size), ("fft", batch * c * full, pts),
                    ("fft", batch * m * full, pts), ("copy", 2 * cplx), ("cgemm", mg, cg, batch, freq * g),
                    ("ifft", m * cg * inv_kern), ("sum", batch * m * geom.out_size)]
        raise ValueError(f"unknown pass {pass_!r}")

    def workspace_bytes(self, geom: ConvGeometry, batch: int, itemsize: int = 4) -> int:
        """ZNNi Table II: the input, kernel and output transforms of a chunk (complex, each with its
        transposed copy for the channel GEMMs) plus the padded input."""
        shape = fft_shape(geom)
        freq = math.prod(shape[:-1]) * (shape[-1] // 2 + 1)
        c, m, cg = geom.channels_in, geom.channels_out, geom.channels_in // geom.group
        transforms = freq * (batch * c + m * cg + batch * m)
        return int(itemsize * (2 * 2 * transforms + batch * c * math.prod(geom.used_extent)))


def _fft_flops(shape: tuple[int, ...], nonzero: tuple[int, ...]) -> float:
    """Flops of a pruned real N-d transform of ``shape`` points whose input (or kept output) spans
    ``nonzero`` points per axis: ``2.5 n log2 n`` per complex line of ``n`` points, half for the
    real stage; each stage only over the lines earlier stages made non-zero."""
    nd = len(shape)
    total = 0.0
    lines = math.prod(nonzero[:-1])
    n = shape[-1]
    total += lines * 1.25 * n * math.log2(max(n, 2))
    width = n // 2 + 1
    for i in range(nd - 2, -1, -1):
        lines = math.prod(nonzero[:i]) * width * math.prod(shape[i + 1:-1])
        total += lines * 2.5 * shape[i] * math.log2(max(shape[i], 2))
    return total


register_strategy("fft", FFTConvolution)
