"""numba kernels of 2-D im2col / col2im over ``(N, C, H, W)``, parallel over channels x runs of images.

Layout as :mod:`cct.lowering.im2col`: columns ``(N, C, kh, kw, OH, OW)``, any strides. The two
C-contiguous layouts are walked directly: C order, and a view whose ``(C, kh, kw, N, OH, OW)``
transpose is C-contiguous (the type-1 lowering's buffer); anything else goes through a C-order
copy. Padding and dilation as Caffe; windows that hang over the padded input read zeros.

Each task takes one channel of a run of images. With padding (or a last window hanging over the
input) it first copies the run's planes into a zeroed, padded scratch plane per image, so every
row of a lowered block is ONE branch-free copy ``OW`` long (a contiguous run for stride 1) --
no per-row border logic, which dominated for the 8..16-float rows of small images (LeNet,
cifar10_quick) -- moved in whole 8-element vectors plus a scalar tail. Without padding the
input planes are read in place. Per call, ``(N / run) * C`` tasks of ``run`` images (~8 tasks
per kernel thread of the calling thread; see :mod:`cct.kernels` for thread budgets).

* im2col is a pure copy (bitwise equal to the numpy path).
* col2im accumulates into zeroed (padded scratch or output) planes, kernel offset by kernel
  offset in row-major order -- the numpy path's order, so each input position sums the same
  terms in the same order -- then copies the interior of the padded planes out.
"""
from __future__ import annotations

from collections.abc import Sequence

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from . import LOWERING_SMALL_WORK, get_num_threads, launch

_OPTS = dict(nogil=True, cache=True, error_model="numpy")


# Unit-stride rows move _V elements per (unaligned) vector load/store, then a scalar tail: LLVM's
# own loop vectorizer (runtime alias checks, 16 x 4 floats per iteration on AVX-512) leaves rows of
# 8..32 elements -- every row of LeNet and cifar10_quick -- to its scalar remainder loop. The adds
# are plain IEEE ``fadd`` (no fast-math), the same operation per element as the scalar code.
_V = 8


def _vec_ptrs(context, builder, sig, args):
    """Pointers to ``_V``-element vectors at ``dst.data + d`` and ``src.data + s``."""
    dst, d, src, s = args
    darr = context.make_array(sig.args[0])(context, builder, dst)
    sarr = context.make_array(sig.args[2])(context, builder, src)
    vec = ir.VectorType(context.get_data_type(sig.args[0].dtype), _V).as_pointer()
    return builder.bitcast(builder.gep(darr.data, [d]), vec), builder.bitcast(builder.gep(sarr.data, [s]), vec)


@intrinsic
def _vcopy(typingctx, dst, d, src, s):  # pragma: no cover (compiled)
    """``dst[d:d + _V] = src[s:s + _V]`` as one unaligned vector load and store."""

    def codegen(context, builder, sig, args):
        dp, sp = _vec_ptrs(context, builder, sig, args)
        builder.store(builder.load(sp, align=1), dp, align=1)
        return context.get_dummy_value()

    return types.void(dst, d, src, s), codegen


@intrinsic
def _vadd(typingctx, dst, d, src, s):  # pragma: no cover (compiled)
    """``dst[d:d + _V] += src[s:s + _V]`` elementwise (IEEE adds, ``dst + src`` as the scalar code)."""

    def codegen(context, builder, sig, args):
        dp, sp = _vec_ptrs(context, builder, sig, args)
        builder.store(builder.fadd(builder.load(dp, align=1), builder.load(sp, align=1)), dp, align=1)
        return context.get_dummy_value()

    return types.void(dst, d, src, s), codegen


