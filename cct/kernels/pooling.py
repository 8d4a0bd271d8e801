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

Speed: comparisons are branch-free selects; the common window/stride geometries (``FIXED_GEOMETRIES``)
get forward kernels with those sizes as compile-time constants, whose interior windows LLVM
vectorizes across outputs; MAX backward uses a window-offset table (no division per output).
"""
from __future__ import annotations

from collections.abc import Sequence

import numba as nb
import numpy as np

from . import launch

_FLT_MAX = float(np.finfo(np.float32).max)
_OPTS = dict(nogil=True, cache=True, error_model="numpy")


@nb.njit(**_OPTS)
def _max_fwd(piece, pieces, x, out, arg, kh, kw, sh, sw, ph, pw, init):  # pragma: no cover (compiled)
    n, c, h, w = x.shape
    oh_n, ow_n = out.shape[2], out.shape[3]
    for nc in range(n * c * piece // pieces, n * c * (piece + 1) // pieces):
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


@nb.njit(cache=True)
def _max_window(src, hs, ws, kh, kw, h, w, init):  # pragma: no cover (compiled)
    """(max, window offset) of one window clipped to the input plane; (init, -1) if nothing is > init."""
    best = init
    k = np.int32(-1)
    j0 = max(0, -ws)
    j1 = min(kw, w - ws)
    for i in range(max(0, -hs), min(kh, h - hs)):
        srow = src[nb.uint64(hs + i)]
        for j in range(j0, j1):
            v = srow[nb.uint64(ws + j)]
            gt = v > best
            best = v if gt else best
            k = np.int32(i * kw + j) if gt else k
    return best, k


def _make_max_fwd_fixed(KH: int, KW: int, SH: int, SW: int):  # noqa: N803 (compile-time constants)
    """``_max_fwd`` with window and stride compile-time constants: the windows fully inside the input
    run as straight-line code per output, which LLVM vectorizes across outputs (2-3x faster); the
    border windows take the clipped path."""

    def kernel(piece, pieces, x, out, arg, ph, pw, init):  # pragma: no cover (compiled)
        n, c, h, w = x.shape
        oh_n, ow_n = out.shape[2], out.shape[3]
        ow_lo = min((pw + SW - 1) // SW, ow_n)  # first window with ws >= 0
        ow_hi = max(min((w - KW + pw) // SW + 1, ow_n), ow_lo)  # past the last with ws + KW <= w
        for nc in range(n * c * piece // pieces, n * c * (piece + 1) // pieces):
            b = nc // c
            ch = nc - b * c
            src = x[b, ch]
            dst = out[b, ch]
            idx = arg[b, ch]
            for oh in range(oh_n):
                hs = oh * SH - ph
                drow = dst[oh]
                irow = idx[oh]
                lo, hi = ow_n, ow_n  # the interior run [lo, hi) of this output row
                if hs >= 0 and hs + KH <= h:
                    lo, hi = ow_lo, ow_hi
                    base = nb.uint64(ow_lo * SW - pw)
                    d2 = drow[ow_lo:ow_hi]
                    i2 = irow[ow_lo:ow_hi]
                    for t in range(nb.uint64(ow_hi - ow_lo)):
                        best = init
                        k = np.int32(-1)
                        col = base + t * nb.uint64(SW)
                        for i in range(KH):
                            srow = src[nb.uint64(hs + i)]
                            for j in range(KW):
                                v = srow[col + nb.uint64(j)]
                                gt = v > best
                                best = v if gt else best
                                k = np.int32(i * KW + j) if gt else k
                        d2[t] = best
                        i2[t] = k
                for ow in range(lo):
                    drow[ow], irow[ow] = _max_window(src, hs, ow * SW - pw, KH, KW, h, w, init)
                for ow in range(hi, ow_n):
                    drow[ow], irow[ow] = _max_window(src, hs, ow * SW - pw, KH, KW, h, w, init)

    return nb.njit(**_OPTS)(kernel)


@nb.njit(cache=True)
def _ave_window(src, hs, ws, kh, kw, h, w, zero):  # pragma: no cover (compiled)
    """Sum of one window clipped to the input plane, row-major."""
    s = zero
    j0 = max(0, -ws)
    j1 = min(kw, w - ws)
    for i in range(max(0, -hs), min(kh, h - hs)):
        srow = src[nb.uint64(hs + i)]
        for j in range(j0, j1):
            s += srow[nb.uint64(ws + j)]
    return s


def _make_ave_fwd_fixed(KH: int, KW: int, SH: int, SW: int):  # noqa: N803 (compile-time constants)
    """``_ave_fwd`` with window and stride compile-time constants (see :func:`_make_max_fwd_fixed`)."""

    def kernel(piece, pieces, x, out, pool_size, ph, pw, zero):  # pragma: no cover (compiled)
        n, c, h, w = x.shape
        oh_n, ow_n = out.shape[2], out.shape[3]
        ow_lo = min((pw + SW - 1) // SW, ow_n)
        ow_hi = max(min((w - KW + pw) // SW + 1, ow_n), ow_lo)
        for nc in range(n * c * piece // pieces, n * c * (piece + 1) // pieces):
            b = nc // c
            ch = nc - b * c
            src = x[b, ch]
            dst = out[b, ch]
            for oh in range(oh_n):
                hs = oh * SH - ph
                drow = dst[oh]
                prow = pool_size[oh]
                lo, hi = ow_n, ow_n
                if hs >= 0 and hs + KH <= h:
                    lo, hi = ow_lo, ow_hi
                    base = nb.uint64(ow_lo * SW - pw)
                    d2 = drow[ow_lo:ow_hi]
                    p2 = prow[ow_lo:ow_hi]
                    for t in range(nb.uint64(ow_hi - ow_lo)):
                        acc = zero
                        col = base + t * nb.uint64(SW)
                        for i in range(KH):
                            srow = src[nb.uint64(hs + i)]
                            for j in range(KW):
                                acc += srow[col + nb.uint64(j)]
                        d2[t] = acc / p2[t]
                for ow in range(lo):
                    drow[ow] = _ave_window(src, hs, ow * SW - pw, KH, KW, h, w, zero) / prow[ow]
                for ow in range(hi, ow_n):
                    drow[ow] = _ave_window(src, hs, ow * SW - pw, KH, KW, h, w, zero) / prow[ow]

    return nb.njit(**_OPTS)(kernel)


# The common pooling geometries (MAX: LeNet 2x2/2; MAX and AVE: cifar10, CaffeNet, AlexNet, GoogLeNet
# 3x3/2); each one costs a compilation (~1 s, cached) on first use.
FIXED_GEOMETRIES = {"max": ((2, 2, 2, 2), (3, 3, 2, 2)), "ave": ((3, 3, 2, 2),)}
_fixed: dict[tuple, object] = {}


def _fixed_for(method: str, kh: int, kw: int, sh: int, sw: int):
    """The specialized forward (``"max"``/``"ave"``) for a common window/stride (built on first use), else None."""
    if (kh, kw, sh, sw) not in FIXED_GEOMETRIES.get(method, ()):
        return None
    key = (method, kh, kw, sh, sw)
    fn = _fixed.get(key)
    if fn is None:
        make = _make_max_fwd_fixed if method == "max" else _make_ave_fwd_fixed
        fn = _fixed.setdefault(key, make(kh, kw, sh, sw))
    return fn


@nb.njit(**_OPTS)
def _max_bwd(piece, pieces, dy, arg, dx, off, w, sh, sw, ph, pw, zero):  # pragma: no cover (compiled)
    # dx: (N, C, H*W); off[k] = flat offset of window position k from the window's corner.
    n, c, m = dx.shape
    oh_n, ow_n = dy.shape[2], dy.shape[3]
    for nc in range(n * c * piece // pieces, n * c * (piece + 1) // pieces):
        b = nc // c
        ch = nc - b * c
        dst = dx[b, ch]
        g = dy[b, ch]
        idx = arg[b, ch]
        for q in range(m):
            dst[q] = zero
        for oh in range(oh_n - 1, -1, -1):
            corner = (oh * sh - ph) * w - pw
            grow = g[nb.uint64(oh)]
            irow = idx[nb.uint64(oh)]
            for ow in range(ow_n - 1, -1, -1):
                k = irow[nb.uint64(ow)]
                if k >= 0:
                    dst[nb.uint64(corner + ow * sw + off[nb.uint64(k)])] += grow[nb.uint64(ow)]


@nb.njit(**_OPTS)
def _ave_fwd(piece, pieces, x, out, pool_size, kh, kw, sh, sw, ph, pw, zero):  # pragma: no cover (compiled)
    n, c, h, w = x.shape
    oh_n, ow_n = out.shape[2], out.shape[3]
    for nc in range(n * c * piece // pieces, n * c * (piece + 1) // pieces):
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
def _ave_bwd(piece, pieces, dy, pool_size, dx, kh, kw, sh, sw, ph, pw, zero):  # pragma: no cover (compiled)
    n, c, h, w = dx.shape
    oh_n, ow_n = dy.shape[2], dy.shape[3]
    for nc in range(n * c * piece // pieces, n * c * (piece + 1) // pieces):
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
    fixed = _fixed_for("max", kh, kw, sh, sw)
    if fixed is not None:
        launch(fixed, x, out, arg, ph, pw, x.dtype.type(-_FLT_MAX), work=x.size)
    else:
        launch(_max_fwd, x, out, arg, kh, kw, sh, sw, ph, pw, x.dtype.type(-_FLT_MAX), work=x.size)


def max_backward(dy: np.ndarray, arg: np.ndarray, dx: np.ndarray, kernel: Sequence[int], pad: Sequence[int],
                 stride: Sequence[int]) -> None:
    """MAX pooling backward: ``dx`` (overwritten) gets ``dy`` scatter-added at the argmax positions."""
    kh, kw, sh, sw, ph, pw = _ints(kernel, pad, stride)
    n, c, h, w = dx.shape
    if not dx.flags.c_contiguous:
        raise ValueError("max_backward needs a C-contiguous dx")
    ks = np.arange(kh * kw, dtype=np.int64)
    off = (ks // kw) * w + ks % kw  # no integer division per output in the kernel
    launch(_max_bwd, dy, arg, dx.reshape(n, c, h * w), off, w, sh, sw, ph, pw, dx.dtype.type(0), work=dx.size)


def ave_forward(x: np.ndarray, out: np.ndarray, pool_size: np.ndarray, kernel: Sequence[int], pad: Sequence[int],
                stride: Sequence[int]) -> None:
    """AVE pooling: window sums of the input over ``pool_size`` (OH, OW) (the layer's clipped areas)."""
    kh, kw, sh, sw, ph, pw = _ints(kernel, pad, stride)
    fixed = _fixed_for("ave", kh, kw, sh, sw)
    if fixed is not None:
        launch(fixed, x, out, pool_size, ph, pw, x.dtype.type(0), work=x.size)
    else:
        launch(_ave_fwd, x, out, pool_size, kh, kw, sh, sw, ph, pw, x.dtype.type(0), work=x.size)


def ave_backward(dy: np.ndarray, pool_size: np.ndarray, dx: np.ndarray, kernel: Sequence[int], pad: Sequence[int],
                 stride: Sequence[int]) -> None:
    """AVE pooling backward: ``dx`` (overwritten) = sum over windows of ``dy / pool_size``."""
    kh, kw, sh, sw, ph, pw = _ints(kernel, pad, stride)
    launch(_ave_bwd, dy, pool_size, dx, kh, kw, sh, sw, ph, pw, dx.dtype.type(0), work=dx.size)
