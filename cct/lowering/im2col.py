"""Batched im2col / col2im for N-d convolutions (numpy or cupy, same code).

Layout: for an input ``x`` of shape ``(*lead, *in_shape)`` (lead is usually ``(N, C)``) the
column array has shape ``(*lead, *kernel, *out_shape)``; with ``lead = (N, C)`` and the kernel
and output axes flattened, each image gives Caffe's column buffer: row
``(c * kh + i) * kw + j``, column ``oh * OW + ow``.

Both functions loop only over the kernel offsets (``prod(kernel)`` strided copies of the
whole batch); padding and dilation are handled by slicing a zero-padded copy. For 2-D
convolutions on numpy float arrays with at most two lead axes, compiled kernels
(:mod:`cct.kernels.im2col`, bitwise equal) run instead unless ``CCT_KERNELS=numpy``.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import kernels
from ..device.driver import array_module, host_kernels_usable


def _c_div(a: int, b: int) -> int:
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


def output_shape(in_shape: Sequence[int], kernel: Sequence[int], pad: Sequence[int], stride: Sequence[int],
                 dilation: Sequence[int]) -> tuple[int, ...]:
    """Convolution output shape (Caffe's formula, C integer division)."""
    return tuple(_c_div(i + 2 * p - (d * (k - 1) + 1), s) + 1
                 for i, k, p, s, d in zip(in_shape, kernel, pad, stride, dilation))


def _padded_shape(in_shape, kernel, pad, stride, dilation, out_shape) -> tuple[int, ...]:
    # Large enough for every window: at least in + 2p, more when the last window hangs over
    # (Caffe's C division can give one window for an input smaller than the kernel extent).
    return tuple(max(i + 2 * p, (o - 1) * s + d * (k - 1) + 1)
                 for i, k, p, s, d, o in zip(in_shape, kernel, pad, stride, dilation, out_shape))


def _window(offsets, stride, dilation, out_shape) -> tuple[slice, ...]:
    return tuple(slice(o * d, o * d + (n - 1) * s + 1, s) for o, s, d, n in zip(offsets, stride, dilation, out_shape))


def _kernel_module(nd: int, lead: tuple, *arrays: Any):
    """The im2col kernel module when the compiled path applies (2-D, <= 2 lead axes, numpy floats)."""
    if nd != 2 or len(lead) > 2 or not host_kernels_usable(*arrays):
        return None
    return kernels.get("im2col")


def _as_nc(a: Any, nlead: int) -> Any:
    """View with exactly two lead axes (``N, C``), adding unit axes in front."""
    return a[(None,) * (2 - nlead)] if nlead < 2 else a


def im2col(x: Any, kernel: Sequence[int], pad: Sequence[int], stride: Sequence[int], dilation: Sequence[int],
           out_shape: Sequence[int] | None = None, out: Any = None) -> Any:
    """Lower ``x`` ``(*lead, *in_shape)`` to columns ``(*lead, *kernel, *out_shape)``.

    ``out`` may be any writable array (or view) of that shape; padding reads as zero.
    """
    xp = array_module(x)
    nd = len(kernel)
    kernel, pad, stride, dilation = (tuple(int(v) for v in a) for a in (kernel, pad, stride, dilation))
    lead = tuple(x.shape[: x.ndim - nd])
    in_shape = tuple(x.shape[x.ndim - nd:])
    if out_shape is None:
        out_shape = output_shape(in_shape, kernel, pad, stride, dilation)
    out_shape = tuple(int(o) for o in out_shape)
    col_shape = lead + kernel + out_shape
    if out is None:
        out = xp.empty(col_shape, dtype=x.dtype)
    elif tuple(out.shape) != col_shape:
        raise ValueError(f"im2col: out has shape {tuple(out.shape)}, expected {col_shape}")
    if out.size == 0:
        return out
    km = _kernel_module(nd, lead, x, out)
    if km is not None:
        km.im2col(_as_nc(x, len(lead)), _as_nc(out, len(lead)), kernel, pad, stride, dilation)
        return out
    padded = _padded_shape(in_shape, kernel, pad, stride, dilation, out_shape)
    if padded == in_shape:
        src = x
    else:
        src = xp.zeros(lead + padded, dtype=x.dtype)
        src[(Ellipsis,) + tuple(slice(p, p + i) for p, i in zip(pad, in_shape))] = x
    out[...] = _windows_view(xp, src, nd, kernel, stride, dilation, out_shape)
    return out


def _windows_view(xp: Any, src: Any, nd: int, kernel: tuple, stride: tuple, dilation: tuple, out_shape: tuple) -> Any:
    """A strided view ``(*lead, *kernel, *out_shape)`` of every window of ``src``: im2col as one copy
    (one kernel launch on a GPU instead of one per kernel offset)."""
    lead = tuple(src.shape[: src.ndim - nd])
    sp = tuple(src.strides[src.ndim - nd:])
    strides = (tuple(src.strides[: src.ndim - nd]) + tuple(s * d for s, d in zip(sp, dilation))
               + tuple(s * t for s, t in zip(sp, stride)))
    return xp.lib.stride_tricks.as_strided(src, shape=lead + kernel + out_shape, strides=strides)


def col2im(col: Any, in_shape: Sequence[int], kernel: Sequence[int], pad: Sequence[int], stride: Sequence[int],
           dilation: Sequence[int], out: Any = None) -> Any:
    """Adjoint of :func:`im2col`: scatter-add columns ``(*lead, *kernel, *out_shape)`` into ``(*lead, *in_shape)``.

    Overlapping windows accumulate; contributions that fall into the padding are dropped.
    With ``out`` given the result is written (not added) into it.
    """
    xp = array_module(col)
    nd = len(kernel)
    kernel, pad, stride, dilation = (tuple(int(v) for v in a) for a in (kernel, pad, stride, dilation))
    in_shape = tuple(int(i) for i in in_shape)
    lead = tuple(col.shape[: col.ndim - 2 * nd])
    out_shape = tuple(col.shape[col.ndim - nd:])
    padded = _padded_shape(in_shape, kernel, pad, stride, dilation, out_shape)
    km = None
    if col.size != 0 and (out is None or tuple(out.shape) == lead + in_shape):
        km = _kernel_module(nd, lead, col, *(() if out is None else (out,)))
    if km is not None:
        if out is None:
            out = np.empty(lead + in_shape, dtype=col.dtype)
        km.col2im(_as_nc(col, len(lead)), _as_nc(out, len(lead)), kernel, pad, stride, dilation)
        return out
    if col.size == 0:
        res = xp.zeros(lead + in_shape, dtype=col.dtype)
    else:
        acc = xp.zeros(lead + padded, dtype=col.dtype)
        for offs in itertools.product(*(range(k) for k in kernel)):
            window = (Ellipsis,) + _window(offs, stride, dilation, out_shape)
            acc[window] += col[(Ellipsis,) + offs + (slice(None),) * nd]
        res = acc[(Ellipsis,) + tuple(slice(p, p + i) for p, i in zip(pad, in_shape))]
    if out is None:
        return res
    out[...] = res
    return out
