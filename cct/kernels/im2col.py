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

_OPTS = dict(nogil=True, cache=True, parallel=True, error_model="numpy")


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


@nb.njit(**_OPTS)
def _im2col(x, out, kmajor, kh, kw, sh, sw, ph, pw, dh, dw, zero):  # pragma: no cover (compiled)
    n, c, h, w = x.shape
    oh_n, ow_n = out.shape[4], out.shape[5]
    usw = nb.uint64(sw)
    uown = nb.uint64(ow_n)
    for nc in nb.prange(n * c):
        b = nc // c
        ch = nc - b * c
        src = x[b, ch]
        for i in range(kh):
            roff = i * dh - ph
            for j in range(kw):
                coff = j * dw - pw
                lo, hi = _ow_range(coff, sw, w, ow_n)
                ulo = nb.uint64(lo)
                cnt = nb.uint64(hi - lo)
                s0 = nb.uint64(lo * sw + coff if hi > lo else 0)
                blk = out[ch, i, j, b] if kmajor else out[b, ch, i, j]
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


@nb.njit(**_OPTS)
def _col2im(col, kmajor, out, kh, kw, sh, sw, ph, pw, dh, dw, zero):  # pragma: no cover (compiled)
    n, c, h, w = out.shape
    oh_n, ow_n = col.shape[4], col.shape[5]
    usw = nb.uint64(sw)
    for nc in nb.prange(n * c):
        b = nc // c
        ch = nc - b * c
        dst = out[b, ch]
        for r in range(h):
            drow = dst[r]
            for q in range(w):
                drow[q] = zero
        for i in range(kh):
            roff = i * dh - ph
            for j in range(kw):
                coff = j * dw - pw
                lo, hi = _ow_range(coff, sw, w, ow_n)
                if lo >= hi:
                    continue
                ulo = nb.uint64(lo)
                cnt = nb.uint64(hi - lo)
                d0 = nb.uint64(lo * sw + coff)
                blk = col[ch, i, j, b] if kmajor else col[b, ch, i, j]
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


def _canonical(col: np.ndarray) -> tuple[np.ndarray, bool]:
    """``(array, kmajor)``: ``col`` ``(N, C, kh, kw, OH, OW)`` as a C-contiguous array where possible --
    itself, or (``kmajor``) its ``(C, kh, kw, N, OH, OW)`` transpose, the type-1 lowering's buffer."""
    if not col.flags.c_contiguous:
        t = col.transpose(1, 2, 3, 0, 4, 5)
        if t.flags.c_contiguous:
            return t, True
    return col, False


def _ints(kernel, pad, stride, dilation) -> tuple[int, ...]:
    return (int(kernel[0]), int(kernel[1]), int(stride[0]), int(stride[1]), int(pad[0]), int(pad[1]),
            int(dilation[0]), int(dilation[1]))


def im2col(x: np.ndarray, out: np.ndarray, kernel: Sequence[int], pad: Sequence[int], stride: Sequence[int],
           dilation: Sequence[int]) -> np.ndarray:
    """Fill ``out`` ``(N, C, kh, kw, OH, OW)`` (any strides) with the columns of ``x`` ``(N, C, H, W)``."""
    kh, kw, sh, sw, ph, pw, dh, dw = _ints(kernel, pad, stride, dilation)
    dst, kmajor = _canonical(out)
    _im2col(x, dst, kmajor, kh, kw, sh, sw, ph, pw, dh, dw, out.dtype.type(0))
    return out


def col2im(col: np.ndarray, out: np.ndarray, kernel: Sequence[int], pad: Sequence[int], stride: Sequence[int],
           dilation: Sequence[int]) -> np.ndarray:
    """Write into ``out`` ``(N, C, H, W)`` the scatter-sum of ``col`` ``(N, C, kh, kw, OH, OW)`` (any strides)."""
    kh, kw, sh, sw, ph, pw, dh, dw = _ints(kernel, pad, stride, dilation)
    src, kmajor = _canonical(col)
    _col2im(src, kmajor, out, kh, kw, sh, sw, ph, pw, dh, dw, out.dtype.type(0))
    return out
