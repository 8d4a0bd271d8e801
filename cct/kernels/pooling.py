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
_OPTS = dict(nogil=True, cache=True, error_model="numpy",
             parallel=dict(prange=True, comprehension=False, reduction=False, inplace_binop=False, setitem=False,
                           numpy=False, stencil=False, fusion=False))


@nb.njit(**_OPTS)
def _max_fwd(x, out, arg, kh, kw, sh, sw, ph, pw, init):  # pragma: no cover (compiled)
    n, c, h, w = x.shape
    oh_n, ow_n = out.shape[2], out.shape[3]
    for nc in nb.prange(n * c):
        b = nc // c
        ch = nc - b * c
        src = x[b, ch]
        dst = out[b, ch]
        idx = arg[b, ch]
        for oh in range(oh_n):
            hs = oh * sh - ph
            i0 = max(0, -hs)
            i1 = min(kh, h - hs)
            drow = dst[oh]
            irow = idx[oh]
            for ow in range(ow_n):
                ws = ow * sw - pw
                j0 = max(0, -ws)
                j1 = min(kw, w - ws)
                best = init
                k = np.int32(-1)
                for i in range(i0, i1):
                    srow = src[nb.uint64(hs + i)]
                    for j in range(j0, j1):
                        v = srow[nb.uint64(ws + j)]
                        gt = v > best  # branch-free selects: random data would mispredict
                        best = v if gt else best
                        k = np.int32(i * kw + j) if gt else k
                drow[ow] = best
                irow[ow] = k


