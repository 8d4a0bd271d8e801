"""numba kernels of fused elementwise/copy passes (ReLU; the type-1 lowering's transposes), parallel.

Each replaces a numpy expression of :mod:`cct.layers.activation` (the ReLU layer uses them) or
of :mod:`cct.lowering.type1` (``swap01``: not used by the lowering, which writes GEMM results
straight into the top per chunk) with one pass over memory on the calling thread's kernel threads, with the same
result bits:

* :func:`relu_forward`: ``np.maximum(x, 0)`` (slope 0; NaN propagates, ``-0.0`` gives ``+0.0``)
  or ``np.where(x > 0, x, x * slope)``.
* :func:`relu_backward`: ``np.where(x > 0, dy, 0)`` or ``np.where(x > 0, dy, dy * slope)``; in place
  (``dx is dy``) through a two-array loop, which LLVM vectorizes (the three-array one runs scalar
  when two of its arrays alias).
* :func:`swap01`: ``out[...] = src.swapaxes(0, 1) (+ bias[:, None, None])`` for 3-D arrays
  ``(A, B, P) -> (B, A, P)``: type 1's lifting ``(M, N*P) -> (N, M, P)`` plus bias, and its
  ``_group_major`` ``(N, M, P) -> (M, N*P)``.

(Dropout's ``x * mask`` is one numpy multiply already at memory speed: no kernel.)

Arrays must be C-contiguous numpy arrays of one float dtype; outputs may alias inputs (in place).
"""
from __future__ import annotations

import numba as nb
import numpy as np

from . import launch

_OPTS = dict(nogil=True, cache=True, error_model="numpy")
_CHUNK = 1 << 14  # elements per task


@nb.njit(**_OPTS)
def _relu_fwd(piece, pieces, x, out, slope, zero, has_slope):  # pragma: no cover (compiled)
    n = x.size
    tasks = (n + _CHUNK - 1) // _CHUNK
    for t in range(tasks * piece // pieces, tasks * (piece + 1) // pieces):
        lo = t * _CHUNK
        hi = min(n, lo + _CHUNK)
        xs, os_ = x[lo:hi], out[lo:hi]
        if has_slope:
            for i in range(xs.size):
                v = xs[i]
                os_[i] = v if v > zero else v * slope
        else:
            # np.maximum(v, 0): v when v > 0 or v is NaN (NaN propagates), else +0.0 (also for -0.0).
            for i in range(xs.size):
                v = xs[i]
                os_[i] = v if (v > zero or v != v) else zero


@nb.njit(**_OPTS)
def _relu_bwd(piece, pieces, x, dy, dx, slope, zero, has_slope):  # pragma: no cover (compiled)
    n = x.size
    tasks = (n + _CHUNK - 1) // _CHUNK
    for t in range(tasks * piece // pieces, tasks * (piece + 1) // pieces):
        lo = t * _CHUNK
        hi = min(n, lo + _CHUNK)
        xs, gs, ds = x[lo:hi], dy[lo:hi], dx[lo:hi]
        if has_slope:
            for i in range(xs.size):
                g = gs[i]
                ds[i] = g if xs[i] > zero else g * slope
        else:
            for i in range(xs.size):
                ds[i] = gs[i] if xs[i] > zero else zero


@nb.njit(**_OPTS)
def _relu_bwd_inplace(piece, pieces, x, g, slope, zero, has_slope):  # pragma: no cover (compiled)
    # dx is dy (an in-place ReLU): two arrays, so LLVM's overlap check passes and the loop vectorizes
    # (with dx aliasing dy the three-array loop above runs scalar, ~6x slower)
    n = x.size
    tasks = (n + _CHUNK - 1) // _CHUNK
    for t in range(tasks * piece // pieces, tasks * (piece + 1) // pieces):
        lo = t * _CHUNK
        hi = min(n, lo + _CHUNK)
        xs, gs = x[lo:hi], g[lo:hi]
        if has_slope:
            for i in range(xs.size):
                v = gs[i]
                gs[i] = v if xs[i] > zero else v * slope
        else:
            for i in range(xs.size):
                gs[i] = gs[i] if xs[i] > zero else zero


@nb.njit(**_OPTS)
def _swap01(piece, pieces, src, out, bias, has_bias):  # pragma: no cover (compiled)
    a_n, b_n, p = src.shape
    for ab in range(a_n * b_n * piece // pieces, a_n * b_n * (piece + 1) // pieces):
        i = ab // b_n
        j = ab - i * b_n
        s = src[i, j]
        d = out[j, i]
        if has_bias:
            bi = bias[i]
            for q in range(p):
                d[q] = s[q] + bi
        else:
            for q in range(p):
                d[q] = s[q]


def _flat(a: np.ndarray) -> np.ndarray:
    if not a.flags.c_contiguous:
        raise ValueError("elementwise kernels need C-contiguous arrays")
    return a.reshape(-1)


def relu_forward(x: np.ndarray, out: np.ndarray, negative_slope: float = 0.0) -> np.ndarray:
    """``out[...] = relu(x)`` exactly as ``np.maximum(x, 0)`` / ``np.where(x > 0, x, x * slope)``."""
    t = x.dtype.type
    launch(_relu_fwd, _flat(x), _flat(out), t(negative_slope), t(0), negative_slope != 0, work=x.size)
    return out


def relu_backward(x: np.ndarray, dy: np.ndarray, dx: np.ndarray, negative_slope: float = 0.0) -> np.ndarray:
    """``dx[...] = where(x > 0, dy, 0 or dy * slope)``; ``x`` may be the layer's output when slope >= 0."""
    t = x.dtype.type
    if dx is dy or (dx.ctypes.data == dy.ctypes.data and dx.shape == dy.shape):
        launch(_relu_bwd_inplace, _flat(x), _flat(dx), t(negative_slope), t(0), negative_slope != 0, work=x.size)
    else:
        launch(_relu_bwd, _flat(x), _flat(dy), _flat(dx), t(negative_slope), t(0), negative_slope != 0, work=x.size)
    return dx


def swap01(src: np.ndarray, out: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """``out[...] = src.swapaxes(0, 1)`` (+ ``bias[i]`` on every ``src[i]``) for ``src`` (A, B, P) and
    ``out`` (B, A, P), both C-contiguous: the same bits as ``src.swapaxes(0, 1) + bias[:, None, None]``."""
    if not (src.flags.c_contiguous and out.flags.c_contiguous):
        raise ValueError("swap01 needs C-contiguous arrays")
    if src.ndim != 3 or out.shape != (src.shape[1], src.shape[0], src.shape[2]):
        raise ValueError(f"swap01: src {src.shape} and out {out.shape} are not (A, B, P) and (B, A, P)")
    b = bias if bias is not None else src[:, 0, 0]
    launch(_swap01, src, out, np.ascontiguousarray(b, dtype=src.dtype), bias is not None, work=src.size)
    return out
