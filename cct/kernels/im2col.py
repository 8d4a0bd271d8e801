"""numba kernels of 2-D im2col / col2im over ``(N, C, H, W)``, parallel over ``N * C`` planes.

Layout as :mod:`cct.lowering.im2col`: columns ``(N, C, kh, kw, OH, OW)``, any strides. A view
whose ``(C, kh, kw, N, OH, OW)`` transpose is C-contiguous (the type-1 lowering's buffer) is
walked in that order, so both common layouts get contiguous (vectorizable) inner loops. Padding
and dilation as Caffe; windows that hang over the padded input read zeros.

* im2col is a pure copy (bitwise equal to the numpy path).
* col2im zeroes each plane, then adds the columns kernel offset by kernel offset (row-major),
  the numpy path's order, so each input position sums the same terms in the same order.
"""
from __future__ import annotations

from collections.abc import Sequence

import numba as nb
import numpy as np

_OPTS = dict(nogil=True, cache=True, error_model="numpy",
             parallel=dict(prange=True, comprehension=False, reduction=False, inplace_binop=False, setitem=False,
                           numpy=False, stencil=False, fusion=False))


@nb.njit(cache=True)
def _ow_range(coff, sw, w, ow_n):  # pragma: no cover (compiled)
    """Output columns ``ow`` with ``0 <= ow * sw + coff < w``: [lo, hi)."""
    lo = 0
    if coff < 0:
        lo = (-coff + sw - 1) // sw
    hi = 0
    if w - coff > 0:
        hi = (w - 1 - coff) // sw + 1
    lo = min(lo, ow_n)
    hi = max(min(hi, ow_n), lo)
    return lo, hi


@nb.njit(cache=True)
def _im2col_block(src, blk, roff, coff, lo, hi, h, sh, sw, zero):  # pragma: no cover (compiled)
    """One (image, channel, kernel offset): ``blk`` (OH, OW) from the input plane ``src`` (H, W);
    output columns [lo, hi) read inside the input (the rest are padding)."""
    oh_n, ow_n = blk.shape
    ulo = nb.uint64(lo)
    cnt = nb.uint64(hi - lo)
    s0 = nb.uint64(lo * sw + coff if hi > lo else 0)
    usw = nb.uint64(sw)
    uown = nb.uint64(ow_n)
    for oh in range(oh_n):
        d = blk[oh]
        r = oh * sh + roff
        if r < 0 or r >= h:
            for ow in range(uown):
                d[ow] = zero
            continue
        srow = src[nb.uint64(r)]
        for ow in range(ulo):
            d[ow] = zero
        if sw == 1:
            for t in range(cnt):
                d[ulo + t] = srow[s0 + t]
        else:
            for t in range(cnt):
                d[ulo + t] = srow[s0 + t * usw]
        for ow in range(ulo + cnt, uown):
            d[ow] = zero


@nb.njit(cache=True)
def _col2im_block(blk, dst, roff, coff, lo, hi, h, sh, sw):  # pragma: no cover (compiled)
    """One (image, channel, kernel offset): add ``blk`` (OH, OW) columns [lo, hi) into the plane ``dst`` (H, W)."""
    oh_n = blk.shape[0]
    if lo >= hi:
        return
    ulo = nb.uint64(lo)
    cnt = nb.uint64(hi - lo)
    d0 = nb.uint64(lo * sw + coff)
    usw = nb.uint64(sw)
    for oh in range(oh_n):
        r = oh * sh + roff
        if r < 0 or r >= h:
            continue
        srow = blk[oh]
        drow = dst[nb.uint64(r)]
        if sw == 1:
            for t in range(cnt):
                drow[d0 + t] += srow[ulo + t]
        else:
            for t in range(cnt):
                drow[d0 + t * usw] += srow[ulo + t]


@nb.njit(cache=True)
def _zero_plane(dst, zero):  # pragma: no cover (compiled)
    for r in range(dst.shape[0]):
        drow = dst[r]
        for q in range(dst.shape[1]):
            drow[q] = zero


@nb.njit(cache=True)
def _col_ranges(kw, sw, pw, dw, w, ow_n):  # pragma: no cover (compiled)
    """Per kernel column j: the output columns [lo[j], hi[j]) that read inside the input."""
    lo = np.empty(kw, np.int64)
    hi = np.empty(kw, np.int64)
    for j in range(kw):
        lo[j], hi[j] = _ow_range(j * dw - pw, sw, w, ow_n)
    return lo, hi


@nb.njit(**_OPTS)
def _im2col(x, out, kmajor, kh, kw, sh, sw, ph, pw, dh, dw, zero, ijchunk):  # pragma: no cover (compiled)
    """``out`` is (N, C, kh, kw, OH, OW), or with ``kmajor`` (C, kh, kw, N, OH, OW); C-contiguous."""
    n, c, h, w = x.shape
    lo, hi = _col_ranges(kw, sw, pw, dw, w, out.shape[5])
    if kmajor:
        # One task per (channel, run of kernel offsets): each offset's (N, OH, OW) block is written
        # sequentially while the channel's input planes stay in cache.
        kk = kh * kw
        nchunks = (kk + ijchunk - 1) // ijchunk
        for task in nb.prange(c * nchunks):
            ch = task // nchunks
            ij0 = (task - ch * nchunks) * ijchunk
            for ij in range(ij0, min(ij0 + ijchunk, kk)):
                i = ij // kw
                j = ij - i * kw
                for b in range(n):
                    _im2col_block(x[b, ch], out[ch, i, j, b], i * dh - ph, j * dw - pw, lo[j], hi[j], h, sh, sw,
                                  zero)
    else:
        for nc in nb.prange(n * c):  # one task per input plane
            b = nc // c
            ch = nc - b * c
            for i in range(kh):
                for j in range(kw):
                    _im2col_block(x[b, ch], out[b, ch, i, j], i * dh - ph, j * dw - pw, lo[j], hi[j], h, sh, sw,
                                  zero)


