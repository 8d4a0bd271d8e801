"""Register-blocked direct convolution: LLVM vector micro-kernels (ZNNi IV-A.1) behind numba drivers.

numba's own loops keep accumulators in memory (a load and a store per multiply-add), which caps
a direct convolution far below the machine's peak. The micro-kernels here are written as LLVM IR
(numba ``@intrinsic``) on native vectors of ``lanes`` = 64 bytes on AVX-512, 32 elsewhere (16 or 8
float32), with tiles sized to the register file (:mod:`.simd_tiles`), so the accumulators live in
registers for a whole reduction:

* :func:`forward` -- a tile of ``J`` output channels x ``rows`` vectors of output
  positions; per kernel tap it loads one input vector per row and one weight per channel
  (broadcast) and issues ``J x rows`` fused multiply-adds into accumulators that start from the bias
  (no pass over the output adds it afterwards); one driver per tile and kernel width, the
  taps of a kernel row unrolled (:data:`UNROLLED_WIDTHS`; wider kernels loop). Weights come as
  ``(G, NB, Cg, KD, KH, KW, J)`` (:func:`blocked_weights`), so a tile walks them in order.
* :func:`weight_grad` -- a tile of ``J`` output channels x ``T`` kernel columns accumulates
  ``dy[m] * x[c]`` products over one image's positions, vector by vector, into per-chunk vector
  partials (``(chunks, G, NB, Cg, KD, KH, KW, J, lanes)``) that the caller sums.

Both walk "rows" of output positions: an output row of a padded width (a multiple of ``lanes``;
"rows" layout) or consecutive vectors of a zero-padded plane flattened with the input's width
("flat" layout, for narrow outputs; the positions past each row's end are computed and dropped).
The input must be unit-strided along the width, so every tap reads a contiguous vector; the
layout arithmetic lives in :mod:`cct.lowering.direct`. Sums run in a different order from the
GEMM lowerings (results agree to rounding).
"""
from __future__ import annotations

import threading
import types as pytypes
from typing import Any

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import launch, simd_tiles

_OPTS = dict(nogil=True, cache=True, error_model="numpy")
VECTOR_BYTES = simd_tiles.host_vector_bytes()
#: position vectors per forward tile, by its output channels (24 accumulators on AVX-512, 12 on AVX2)
FORWARD_ROWS = simd_tiles.forward_rows(VECTOR_BYTES)
_I64 = ir.IntType(64)
_I32 = ir.IntType(32)


def lanes(dtype: np.dtype) -> int:
    """Elements per micro-kernel vector for ``dtype``."""
    return VECTOR_BYTES // np.dtype(dtype).itemsize


class _IR:
    """Small IR helpers over one builder: constants, vector loads/stores, broadcasts, FMA."""

    def __init__(self, builder, dtype):
        self.b = builder
        self.el = ir.FloatType() if dtype == types.float32 else ir.DoubleType()
        self.n = VECTOR_BYTES // (4 if dtype == types.float32 else 8)
        self.vec = ir.VectorType(self.el, self.n)
        name = f"llvm.fma.v{self.n}{'f32' if dtype == types.float32 else 'f64'}"
        self.fma_fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(self.vec, [self.vec] * 3), name)

    def c(self, v: int):
        return ir.Constant(_I64, v)

    def add(self, *vals):
        out = vals[0]
        for v in vals[1:]:
            out = self.b.add(out, v)
        return out

    def mul(self, a, b):
        return self.b.mul(a, b)

    def vload(self, ptr, idx):
        return self.b.load(self.b.bitcast(self.b.gep(ptr, [idx]), self.vec.as_pointer()), align=4)

    def vstore(self, val, ptr, idx):
        self.b.store(val, self.b.bitcast(self.b.gep(ptr, [idx]), self.vec.as_pointer()), align=4)

    def splat(self, s):
        undef = ir.Constant(self.vec, ir.Undefined)
        one = self.b.insert_element(undef, s, ir.Constant(_I32, 0))
        return self.b.shuffle_vector(one, undef, ir.Constant(ir.VectorType(_I32, self.n), [0] * self.n))

    def fma(self, a, b, acc):
        return self.b.call(self.fma_fn, [a, b, acc])

    def zeros(self, count: int):
        zero = ir.Constant(self.vec, [0.0] * self.n)
        return [cgutils.alloca_once_value(self.b, zero) for _ in range(count)]


