"""numba kernels of fused elementwise passes (ReLU, Dropout), parallel over chunks of the flat array.

Each replaces a numpy expression of :mod:`cct.layers.activation` (which owns the layers; these
are not wired in yet) with one pass over memory on all kernel threads, with the same result bits:

* :func:`relu_forward`: ``np.maximum(x, 0)`` (slope 0; NaN propagates, ``-0.0`` stays ``-0.0``)
  or ``np.where(x > 0, x, x * slope)``.
* :func:`relu_backward`: ``np.where(x > 0, dy, 0)`` or ``np.where(x > 0, dy, dy * slope)``.
* :func:`multiply`: ``a * b`` (Dropout's forward ``x * mask`` and backward ``dy * mask``).

Arrays must be C-contiguous numpy arrays of one float dtype; outputs may alias inputs (in place).
"""
from __future__ import annotations

import numba as nb
import numpy as np

_OPTS = dict(nogil=True, cache=True, error_model="numpy",
             parallel=dict(prange=True, comprehension=False, reduction=False, inplace_binop=False, setitem=False,
                           numpy=False, stencil=False, fusion=False))
_CHUNK = 1 << 14  # elements per task


@nb.njit(**_OPTS)
def _relu_fwd(x, out, slope, zero):  # pragma: no cover (compiled)
    n = x.size
    for t in nb.prange((n + _CHUNK - 1) // _CHUNK):
        lo = t * _CHUNK
        xs, os_ = x[lo:min(n, lo + _CHUNK)], out[lo:min(n, lo + _CHUNK)]
        for i in range(xs.size):
            v = xs[i]
            os_[i] = v if v > zero else v * slope


@nb.njit(**_OPTS)
def _relu_fwd0(x, out, zero):  # pragma: no cover (compiled)
    # np.maximum(v, 0): v when v >= 0 or v is NaN (so -0.0 and NaN pass through), else 0.
    n = x.size
    for t in nb.prange((n + _CHUNK - 1) // _CHUNK):
        lo = t * _CHUNK
        xs, os_ = x[lo:min(n, lo + _CHUNK)], out[lo:min(n, lo + _CHUNK)]
        for i in range(xs.size):
            v = xs[i]
            os_[i] = v if (v >= zero or v != v) else zero


@nb.njit(**_OPTS)
def _relu_bwd(x, dy, dx, slope, zero, has_slope):  # pragma: no cover (compiled)
    n = x.size
    for t in nb.prange((n + _CHUNK - 1) // _CHUNK):
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
def _mul(a, b, out):  # pragma: no cover (compiled)
    n = a.size
    for t in nb.prange((n + _CHUNK - 1) // _CHUNK):
        lo = t * _CHUNK
        hi = min(n, lo + _CHUNK)
        as_, bs, os_ = a[lo:hi], b[lo:hi], out[lo:hi]
        for i in range(as_.size):
            os_[i] = as_[i] * bs[i]


def _flat(a: np.ndarray) -> np.ndarray:
    if not a.flags.c_contiguous:
        raise ValueError("elementwise kernels need C-contiguous arrays")
    return a.reshape(-1)


def relu_forward(x: np.ndarray, out: np.ndarray, negative_slope: float = 0.0) -> np.ndarray:
    """``out[...] = relu(x)`` exactly as ``np.maximum(x, 0)`` / ``np.where(x > 0, x, x * slope)``."""
    t = x.dtype.type
    if negative_slope == 0:
        _relu_fwd0(_flat(x), _flat(out), t(0))
    else:
        _relu_fwd(_flat(x), _flat(out), t(negative_slope), t(0))
    return out


def relu_backward(x: np.ndarray, dy: np.ndarray, dx: np.ndarray, negative_slope: float = 0.0) -> np.ndarray:
    """``dx[...] = where(x > 0, dy, 0 or dy * slope)``; ``x`` may be the layer's output when slope >= 0."""
    t = x.dtype.type
    _relu_bwd(_flat(x), _flat(dy), _flat(dx), t(negative_slope), t(0), negative_slope != 0)
    return dx


def multiply(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[...] = a * b`` (same shape, C-contiguous) on the kernel threads."""
    _mul(_flat(a), _flat(b), _flat(out))
    return out