def _tail_mask(builder, r):
    """``<_V x i1>``: lane ``i`` is set when ``i < r``."""
    i32 = ir.IntType(32)
    vi = ir.VectorType(i32, _V)
    rv = builder.trunc(r, i32) if r.type.width > 32 else r
    splat = builder.insert_element(ir.Constant(vi, None), rv, ir.Constant(i32, 0))
    splat = builder.shuffle_vector(splat, splat, ir.Constant(vi, [0] * _V))
    return builder.icmp_unsigned("<", ir.Constant(vi, list(range(_V))), splat)


def _masked_fns(builder, vec, ptr, mask):
    """The ``llvm.masked.load`` / ``llvm.masked.store`` intrinsics for ``vec`` (declared once per module)."""
    i32 = ir.IntType(32)
    suffix = f"v{_V}f{32 if vec.element == ir.FloatType() else 64}.p0"
    mod = builder.module
    fns = []
    for name, fnty in ((f"llvm.masked.load.{suffix}", ir.FunctionType(vec, [ptr, i32, mask, vec])),
                       (f"llvm.masked.store.{suffix}", ir.FunctionType(ir.VoidType(), [vec, ptr, i32, mask]))):
        fns.append(mod.globals[name] if name in mod.globals else ir.Function(mod, fnty, name=name))
    return fns


def _masked_setup(context, builder, sig, args):
    """``(dst ptr, src ptr, mask, vector type, masked load, masked store, i32)`` of a tail intrinsic."""
    dp, sp = _vec_ptrs(context, builder, sig, args[:4])
    mask = _tail_mask(builder, args[4])
    vec = ir.VectorType(context.get_data_type(sig.args[0].dtype), _V)
    load, store = _masked_fns(builder, vec, dp.type, mask.type)
    return dp, sp, mask, vec, load, store, ir.IntType(32)


@intrinsic
def _vcopy_tail(typingctx, dst, d, src, s, r):  # pragma: no cover (compiled)
    """``dst[d:d + r] = src[s:s + r]`` for ``r < _V`` as one masked vector load and store (the masked-off
    lanes are never touched, so this may run up to the end of either array)."""

    def codegen(context, builder, sig, args):
        dp, sp, mask, vec, load, store, i32 = _masked_setup(context, builder, sig, args)
        v = builder.call(load, [sp, ir.Constant(i32, 1), mask, ir.Constant(vec, None)])
        builder.call(store, [v, dp, ir.Constant(i32, 1), mask])
        return context.get_dummy_value()

    return types.void(dst, d, src, s, r), codegen


@intrinsic
def _vadd_tail(typingctx, dst, d, src, s, r):  # pragma: no cover (compiled)
    """``dst[d:d + r] += src[s:s + r]`` for ``r < _V`` with masked vector loads and store."""

    def codegen(context, builder, sig, args):
        dp, sp, mask, vec, load, store, i32 = _masked_setup(context, builder, sig, args)
        a = builder.call(load, [dp, ir.Constant(i32, 1), mask, ir.Constant(vec, None)])
        b = builder.call(load, [sp, ir.Constant(i32, 1), mask, ir.Constant(vec, None)])
        builder.call(store, [builder.fadd(a, b), dp, ir.Constant(i32, 1), mask])
        return context.get_dummy_value()

    return types.void(dst, d, src, s, r), codegen