def _ints(context, builder, sig, args, first: int):
    """Integer arguments from position ``first`` on, as i64."""
    return [context.cast(builder, v, t, types.int64) for v, t in zip(args[first:], sig.args[first:])]


def _data(context, builder, ty, val):
    return context.make_array(ty)(context, builder, val).data


def _conv_tile(J: int, rows: int, KW: int = 0):  # noqa: N803 (compile-time constant)
    """Forward tile intrinsic: ``J`` output channels x ``rows`` position vectors (see module docstring);
    with ``KW`` > 0 the kernel's width is that constant and its taps are unrolled (the tap loop of a
    5-wide kernel otherwise costs a quarter of the kernel's time, of a 3-wide one a third)."""

    @intrinsic
    def tile(typingctx, x, w, y, bias, xo, xrs, xcs, xkd, xkh, xkw, wo, bo, yo, yms, yrs, jv, cg, kd, kh, kw):
        sig = types.void(x, w, y, bias, xo, xrs, xcs, xkd, xkh, xkw, wo, bo, yo, yms, yrs, jv, cg, kd, kh, kw)

        def codegen(context, builder, signature, args):
            g = _IR(builder, signature.args[0].dtype)
            xptr, wptr, yptr, bptr = (_data(context, builder, signature.args[i], args[i]) for i in range(4))
            xo, xrs, xcs, xkd, xkh, xkw, wo, bo, yo, yms, yrs, jv, cg, kd, kh, kw = _ints(
                context, builder, signature, args, 4)
            # the accumulators start from the bias (no pass over the output to add it afterwards)
            accs = [cgutils.alloca_once_value(builder, g.splat(builder.load(builder.gep(bptr, [g.add(bo, g.c(j))]))))
                    for j in range(J) for _ in range(rows)]
            taps = g.mul(kd, g.mul(kh, kw))
            with cgutils.for_range(builder, cg) as lc:
                xc = g.add(xo, g.mul(lc.index, xcs))
                tc = g.mul(lc.index, taps)
                with cgutils.for_range(builder, kd) as la:
                    xa = g.add(xc, g.mul(la.index, xkd))
                    ta = g.add(tc, g.mul(la.index, g.mul(kh, kw)))
                    with cgutils.for_range(builder, kh) as lh:
                        xh = g.add(xa, g.mul(lh.index, xkh))
                        th = g.add(ta, g.mul(lh.index, kw))
                        def tap(lw):
                            xw = g.add(xh, g.mul(lw, xkw))
                            wt = g.add(wo, g.mul(g.add(th, lw), g.c(J)))
                            xv = [g.vload(xptr, g.add(xw, g.mul(g.c(r), xrs))) for r in range(rows)]
                            for j in range(J):
                                s = g.splat(builder.load(builder.gep(wptr, [g.add(wt, g.c(j))])))
                                for r in range(rows):
                                    a = accs[j * rows + r]
                                    builder.store(g.fma(xv[r], s, builder.load(a)), a)

                        if KW:
                            for q in range(KW):
                                tap(g.c(q))
                        else:
                            with cgutils.for_range(builder, kw) as lw:
                                tap(lw.index)
            for j in range(J):
                with builder.if_then(builder.icmp_signed("<", g.c(j), jv), likely=True):
                    for r in range(rows):
                        idx = g.add(yo, g.mul(g.c(j), yms), g.mul(g.c(r), yrs))
                        g.vstore(builder.load(accs[j * rows + r]), yptr, idx)
            return context.get_dummy_value()

        return sig, codegen

    return tile