def _make_max_fwd_fixed(KH: int, KW: int):  # noqa: N803 (compile-time constants)
    """``_max_fwd`` with the window size a compile-time constant (unrolled; ~1.6x faster): the
    windows fully inside the input take a branch-free path, the border windows the clipped one."""

    def kernel(x, out, arg, sh, sw, ph, pw, init):  # pragma: no cover (compiled)
        n, c, h, w = x.shape
        oh_n, ow_n = out.shape[2], out.shape[3]
        ow_lo = min((pw + sw - 1) // sw, ow_n)  # first window with ws >= 0
        ow_hi = max(min((w - KW + pw) // sw + 1, ow_n), ow_lo)  # past the last with ws + KW <= w
        for nc in nb.prange(n * c):
            b = nc // c
            ch = nc - b * c
            src = x[b, ch]
            dst = out[b, ch]
            idx = arg[b, ch]
            for oh in range(oh_n):
                hs = oh * sh - ph
                i0 = max(0, -hs)
                i1 = min(KH, h - hs)
                full_rows = i0 == 0 and i1 == KH
                drow = dst[oh]
                irow = idx[oh]
                for ow in range(ow_n):
                    ws = ow * sw - pw
                    best = init
                    k = np.int32(-1)
                    if full_rows and ow_lo <= ow < ow_hi:
                        uws = nb.uint64(ws)
                        for i in range(KH):
                            srow = src[nb.uint64(hs + i)]
                            for j in range(KW):
                                v = srow[uws + nb.uint64(j)]
                                gt = v > best
                                best = v if gt else best
                                k = np.int32(i * KW + j) if gt else k
                    else:
                        j0 = max(0, -ws)
                        j1 = min(KW, w - ws)
                        for i in range(i0, i1):
                            srow = src[nb.uint64(hs + i)]
                            for j in range(j0, j1):
                                v = srow[nb.uint64(ws + j)]
                                gt = v > best
                                best = v if gt else best
                                k = np.int32(i * KW + j) if gt else k
                    drow[ow] = best
                    irow[ow] = k

    return nb.njit(**_OPTS)(kernel)


_FIXED_SIZES = ((2, 2), (3, 3))  # the common pooling windows (LeNet; cifar10, CaffeNet, ...)
_fixed: dict[tuple[int, int], object] = {}


def _max_fwd_for(kh: int, kw: int):
    """The unrolled forward for a common window size (built on first use), else None."""
    if (kh, kw) not in _FIXED_SIZES:
        return None
    fn = _fixed.get((kh, kw))
    if fn is None:
        fn = _fixed.setdefault((kh, kw), _make_max_fwd_fixed(kh, kw))
    return fn


@nb.njit(**_OPTS)
def _max_bwd(dy, arg, dx, kw, sh, sw, ph, pw, zero):  # pragma: no cover (compiled)
    n, c, h, w = dx.shape
    oh_n, ow_n = dy.shape[2], dy.shape[3]
    for nc in nb.prange(n * c):
        b = nc // c
        ch = nc - b * c
        dst = dx[b, ch]
        g = dy[b, ch]
        idx = arg[b, ch]
        for r in range(h):
            drow = dst[r]
            for q in range(w):
                drow[q] = zero
        for oh in range(oh_n - 1, -1, -1):
            hs = oh * sh - ph
            grow = g[nb.uint64(oh)]
            irow = idx[nb.uint64(oh)]
            for ow in range(ow_n - 1, -1, -1):
                k = irow[nb.uint64(ow)]
                if k >= 0:
                    i = k // kw
                    dst[nb.uint64(hs + i), nb.uint64(ow * sw - pw + (k - i * kw))] += grow[nb.uint64(ow)]


@nb.njit(**_OPTS)
def _ave_fwd(x, out, pool_size, kh, kw, sh, sw, ph, pw, zero):  # pragma: no cover (compiled)
    n, c, h, w = x.shape
    oh_n, ow_n = out.shape[2], out.shape[3]
    for nc in nb.prange(n * c):
        b = nc // c
        ch = nc - b * c
        src = x[b, ch]
        dst = out[b, ch]
        for oh in range(oh_n):
            hs = oh * sh - ph
            i0 = max(0, -hs)
            i1 = min(kh, h - hs)
            drow = dst[oh]
            prow = pool_size[oh]
            for ow in range(ow_n):
                ws = ow * sw - pw
                j0 = max(0, -ws)
                j1 = min(kw, w - ws)
                s = zero
                for i in range(i0, i1):
                    srow = src[nb.uint64(hs + i)]
                    for j in range(j0, j1):
                        s += srow[nb.uint64(ws + j)]
                drow[ow] = s / prow[ow]


@nb.njit(**_OPTS)
def _ave_bwd(dy, pool_size, dx, kh, kw, sh, sw, ph, pw, zero):  # pragma: no cover (compiled)
    n, c, h, w = dx.shape
    oh_n, ow_n = dy.shape[2], dy.shape[3]
    for nc in nb.prange(n * c):
        b = nc // c
        ch = nc - b * c
        dst = dx[b, ch]
        gsrc = dy[b, ch]
        for r in range(h):
            drow = dst[r]
            for q in range(w):
                drow[q] = zero
        for oh in range(oh_n - 1, -1, -1):
            hs = oh * sh - ph
            i0 = max(0, -hs)
            i1 = min(kh, h - hs)
            grow = gsrc[nb.uint64(oh)]
            prow = pool_size[nb.uint64(oh)]
            for ow in range(ow_n - 1, -1, -1):
                ws = ow * sw - pw
                j0 = max(0, -ws)
                j1 = min(kw, w - ws)
                if i0 >= i1 or j0 >= j1:
                    continue
                g = grow[nb.uint64(ow)] / prow[nb.uint64(ow)]
                for i in range(i0, i1):
                    drow = dst[nb.uint64(hs + i)]
                    for j in range(j0, j1):
                        drow[nb.uint64(ws + j)] += g


def _ints(kernel: Sequence[int], pad: Sequence[int], stride: Sequence[int]) -> tuple[int, ...]:
    return (int(kernel[0]), int(kernel[1]), int(stride[0]), int(stride[1]), int(pad[0]), int(pad[1]))


def max_forward(x: np.ndarray, out: np.ndarray, arg: np.ndarray, kernel: Sequence[int], pad: Sequence[int],
                stride: Sequence[int]) -> None:
    """MAX pooling: ``out`` (N, C, OH, OW) gets the maxima, ``arg`` (int32) the window offsets (-1: none)."""
    kh, kw, sh, sw, ph, pw = _ints(kernel, pad, stride)
    fixed = _max_fwd_for(kh, kw)
    if fixed is not None:
        fixed(x, out, arg, sh, sw, ph, pw, x.dtype.type(-_FLT_MAX))
    else:
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