@nb.njit(**_OPTS)
def _im2col(piece, pieces, x, out, sb, sc, sij, kh, kw, sh, sw, ph, pw, dh, dw, hp, wp, oh_n, ow_n, run,
            zero):  # pragma: no cover (compiled)
    """``x`` (N, C, H, W) and ``out`` C-contiguous; ``out``'s element (b, ch, i, j, oh, ow) at
    ``b * sb + ch * sc + (i * kw + j) * sij + oh * OW + ow``. ``hp, wp``: the padded plane."""
    n, c, h, w = x.shape
    xf = x.reshape(-1)
    of = out.reshape(-1)
    kk = kh * kw
    plane = hp * wp
    padded = ph != 0 or pw != 0 or hp != h or wp != w
    nruns = (n + run - 1) // run
    uow = nb.uint64(ow_n)
    usw = nb.uint64(sw)
    uw = nb.uint64(w)
    unit = sw == 1
    uv = nb.uint64(_V)
    nv = uow // uv * uv
    zero_u = nb.uint64(0)
    for task in range(c * nruns * piece // pieces, c * nruns * (piece + 1) // pieces):
        ch = task // nruns
        b0 = (task - ch * nruns) * run
        b1 = min(b0 + run, n)
        if padded:  # the run's planes of this channel, zero-padded
            src = np.empty((b1 - b0) * plane, x.dtype)
            for q in range(src.size):
                src[q] = zero
            for b in range(b0, b1):
                for r in range(h):
                    d = nb.uint64((b - b0) * plane + (r + ph) * wp + pw)
                    s = nb.uint64(((b * c + ch) * h + r) * w)
                    for t in range(uw):
                        src[d + t] = xf[s + t]
            sbase = -b0 * plane
            bstride = plane
        else:
            src = xf
            sbase = ch * plane
            bstride = c * plane
        for ij in range(kk):
            i = ij // kw
            j = ij - i * kw
            soff = i * dh * wp + j * dw
            for b in range(b0, b1):
                s0 = sbase + b * bstride + soff
                d0 = b * sb + ch * sc + ij * sij
                if unit:  # each row: whole vectors, then a scalar tail
                    for oh in range(oh_n):
                        d = nb.uint64(d0 + oh * ow_n)
                        s = nb.uint64(s0 + oh * sh * wp)
                        for t in range(zero_u, nv, uv):
                            _vcopy(of, d + t, src, s + t)
                        if nv < uow:
                            _vcopy_tail(of, d + nv, src, s + nv, uow - nv)
                else:
                    for oh in range(oh_n):
                        d = nb.uint64(d0 + oh * ow_n)
                        s = nb.uint64(s0 + oh * sh * wp)
                        for t in range(uow):
                            of[d + t] = src[s + t * usw]


@nb.njit(**_OPTS)
def _col2im(piece, pieces, col, out, sb, sc, sij, kh, kw, sh, sw, ph, pw, dh, dw, hp, wp, oh_n, ow_n, run,
            zero):  # pragma: no cover (compiled)
    """Adjoint of :func:`_im2col` (same strides); every position of a zeroed (padded) plane receives
    its terms in row-major kernel-offset order, then the interior is written to ``out``."""
    n, c, h, w = out.shape
    cf = col.reshape(-1)
    of = out.reshape(-1)
    kk = kh * kw
    plane = hp * wp
    padded = ph != 0 or pw != 0 or hp != h or wp != w
    nruns = (n + run - 1) // run
    uow = nb.uint64(ow_n)
    usw = nb.uint64(sw)
    uw = nb.uint64(w)
    unit = sw == 1
    uv = nb.uint64(_V)
    nv = uow // uv * uv
    zero_u = nb.uint64(0)
    for task in range(c * nruns * piece // pieces, c * nruns * (piece + 1) // pieces):
        ch = task // nruns
        b0 = (task - ch * nruns) * run
        b1 = min(b0 + run, n)
        if padded:
            acc = np.empty((b1 - b0) * plane, out.dtype)
            for q in range(acc.size):
                acc[q] = zero
            abase = -b0 * plane
            bstride = plane
        else:
            acc = of
            for b in range(b0, b1):
                p0 = (b * c + ch) * plane
                for q in range(p0, p0 + plane):
                    acc[q] = zero
            abase = ch * plane
            bstride = c * plane
        for ij in range(kk):
            i = ij // kw
            j = ij - i * kw
            aoff = i * dh * wp + j * dw
            for b in range(b0, b1):
                a0 = abase + b * bstride + aoff
                c0 = b * sb + ch * sc + ij * sij
                if unit:
                    for oh in range(oh_n):
                        a = nb.uint64(a0 + oh * sh * wp)
                        s = nb.uint64(c0 + oh * ow_n)
                        for t in range(zero_u, nv, uv):
                            _vadd(acc, a + t, cf, s + t)
                        if nv < uow:
                            _vadd_tail(acc, a + nv, cf, s + nv, uow - nv)
                else:
                    for oh in range(oh_n):
                        a = nb.uint64(a0 + oh * sh * wp)
                        s = nb.uint64(c0 + oh * ow_n)
                        for t in range(uow):
                            acc[a + t * usw] += cf[s + t]
        if padded:
            for b in range(b0, b1):
                for r in range(h):
                    d = nb.uint64(((b * c + ch) * h + r) * w)
                    s = nb.uint64((b - b0) * plane + (r + ph) * wp + pw)
                    for t in range(uw):
                        of[d + t] = acc[s + t]


def _canonical(col: np.ndarray) -> tuple[np.ndarray, bool]:
    """``(array, kmajor)``: ``col`` ``(N, C, kh, kw, OH, OW)`` as a C-contiguous array where possible --
    itself, or (``kmajor``) its ``(C, kh, kw, N, OH, OW)`` transpose, the type-1 lowering's buffer."""
    if not col.flags.c_contiguous:
        t = col.transpose(1, 2, 3, 0, 4, 5)
        if t.flags.c_contiguous:
            return t, True
    return col, False


def _threads(elements: int) -> int:
    """The kernel threads a call touching ``elements`` runs on (one below :data:`LOWERING_SMALL_WORK`)."""
    return get_num_threads() if elements >= LOWERING_SMALL_WORK else 1


def _ints(kernel, pad, stride, dilation) -> tuple[int, ...]:
    return (int(kernel[0]), int(kernel[1]), int(stride[0]), int(stride[1]), int(pad[0]), int(pad[1]),
            int(dilation[0]), int(dilation[1]))


def _layout(arr: np.ndarray, kmajor: bool, n: int, c: int, h: int, w: int, kh: int, kw: int, sh: int, sw: int,
            ph: int, pw: int, dh: int, dw: int) -> tuple[int, ...]:
    """``(sb, sc, sij, hp, wp, OH, OW, run)``: element strides of the columns per image / channel /
    kernel offset, the padded plane (as the numpy path's), and images per task (~8 tasks per thread)."""
    oh, ow = int(arr.shape[4]), int(arr.shape[5])
    blk, kk = oh * ow, kh * kw
    if kmajor:
        sb, sc, sij = blk, kk * n * blk, n * blk
    else:
        sb, sc, sij = c * kk * blk, kk * blk, blk
    hp = max(h + 2 * ph, (oh - 1) * sh + dh * (kh - 1) + 1)
    wp = max(w + 2 * pw, (ow - 1) * sw + dw * (kw - 1) + 1)
    run = max(1, min(n, -(-n * c // (8 * _threads(arr.size)))))
    return sb, sc, sij, hp, wp, oh, ow, run


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
    n, c, h, w = x.shape
    geo = _layout(out, kmajor, n, c, h, w, kh, kw, sh, sw, ph, pw, dh, dw)
    launch(_im2col, x, dst, *geo[:3], kh, kw, sh, sw, ph, pw, dh, dw, *geo[3:], out.dtype.type(0), work=out.size,
           limit=LOWERING_SMALL_WORK)
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
        col2im(src if not kmajor else col, tmp, kernel, pad, stride, dilation)
        out[...] = tmp
        return out
    n, c, h, w = out.shape
    geo = _layout(col, kmajor, n, c, h, w, kh, kw, sh, sw, ph, pw, dh, dw)
    launch(_col2im, src, out, *geo[:3], kh, kw, sh, sw, ph, pw, dh, dw, *geo[3:], out.dtype.type(0), work=col.size,
           limit=LOWERING_SMALL_WORK)
    return out
