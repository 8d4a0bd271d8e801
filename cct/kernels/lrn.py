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

import numba as nb
import numpy as np

_OPTS = dict(nogil=True, cache=True, parallel=True, error_model="numpy")


@nb.njit(**_OPTS)
def _scale_across(x, scale, size, coef, kk, zero):  # pragma: no cover (compiled)
    n, c, h, w = x.shape
    half = (size - 1) // 2
    for nc in nb.prange(n * c):
        b = nc // c
        ch = nc - b * c
        acc = scale[b, ch]
        for r in range(h):
            for q in range(w):
                acc[r, q] = zero
        for o in range(size):
            cc = ch - half + o
            if cc < 0 or cc >= c:
                continue
            src = x[b, cc]
            for r in range(h):
                for q in range(w):
                    v = src[r, q]
                    acc[r, q] += v * v
        for r in range(h):
            for q in range(w):
                acc[r, q] = kk + coef * acc[r, q]


@nb.njit(**_OPTS)
def _backward_across(x, dy, scale, pw, ratio, dx, size, coef2, zero):  # pragma: no cover (compiled)
    n, c, h, w = x.shape
    half = (size - 1) // 2
    for nc in nb.prange(n * c):
        b = nc // c
        ch = nc - b * c
        for r in range(h):
            for q in range(w):
                ratio[b, ch, r, q] = dy[b, ch, r, q] * x[b, ch, r, q] * pw[b, ch, r, q] / scale[b, ch, r, q]
    for nc in nb.prange(n * c):
        b = nc // c
        ch = nc - b * c
        acc = np.empty_like(x[b, ch])
        for r in range(h):
            for q in range(w):
                acc[r, q] = zero
        for o in range(size):
            cc = ch - half + o
            if cc < 0 or cc >= c:
                continue
            src = ratio[b, cc]
            for r in range(h):
                for q in range(w):
                    acc[r, q] += src[r, q]
        # dy may be dx (in-place layer): each plane reads only its own dy, before writing it.
        for r in range(h):
            for q in range(w):
                dx[b, ch, r, q] = dy[b, ch, r, q] * pw[b, ch, r, q] - coef2 * x[b, ch, r, q] * acc[r, q]


# Exponents for which ``array ** e`` takes numpy's fast scalar-power path instead of the ufunc.
_FAST_EXPONENTS = (0.0, 0.5, 1.0, -1.0, 2.0)


def scale_across(x: np.ndarray, scale: np.ndarray, size: int, alpha: float, k: float) -> np.ndarray:
    """``scale[...] = k + alpha/size * box_c(x*x)`` (the dtype's arithmetic, like the numpy path)."""
    t = x.dtype.type
    _scale_across(x, scale, int(size), t(alpha / size), t(k), t(0))
    return scale


def power(scale: np.ndarray, exponent: float, out: np.ndarray) -> np.ndarray:
    """``scale ** exponent`` computed exactly as the numpy path's expression (into ``out`` where possible)."""
    if float(exponent) in _FAST_EXPONENTS:
        out[...] = scale ** float(exponent)
    else:
        np.power(scale, scale.dtype.type(exponent), out=out)
    return out


def backward_across(x: np.ndarray, dy: np.ndarray, scale: np.ndarray, pw: np.ndarray, dx: np.ndarray, size: int,
                    alpha: float, beta: float, work: np.ndarray | None = None) -> np.ndarray:
    """``dx`` (may be ``dy``) = LRN-across-channels gradient; ``pw = scale**-beta`` from the forward pass.

    ``work`` is an optional scratch array of ``x``'s shape and dtype.
    """
    if work is None or work.shape != x.shape or work.dtype != x.dtype:
        work = np.empty_like(x)
    t = x.dtype.type
    _backward_across(x, dy, scale, pw, work, dx, int(size), t(2.0 * alpha * beta / size), t(0))
    return dx