@nb.njit(inline="always", **_OPTS)
def unravel_task(t, ncol, nrow, od, nblk, group):  # pragma: no cover (compiled)
    """``(col, row, depth, block, group, image)`` of flat task ``t`` (column fastest)."""
    col = t % ncol
    r1 = t // ncol
    row = r1 % nrow
    r2 = r1 // nrow
    oz = r2 % od
    r3 = r2 // od
    b = r3 % nblk
    r4 = r3 // nblk
    return col, row, oz, b, r4 % group, r4 // group


def _variant(template, name: str, **tiles):
    """``template`` compiled as its own function ``name`` with ``tiles`` bound as its globals: one
    driver per tile shape, so a net compiles only the shapes it uses, and numba caches each under its
    own name."""
    fn = pytypes.FunctionType(template.__code__, {**template.__globals__, **tiles}, name)
    fn.__qualname__ = name
    fn.__doc__ = template.__doc__
    return nb.njit(**_OPTS)(fn)


_tile_full = _tile_one = None  # bound per variant (_variant)
_tile_rows = 1


def _forward_template(piece, pieces, xf, wf, yf, bf, n_img, group, cg, mg, jb, kd, kh, kw, xcs, xkd, xkh, xkw, xozs,
                      xrs, od, nrow, ncol, vl, yms, yozs, yrs, blocks_inner):  # pragma: no cover (compiled)
    """``y = conv(x, w)`` with tiles of ``jb`` output channels (see :func:`forward`)."""
    rows = _tile_rows
    nblk = (mg + jb - 1) // jb
    nrt = (nrow + rows - 1) // rows
    tasks = n_img * group * nblk * od * nrt * ncol
    taps = cg * kd * kh * kw
    for t in range(tasks * piece // pieces, tasks * (piece + 1) // pieces):
        if blocks_inner:
            col, b, oz, rt, g, n = unravel_task(t, ncol, nblk, od, nrt, group)
        else:
            col, rt, oz, b, g, n = unravel_task(t, ncol, nrt, od, nblk, group)
        r0 = rt * rows
        jv = min(jb, mg - b * jb)
        bo = (g * nblk + b) * jb
        wo = bo * taps
        xo = (n * group + g) * cg * xcs + oz * xozs + r0 * xrs + col * vl
        yo = ((n * group + g) * mg + b * jb) * yms + oz * yozs + r0 * yrs + col * vl
        if r0 + rows <= nrow:
            _tile_full(xf, wf, yf, bf, xo, xrs, xcs, xkd, xkh, xkw, wo, bo, yo, yms, yrs, jv, cg, kd, kh, kw)
        else:
            for r in range(nrow - r0):
                _tile_one(xf, wf, yf, bf, xo + r * xrs, xrs, xcs, xkd, xkh, xkw, wo, bo, yo + r * yrs, yms, yrs,
                          jv, cg, kd, kh, kw)


#: kernel widths with their own forward drivers (taps unrolled); other widths take the generic ones
UNROLLED_WIDTHS = tuple(range(1, 12))
FORWARD_DRIVERS: dict[tuple[int, int], Any] = {}  # (channels per tile, width or 0) -> compiled driver
_FORWARD_LOCK = threading.Lock()


def forward_driver(jb: int, kw: int):
    """The forward driver for tiles of ``jb`` channels and kernels ``kw`` wide, made on first use (once,
    when a net's batch partitions ask for it at the same time)."""
    key = (jb, kw if kw in UNROLLED_WIDTHS else 0)
    fn = FORWARD_DRIVERS.get(key)
    if fn is None:
        with _FORWARD_LOCK:
            fn = FORWARD_DRIVERS.get(key)
            if fn is None:
                rows = FORWARD_ROWS[jb]
                fn = FORWARD_DRIVERS[key] = _variant(_forward_template, f"forward_j{jb}_k{key[1]}",
                                              _tile_full=_conv_tile(jb, rows, key[1]),
                                              _tile_one=_conv_tile(jb, 1, key[1]), _tile_rows=rows)
    return fn


#: an image's input bytes (per group) above which the forward tiles loop over channel blocks innermost
BAND_BYTES = 256 * 1024


def forward(xf, wf, yf, bf, n_img, group, cg, mg, jb, kd, kh, kw, xcs, xkd, xkh, xkw, xozs, xrs,
            od, nrow, ncol, vl, yms, yozs, yrs) -> None:
    """``y = conv(x, w) + b`` over flat arrays: ``nrow`` rows x ``ncol`` vectors of ``vl`` positions per
    output depth slice; strides in elements (``x*``: input channel/tap/depth/row, ``y*``: output);
    ``jb`` output channels per tile (``wf`` from :func:`blocked_weights` and ``bf`` from
    :func:`blocked_bias` with the same ``jb``).

    Tiles sweep an image's positions once per channel block, re-reading its input each time; when one
    image's input outgrows the cache level closest to the cores (:data:`BAND_BYTES`) and the group's
    weights (large images, few channels: CaffeNet's conv1 over its stride phases, 3-D volumes), they
    take every channel block of a band of rows before the next band instead, re-reading the weights
    (conv1's phases: 85 -> 98 GFLOPS on a 2-core Zen 3; on small inputs that order is up to 13% slower)."""
    image = cg * xcs * xf.itemsize
    blocks_inner = image > BAND_BYTES and cg * xcs > mg * cg * kd * kh * kw
    launch(forward_driver(jb, kw), xf, wf, yf, bf, n_img, group, cg, mg, jb, kd, kh, kw, xcs, xkd, xkh, xkw, xozs,
           xrs, od, nrow, ncol, vl, yms, yozs, yrs, blocks_inner)


def blocked_bias(b: np.ndarray | None, m: int, group: int, jb: int, dtype: np.dtype) -> np.ndarray:
    """The bias (``(M,)``, or None: zeros) as ``(G, NB * jb)``, zero channels up to whole blocks."""
    mg = m // group
    out = np.zeros((group, -(-mg // jb) * jb), dtype=dtype)
    if b is not None:
        out[:, :mg] = b.reshape(group, mg)
    return out


def blocked_weights(w: np.ndarray, group: int, jb: int) -> np.ndarray:
    """``(M, Cg, KD, KH, KW)`` -> ``(G, NB, Cg, KD, KH, KW, jb)``, zero channels up to whole blocks."""
    m = w.shape[0]
    mg = m // group
    nblk = -(-mg // jb)
    out = np.zeros((group, nblk * jb) + w.shape[1:], dtype=w.dtype)
    out[:, :mg] = w.reshape((group, mg) + w.shape[1:])
    out = out.reshape((group, nblk, jb) + w.shape[1:])
    return np.ascontiguousarray(np.moveaxis(out, 2, -1))


def _wgrad_tile(mv: int, ci: int, cols: int):
    """Weight-gradient tile intrinsic: ``mv`` vectors of output channels x ``ci`` input channels x
    ``cols`` kernel columns, summed over ``nimg`` images' output positions (see module docstring)."""

    @intrinsic
    def tile(typingctx, dyt, x, part, dyo, dyps, dyrs, dyns, xo, xcs, xrs, xcol, xkw, xns, nimg, nrow, ncol, cv,
             po, pcs):
        sig = types.void(dyt, x, part, dyo, dyps, dyrs, dyns, xo, xcs, xrs, xcol, xkw, xns, nimg, nrow, ncol, cv,
                         po, pcs)

        def codegen(context, builder, signature, args):
            g = _IR(builder, signature.args[0].dtype)
            dptr, xptr, pptr = (_data(context, builder, signature.args[i], args[i]) for i in range(3))
            (dyo, dyps, dyrs, dyns, xo, xcs, xrs, xcol, xkw, xns, nimg, nrow, ncol, cv, po,
             pcs) = _ints(context, builder, signature, args, 3)
            accs = g.zeros(mv * ci * cols)
            last = builder.sub(cv, g.c(1))
            # channels past the block's end read the last valid one (their sums are not stored)
            xch = [g.mul(builder.select(builder.icmp_signed("<", g.c(c), cv), g.c(c), last), xcs) for c in range(ci)]
            with cgutils.for_range(builder, nimg) as li:
                d_i = g.add(dyo, g.mul(li.index, dyns))
                x_i = g.add(xo, g.mul(li.index, xns))
                with cgutils.for_range(builder, nrow) as lr:
                    d_r = g.add(d_i, g.mul(lr.index, dyrs))
                    x_r = g.add(x_i, g.mul(lr.index, xrs))
                    with cgutils.for_range(builder, ncol) as lc:
                        d_p = g.add(d_r, g.mul(lc.index, dyps))
                        x_p = g.add(x_r, g.mul(lc.index, xcol))
                        dv = [g.vload(dptr, g.add(d_p, g.c(v * g.n))) for v in range(mv)]
                        for c in range(ci):
                            for t in range(cols):
                                s = g.splat(builder.load(builder.gep(xptr, [g.add(x_p, xch[c], g.mul(g.c(t), xkw))])))
                                for v in range(mv):
                                    a = accs[(c * cols + t) * mv + v]
                                    builder.store(g.fma(dv[v], s, builder.load(a)), a)
            for c in range(ci):
                with builder.if_then(builder.icmp_signed("<", g.c(c), cv), likely=True):
                    for t in range(cols):
                        for v in range(mv):
                            idx = g.add(po, g.mul(g.c(c), pcs), g.c((t * mv + v) * g.n))
                            g.vstore(builder.fadd(g.vload(pptr, idx), builder.load(accs[(c * cols + t) * mv + v])),
                                     pptr, idx)
            return context.get_dummy_value()

        return sig, codegen

    return tile


#: input channels per weight-gradient tile, by its kernel columns (2 x ci x cols accumulators)
WGRAD_CHANNELS = simd_tiles.wgrad_channels(VECTOR_BYTES)
WGRAD_COLUMNS = simd_tiles.WGRAD_COLUMNS
WGRAD_VECTORS = simd_tiles.WGRAD_VECTORS  # output-channel vectors per weight-gradient tile
#: images one weight-gradient tile sums before it adds into its chunk's partial gradient
IMAGE_BLOCK = 8
_wgrad_tile_fn = None  # bound per variant (_variant)


def _weight_grad_template(piece, pieces, dyt, xf, part, n_img, group, cg, mgp, kd, kh, kw, k0, ci, od, oh, ow, xcs,
                          xdep, xrow, sz, sy, sx, dd, dh, dw):  # pragma: no cover (compiled)
    """Kernel columns from ``k0`` of the weight gradient in tiles of ``ci`` input channels (see
    :func:`weight_grad`)."""
    chunks = part.shape[0]
    mb = part.shape[-1]
    nbm = mgp // mb
    dyps = mb
    dyrs = ow * dyps
    dyblk = od * oh * dyrs
    dyns = group * nbm * dyblk
    xns = group * cg * xcs
    pcs = kd * kh * kw * mb
    for ch in range(chunks * piece // pieces, chunks * (piece + 1) // pieces):
        c0 = ch * n_img // chunks
        c1 = (ch + 1) * n_img // chunks
        for n0 in range(c0, c1, IMAGE_BLOCK):
            ni = min(IMAGE_BLOCK, c1 - n0)
            for g in range(group):
                for b in range(nbm):
                    for cb in range(0, cg, ci):
                        cv = min(ci, cg - cb)
                        for a in range(kd):
                            for e in range(kh):
                                po = ((((((ch * group + g) * nbm + b) * cg + cb) * kd + a) * kh + e) * kw + k0) * mb
                                xb = ((n0 * group + g) * cg + cb) * xcs + a * dd * xdep + e * dh * xrow + k0 * dw
                                for oz in range(od):
                                    dyo = n0 * dyns + (g * nbm + b) * dyblk + oz * oh * dyrs
                                    _wgrad_tile_fn(dyt, xf, part, dyo, dyps, dyrs, dyns, xb + oz * sz * xdep, xcs,
                                                   sy * xrow, sx, dw, xns, ni, oh, ow, cv, po, pcs)


_WEIGHT_GRAD = {t: _variant(_weight_grad_template, f"weight_grad_c{t}",
                            _wgrad_tile_fn=_wgrad_tile(WGRAD_VECTORS, WGRAD_CHANNELS[t], t))
                for t in range(1, WGRAD_COLUMNS + 1)}


def weight_grad(dyt, xf, part, n_img, group, cg, mgp, kd, kh, kw, od, oh, ow, xcs, xdep, xrow, sz, sy, sx,
                dd, dh, dw) -> None:
    """Partial ``dL/dw`` per chunk of images into ``part`` ``(chunks, G, NB, Cg, KD, KH, KW, MB)``
    (zeroed by the caller; ``MB = WGRAD_VECTORS * lanes`` output channels per block); the kernel's
    columns in tiles of at most :data:`WGRAD_COLUMNS`.

    ``dyt`` is the output gradient position-major per block of ``MB`` channels, ``(N, G, NB, OD, OH,
    OW, MB)`` with ``NB * MB = mgp`` a whole number of blocks (zero past the group's channels); ``xf``
    the padded input ``(N, C, xcs)`` with depth-slice and row strides ``xdep`` and ``xrow``."""
    tiles = -(-kw // WGRAD_COLUMNS)
    for q in range(tiles):
        k0 = q * kw // tiles
        cols = (q + 1) * kw // tiles - k0
        launch(_WEIGHT_GRAD[cols], dyt, xf, part, n_img, group, cg, mgp, kd, kh, kw, k0, WGRAD_CHANNELS[cols], od, oh,
               ow, xcs, xdep, xrow, sz, sy, sx, dd, dh, dw)


@nb.njit(**_OPTS)
def _position_major(piece, pieces, dy, out, group):  # pragma: no cover (compiled)
    """``out[n, g, b, p, j] = dy[n, g * mg + b * MB + j, p]`` for ``dy`` ``(N, M, P)``, ``out``
    ``(N, G, NB, P, MB)`` (zeroed past ``mg`` by the caller): each block's positions contiguous."""
    n_img, m_all, npos = dy.shape
    mg = m_all // group
    mb = out.shape[4]
    for t in range(n_img * m_all * piece // pieces, n_img * m_all * (piece + 1) // pieces):
        n = t // m_all
        m = t % m_all
        g = m // mg
        j = m - g * mg
        b = j // mb
        jj = j - b * mb
        for p in range(npos):
            out[n, g, b, p, jj] = dy[n, m, p]


@nb.njit(**_OPTS)
def _phase_split(piece, pieces, x, out, pd, ph, pw):  # pragma: no cover (compiled)
    """``out[n, c, rd, rh, rw, i, j, k] = x[n, c, i*sd + rd - pd, j*sh + rh - ph, k*sw + rw - pw]`` for
    ``x`` ``(N, C, D, H, W)`` and a zeroed ``out`` ``(N, C, sd, sh, sw, ED, EH, EW)`` (the positions
    outside ``x`` keep their zeros): one pass over the input rows."""
    n_img, chans, dd, hh, ww = x.shape
    sd, sh, sw, ed, eh, ew = out.shape[2], out.shape[3], out.shape[4], out.shape[5], out.shape[6], out.shape[7]
    for t in range(n_img * chans * piece // pieces, n_img * chans * (piece + 1) // pieces):
        n = t // chans
        c = t % chans
        for z in range(dd):
            i, rd = divmod(z + pd, sd)
            if i >= ed:
                continue
            for y in range(hh):
                j, rh = divmod(y + ph, sh)
                if j >= eh:
                    continue
                src = x[n, c, z, y]
                for rw in range(sw):
                    dst = out[n, c, rd, rh, rw, i, j]
                    k0 = max(0, (pw - rw + sw - 1) // sw)  # first k with k*sw + rw - pw >= 0
                    k1 = min(ew, (ww - 1 + pw - rw) // sw + 1)
                    for k in range(k0, k1):
                        dst[k] = src[k * sw + rw - pw]


@nb.njit(**_OPTS)
def _phase_merge(piece, pieces, src, x, pd, ph, pw):  # pragma: no cover (compiled)
    """Inverse of :func:`phase_split` on the input's own elements: ``x[n, c, z, y, v] =
    src[n, c, rd, rh, rw, i, j, k]`` with ``z + pd = i*sd + rd`` (and likewise per axis), and zero
    where ``(i, j, k)`` lies past the planes' extent (input positions that no window reaches when
    the stride does not tile the padded input)."""
    n_img, chans, dd, hh, ww = x.shape
    sd, sh, sw, ed, eh, ew = src.shape[2], src.shape[3], src.shape[4], src.shape[5], src.shape[6], src.shape[7]
    for t in range(n_img * chans * piece // pieces, n_img * chans * (piece + 1) // pieces):
        n = t // chans
        c = t % chans
        for z in range(dd):
            i, rd = divmod(z + pd, sd)
            for y in range(hh):
                j, rh = divmod(y + ph, sh)
                dst = x[n, c, z, y]
                reached = min(ww, ew * sw - pw) if i < ed and j < eh else 0  # columns some window reads
                for v in range(reached):
                    k, rw = divmod(v + pw, sw)
                    dst[v] = src[n, c, rd, rh, rw, i, j, k]
                for v in range(max(reached, 0), ww):
                    dst[v] = 0


@nb.njit(**_OPTS)
def _gather_output(piece, pieces, yb, out, width):  # pragma: no cover (compiled)
    """``out[n, m, z, y, x] = yb[n, m, z, y * width + x]``: the valid positions of a forward buffer
    (``yb`` ``(N, M, OD, y_plane)``, ``out`` ``(N, M, OD, OH, OW)``)."""
    n_img, m_all, od, oh, ow = out.shape
    for t in range(n_img * m_all * piece // pieces, n_img * m_all * (piece + 1) // pieces):
        n = t // m_all
        m = t % m_all
        for z in range(od):
            src = yb[n, m, z]
            for y in range(oh):
                dst = out[n, m, z, y]
                for x in range(ow):
                    dst[x] = src[y * width + x]


@nb.njit(**_OPTS)
def _copy_into(piece, pieces, src, dst, z0, y0, x0):  # pragma: no cover (compiled)
    """``dst[n, c, z0 + i, y0 + j, x0 + k] = src[n, c, i, j, k]`` (``dst`` 5-D, larger): a region
    copied into a padded buffer, in parallel over images and channels."""
    n_img, chans, dd, hh, ww = src.shape
    for t in range(n_img * chans * piece // pieces, n_img * chans * (piece + 1) // pieces):
        n = t // chans
        c = t % chans
        for i in range(dd):
            for j in range(hh):
                s = src[n, c, i, j]
                d = dst[n, c, z0 + i, y0 + j]
                for k in range(ww):
                    d[x0 + k] = s[k]


def position_major(dy: np.ndarray, out: np.ndarray, group: int) -> None:
    """:func:`_position_major` in pieces over (image, output channel)."""
    launch(_position_major, dy, out, group)


def phase_split(x: np.ndarray, out: np.ndarray, pd: int, ph: int, pw: int) -> None:
    """:func:`_phase_split` in pieces over (image, channel)."""
    launch(_phase_split, x, out, pd, ph, pw)


def phase_merge(src: np.ndarray, x: np.ndarray, pd: int, ph: int, pw: int) -> None:
    """:func:`_phase_merge` in pieces over (image, channel)."""
    launch(_phase_merge, src, x, pd, ph, pw)


def gather_output(yb: np.ndarray, out: np.ndarray, width: int) -> None:
    """:func:`_gather_output` in pieces over (image, output channel)."""
    launch(_gather_output, yb, out, width)


def copy_into(src: np.ndarray, dst: np.ndarray, z0: int, y0: int, x0: int) -> None:
    """:func:`_copy_into` in pieces over (image, channel)."""
    launch(_copy_into, src, dst, z0, y0, x0)
