"""numba kernels of MAX/AVE pooling on ``(N, C, H, W)`` arrays, parallel over ``N * C`` planes.

The layer (:mod:`cct.layers.pooling`) computes the output size (Caffe's ceil and drop rules)
and the AVE divisors; these kernels only walk the windows. Results equal the layer's numpy
path bitwise:

* MAX forward starts from ``-FLT_MAX`` (index -1) and keeps the first strict maximum in
  row-major window order; the index is the window offset ``i * kw + j`` (the layer's ``arg``).
  Positions outside the input are skipped (the numpy path pads with ``-inf``, never ``>``).
* AVE forward sums the in-input window entries in row-major order (the padding adds zeros
  in the numpy path) and divides by the layer's ``pool_size``.
* Backward passes scatter into each input position in increasing window offset, the order in
  which the numpy path accumulates: output windows visited in reverse row-major order.
"""
from __future__ import annotations

from collections.abc import Sequence

import numba as nb
import numpy as np

_FLT_MAX = float(np.finfo(np.float32).max)
_OPTS = dict(nogil=True, cache=True, parallel=True, error_model="numpy")


@nb.njit(**_OPTS)
def _max_fwd(x, out, arg, kh, kw, sh, sw, ph, pw, init):  # pragma: no cover (compiled)
    n, c, h, w = x.shape
    oh_n, ow_n = out.shape[2], out.shape[3]
    for nc in nb.prange(n * c):
        b = nc // c
        ch = nc - b * c
        for oh in range(oh_n):
            hs = oh * sh - ph
            i0 = max(0, -hs)
            i1 = min(kh, h - hs)
            for ow in range(ow_n):
                ws = ow * sw - pw
                j0 = max(0, -ws)
                j1 = min(kw, w - ws)
                best = init
                k = -1
                for i in range(i0, i1):
                    for j in range(j0, j1):
                        v = x[b, ch, hs + i, ws + j]
                        if v > best:
                            best = v
                            k = i * kw + j
                out[b, ch, oh, ow] = best
                arg[b, ch, oh, ow] = k


@nb.njit(**_OPTS)
def _max_bwd(dy, arg, dx, kw, sh, sw, ph, pw, zero):  # pragma: no cover (compiled)
    n, c, h, w = dx.shape
    oh_n, ow_n = dy.shape[2], dy.shape[3]
    for nc in nb.prange(n * c):
        b = nc // c
        ch = nc - b * c
        for r in range(h):
            for q in range(w):
                dx[b, ch, r, q] = zero
        for oh in range(oh_n - 1, -1, -1):
            hs = oh * sh - ph
            for ow in range(ow_n - 1, -1, -1):
                k = arg[b, ch, oh, ow]
                if k >= 0:
                    i = k // kw
                    dx[b, ch, hs + i, ow * sw - pw + (k - i * kw)] += dy[b, ch, oh, ow]


@nb.njit(**_OPTS)
def _ave_fwd(x, out, pool_size, kh, kw, sh, sw, ph, pw, zero):  # pragma: no cover (compiled)
    n, c, h, w = x.shape
    oh_n, ow_n = out.shape[2], out.shape[3]
    for nc in nb.prange(n * c):
        b = nc // c
        ch = nc - b * c
        for oh in range(oh_n):
            hs = oh * sh - ph
            i0 = max(0, -hs)
            i1 = min(kh, h - hs)
            for ow in range(ow_n):
                ws = ow * sw - pw
                j0 = max(0, -ws)
                j1 = min(kw, w - ws)
                s = zero
                for i in range(i0, i1):
                    for j in range(j0, j1):
                        s += x[b, ch, hs + i, ws + j]
                out[b, ch, oh, ow] = s / pool_size[oh, ow]


@nb.njit(**_OPTS)
def _ave_bwd(dy, pool_size, dx, kh, kw, sh, sw, ph, pw, zero):  # pragma: no cover (compiled)
    n, c, h, w = dx.shape
    oh_n, ow_n = dy.shape[2], dy.shape[3]
    for nc in nb.prange(n * c):
        b = nc // c
        ch = nc - b * c
        for r in range(h):
            for q in range(w):
                dx[b, ch, r, q] = zero
        for oh in range(oh_n - 1, -1, -1):
            hs = oh * sh - ph
            i0 = max(0, -hs)
            i1 = min(kh, h - hs)
            for ow in range(ow_n - 1, -1, -1):
                ws = ow * sw - pw
                j0 = max(0, -ws)
                j1 = min(kw, w - ws)
                if i0 >= i1 or j0 >= j1:
                    continue
                g = dy[b, ch, oh, ow] / pool_size[oh, ow]
                for i in range(i0, i1):
                    for j in range(j0, j1):
                        dx[b, ch, hs + i, ws + j] += g


def _ints(kernel: Sequence[int], pad: Sequence[int], stride: Sequence[int]) -> tuple[int, ...]:
    return (int(kernel[0]), int(kernel[1]), int(stride[0]), int(stride[1]), int(pad[0]), int(pad[1]))


def max_forward(x: np.ndarray, out: np.ndarray, arg: np.ndarray, kernel: Sequence[int], pad: Sequence[int],
                stride: Sequence[int]) -> None:
    """MAX pooling: ``out`` (N, C, OH, OW) gets the maxima, ``arg`` (int32) the window offsets (-1: none)."""
    kh, kw, sh, sw, ph, pw = _ints(kernel, pad, stride)
    _max_fwd(x, out, arg, kh, kw, sh, sw, ph, pw, x.dtype.type(-_FLT_MAX))


def max_backward(dy: np.ndarray, arg: np.ndarray, dx: np.ndarray, kernel: Sequence[int], pad: Sequence[int],
                 stride: Sequence[int]) -> None:
    """MAX pooling backward: ``dx`` (overwritten) gets ``dy`` scatter-added at the argmax positions."""
    kh, kw, sh, sw, ph, pw = _ints(kernel, pad, stride)
    _max_bwd(dy, arg, dx, kw, sh, sw, ph, pw, dx.dtype.type(0))


def ave_forward(x: np.ndarray, out: np.ndarray, pool_size: np.ndarray, kernel: Sequence[int], pad: Sequence[int],
                stride: Sequence[int]) -> None:
    """AVE pooling: window sums of the input over ``pool_size`` (OH, OW) (the layer's clipped areas)."""
    kh, kw, sh, sw, ph, pw = _ints(kernel, pad, stride)
    _ave_fwd(x, out, pool_size, kh, kw, sh, sw, ph, pw, x.dtype.type(0))


def ave_backward(dy: np.ndarray, pool_size: np.ndarray, dx: np.ndarray, kernel: Sequence[int], pad: Sequence[int],
                 stride: Sequence[int]) -> None:
    """AVE pooling backward: ``dx`` (overwritten) = sum over windows of ``dy / pool_size``."""
    kh, kw, sh, sw, ph, pw = _ints(kernel, pad, stride)
    _ave_bwd(dy, pool_size, dx, kh, kw, sh, sw, ph, pw, dx.dtype.type(0))
