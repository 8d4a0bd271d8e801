"""numba kernels of LRN across channels on ``(N, C, H, W)`` arrays, parallel over ``N * C`` planes.

The layer's numpy path (:mod:`cct.layers.lrn`) computes

* forward: ``scale = k + alpha/n * box_c(x*x)``; ``y = x * scale**-beta``;
* backward: ``ratio = dy * x * p / scale`` (``p = scale**-beta``),
  ``dx = dy * p - (2 alpha beta / n) * x * box_c(ratio)``,

all in the array dtype, with ``box_c`` the zero-padded window sum over channels, summed window
entry by window entry. The kernels compute the box sums and the elementwise algebra in that
order and dtype (bitwise equal); the power ``scale**-beta`` is left to numpy's ``power`` ufunc
(:func:`power`), so it is bitwise equal too, and backward reuses the forward's powers.
"""
from __future__ import annotations

from typing import Any

import numba as nb
import numpy as np

from . import get_num_threads, launch

_OPTS = dict(nogil=True, cache=True, error_model="numpy")


@nb.njit(**_OPTS)
def _scale_across(piece, pieces, x, scale, size, coef, kk, zero):  # pragma: no cover (compiled)
    # x, scale: (N, C, H*W), C-contiguous.
    n, c, m = x.shape
    half = (size - 1) // 2
    for nc in range(n * c * piece // pieces, n * c * (piece + 1) // pieces):
        b = nc // c
        ch = nc - b * c
        acc = scale[b, ch]
        for q in range(m):
            acc[q] = zero
        for o in range(size):
            cc = ch - half + o
            if cc < 0 or cc >= c:
                continue
            src = x[b, cc]
            for q in range(m):
                v = src[q]
                acc[q] += v * v
        for q in range(m):
            acc[q] = kk + coef * acc[q]


@nb.njit(**_OPTS)
def _ratio(piece, pieces, x, dy, scale, pw, ratio):  # pragma: no cover (compiled)
    # All (N, C, H*W), C-contiguous: ratio = dy * x * pw / scale (the first step of the backward pass).
    n, c, m = x.shape
    for nc in range(n * c * piece // pieces, n * c * (piece + 1) // pieces):
        b = nc // c
        ch = nc - b * c
        rr, g, xx, pp, ss = ratio[b, ch], dy[b, ch], x[b, ch], pw[b, ch], scale[b, ch]
        for q in range(m):
            rr[q] = g[q] * xx[q] * pp[q] / ss[q]


@nb.njit(**_OPTS)
def _backward_across(piece, pieces, x, dy, pw, ratio, dx, size, coef2, zero):  # pragma: no cover (compiled)
    # All (N, C, H*W), C-contiguous; dx may be dy; ratio from _ratio, for every plane (a plane's sum
    # reads its neighbours').
    n, c, m = x.shape
    half = (size - 1) // 2
    for nc in range(n * c * piece // pieces, n * c * (piece + 1) // pieces):
        b = nc // c
        ch = nc - b * c
        acc = np.empty_like(x[b, ch])
        for q in range(m):
            acc[q] = zero
        for o in range(size):
            cc = ch - half + o
            if cc < 0 or cc >= c:
                continue
            src = ratio[b, cc]
            for q in range(m):
                acc[q] += src[q]
        # dy may be dx (in-place layer): each plane reads only its own dy, before writing it.
        g, xx, pp, d = dy[b, ch], x[b, ch], pw[b, ch], dx[b, ch]
        for q in range(m):
            d[q] = g[q] * pp[q] - coef2 * xx[q] * acc[q]


# Exponents for which ``array ** e`` takes numpy's fast scalar-power path instead of the ufunc.
_FAST_EXPONENTS = (0.0, 0.5, 1.0, -1.0, 2.0)


def _flat(a: np.ndarray) -> np.ndarray:
    """``(N, C, H, W)`` -> ``(N, C, H*W)`` view (the arrays must be C-contiguous; outputs are written through)."""
    if not a.flags.c_contiguous:
        raise ValueError("LRN kernels need C-contiguous arrays")
    return a.reshape(a.shape[0], a.shape[1], -1)


def scale_across(x: np.ndarray, scale: np.ndarray, size: int, alpha: float, k: float) -> np.ndarray:
    """``scale[...] = k + alpha/size * box_c(x*x)`` (the dtype's arithmetic, like the numpy path)."""
    t = x.dtype.type
    launch(_scale_across, _flat(x), _flat(scale), int(size), t(alpha / size), t(k), t(0))
    return scale


_SPLIT_MIN = 1 << 16  # elements; below this one thread does the power


def power(scale: np.ndarray, exponent: float, out: np.ndarray) -> np.ndarray:
    """``scale ** exponent`` computed exactly as the numpy path's expression (into ``out`` where possible).

    numpy's ``power`` ufunc (SIMD) is elementwise and position-independent, so large C-contiguous
    arrays are split into pieces computed on the calling thread's kernel threads (:func:`~cct.kernels.launch`).
    """
    e = float(exponent)
    if e in _FAST_EXPONENTS:
        out[...] = scale ** e
        return out
    te = scale.dtype.type(e)
    if get_num_threads() <= 1 or scale.size < _SPLIT_MIN or not (scale.flags.c_contiguous and out.flags.c_contiguous):
        np.power(scale, te, out=out)
        return out
    launch(_power_piece, scale.reshape(-1), te, out.reshape(-1))
    return out


def _power_piece(piece: int, pieces: int, src: np.ndarray, exponent: Any, dst: np.ndarray) -> None:
    """One share of ``dst[...] = src ** exponent`` (numpy's power ufunc releases the GIL)."""
    a, b = src.size * piece // pieces, src.size * (piece + 1) // pieces
    np.power(src[a:b], exponent, out=dst[a:b])


def backward_across(x: np.ndarray, dy: np.ndarray, scale: np.ndarray, pw: np.ndarray, dx: np.ndarray, size: int,
                    alpha: float, beta: float, work: np.ndarray | None = None) -> np.ndarray:
    """``dx`` (may be ``dy``) = LRN-across-channels gradient; ``pw = scale**-beta`` from the forward pass.

    ``work`` is an optional scratch array of ``x``'s shape and dtype.
    """
    if work is None or work.shape != x.shape or work.dtype != x.dtype:
        work = np.empty_like(x)
    t = x.dtype.type
    launch(_ratio, _flat(x), _flat(dy), _flat(scale), _flat(pw), _flat(work))
    launch(_backward_across, _flat(x), _flat(dy), _flat(pw), _flat(work), _flat(dx), int(size),
           t(2.0 * alpha * beta / size), t(0))
    return dx