@nb.njit(**_OPTS)
def _col2im(col, kmajor, out, kh, kw, sh, sw, ph, pw, dh, dw, zero, chunk):  # pragma: no cover (compiled)
    """``col`` is (N, C, kh, kw, OH, OW), or with ``kmajor`` (C, kh, kw, N, OH, OW); C-contiguous.
    Every output position receives its terms in row-major kernel-offset order."""
    n, c, h, w = out.shape
    lo, hi = _col_ranges(kw, sw, pw, dw, w, col.shape[5])
    if kmajor:
        # One task per (channel, run of ``chunk`` images): for each kernel offset the run's column
        # blocks are read sequentially.
        nchunks = (n + chunk - 1) // chunk
        for task in nb.prange(c * nchunks):
            ch = task // nchunks
            b0 = (task - ch * nchunks) * chunk
            b1 = min(b0 + chunk, n)
            for b in range(b0, b1):
                _zero_plane(out[b, ch], zero)
            for i in range(kh):
                for j in range(kw):
                    for b in range(b0, b1):
                        _col2im_block(col[ch, i, j, b], out[b, ch], i * dh - ph, j * dw - pw, lo[j], hi[j], h, sh,
                                      sw)
    else:
        for nc in nb.prange(n * c):  # one task per output plane
            b = nc // c
            ch = nc - b * c
            dst = out[b, ch]
            _zero_plane(dst, zero)
            for i in range(kh):
                for j in range(kw):
                    _col2im_block(col[b, ch, i, j], dst, i * dh - ph, j * dw - pw, lo[j], hi[j], h, sh, sw)


def _canonical(col: np.ndarray) -> tuple[np.ndarray, bool]:
    """``(array, kmajor)``: ``col`` ``(N, C, kh, kw, OH, OW)`` as a C-contiguous array where possible --
    itself, or (``kmajor``) its ``(C, kh, kw, N, OH, OW)`` transpose, the type-1 lowering's buffer."""
    if not col.flags.c_contiguous:
        t = col.transpose(1, 2, 3, 0, 4, 5)
        if t.flags.c_contiguous:
            return t, True
    return col, False


def _threads() -> int:
    return int(nb.get_num_threads())


def _ints(kernel, pad, stride, dilation) -> tuple[int, ...]:
    return (int(kernel[0]), int(kernel[1]), int(stride[0]), int(stride[1]), int(pad[0]), int(pad[1]),
            int(dilation[0]), int(dilation[1]))


def im2col(x: np.ndarray, out: np.ndarray, kernel: Sequence[int], pad: Sequence[int], stride: Sequence[int],
           dilation: Sequence[int]) -> np.ndarray:
    """Fill ``out`` ``(N, C, kh, kw, OH, OW)`` (any strides) with the columns of ``x`` ``(N, C, H, W)``."""
    kh, kw, sh, sw, ph, pw, dh, dw = _ints(kernel, pad, stride, dilation)
    dst, kmajor = _canonical(out)
    if not dst.flags.c_contiguous:  # an unusual layout: fill a C-order buffer (one compiled variant)
        tmp = np.empty(out.shape, out.dtype)
        im2col(x, tmp, kernel, pad, stride, dilation)
        out[...] = tmp
        return out
    x = np.ascontiguousarray(x)
    kk = kh * kw
    nchunks = max(1, min(kk, -(-8 * _threads() // x.shape[1])))  # ~8 tasks per thread
    _im2col(x, dst, kmajor, kh, kw, sh, sw, ph, pw, dh, dw, out.dtype.type(0), -(-kk // nchunks))
    return out


def col2im(col: np.ndarray, out: np.ndarray, kernel: Sequence[int], pad: Sequence[int], stride: Sequence[int],
           dilation: Sequence[int]) -> np.ndarray:
    """Write into ``out`` ``(N, C, H, W)`` the scatter-sum of ``col`` ``(N, C, kh, kw, OH, OW)`` (any strides)."""
    kh, kw, sh, sw, ph, pw, dh, dw = _ints(kernel, pad, stride, dilation)
    src, kmajor = _canonical(col)
    if not src.flags.c_contiguous:
        src, kmajor = np.ascontiguousarray(col), False
    if not out.flags.c_contiguous:
        tmp = np.empty(out.shape, out.dtype)
        col2im(src, tmp, kernel, pad, stride, dilation)
        out[...] = tmp
        return out
    n, c = out.shape[:2]
    chunk = max(1, min(n, -(-n * c // (8 * _threads()))))  # ~8 tasks per thread
    _col2im(src, kmajor, out, kh, kw, sh, sw, ph, pw, dh, dw, out.dtype.type(0), chunk)
    return out
