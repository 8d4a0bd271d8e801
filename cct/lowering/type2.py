"""CcT lowering Type 2 ("balanced") and the partial-lowering machinery Type 3 shares.

The CcT paper (section 2.1, Figure 6) groups the convolution sum three ways. All three are one
scheme here: choose a subset of the spatial axes to *lower* (replicate the input along them, as
im2col does) and *lift* the others (sum shifted slices of the GEMM result):

* Type 1: lower every spatial axis (im2col; lifting is a reshape) -- see ``type1.py``.
* Type 2: lower the last spatial axis (width) only: lowered data ``(C/g * kw, N * H' * OW)``,
  kernel ``(M/g * kh, C/g * kw)``, GEMM result ``(M/g * kh, N * H' * OW)``, lifting sums ``kh``
  row-shifted slices. (The paper's ``(kd, mn)`` / ``(ok, kd)`` matrices.)
* Type 3: lower nothing: lowered data is the padded input ``(C/g, N * H' * W')``, kernel
  ``(M/g * kh * kw, C/g)``, lifting sums ``kh * kw`` shifted slices (paper's ``(d, n^2)``).

``H'``/``W'`` are the padded extents the windows touch: ``(out - 1) * stride + (k - 1) *
dilation + 1``. Lifted axes compute the GEMM at every input position, so a stride ``s`` on a
lifted axis wastes a factor ``s`` of GEMM work (the cost model charges it); padding, dilation,
rectangular kernels, groups and any number of spatial axes are supported exactly.

Layout: the lowered data is channel-major ``(C, *k_low, N, *spatial)`` so each group's GEMM
covers the whole batch in one call (the CcT batching of section 2.2); batch partitions
(``b_p`` < N) are handled by :mod:`cct.lowering.partition`, which calls these methods on
slices of the batch.
"""
from __future__ import annotations

import itertools
import math
from typing import Any

from .. import blas
from ..device.driver import array_module
from .base import LoweringStrategy, register_strategy
from .gemm_ops import GemmLoweringOps
from .geometry import ConvGeometry


class PartialLowering(GemmLoweringOps, LoweringStrategy):
    """Lower the spatial axes in ``lowered_axes(geom)``, lift the others (see module doc)."""

    name = "partial"

    def supports(self, geom: ConvGeometry) -> bool:
        """Whether this lowering can compute ``geom`` (any N-d conv with >= 1 spatial axis)."""
        return geom.num_spatial >= 1

    def plan(self, geom: ConvGeometry, batch: int) -> dict:
        """Matrix shapes of this lowering for ``batch`` images (per group), from :class:`LoweringShape`."""
        t = self.shape(geom, batch)
        f = t.figure6()
        return {"k_low": t.k_low, "k_lift": t.k_lift, "cols": t.cols, "data": f["lowered_data"],
                "kernel": f["lowered_kernel"], "result": f["gemm_output"], "padded": t.C * t.E}

    # -- helpers -----------------------------------------------------------------------------
    def _layout(self, geom: ConvGeometry):
        nd = geom.num_spatial
        low = tuple(sorted(set(self.lowered_axes(geom))))
        lift = tuple(i for i in range(nd) if i not in low)
        return nd, low, lift, geom.used_extent

    def _padded_input(self, x: Any, geom: ConvGeometry, ext) -> Any:
        """``(C, N, *ext)``: x transposed channel-major, zero-padded, cropped to the used extent."""
        xp = array_module(x)
        n = x.shape[0]
        nd = geom.num_spatial
        xt = x.transpose((1, 0) + tuple(range(2, 2 + nd)))
        dst, src = geom.interior(ext)
        full = all(d.start == 0 and d.stop == e for d, e in zip(dst, ext))  # no padding inside ext
        buf = (xp.empty if full else xp.zeros)((geom.channels_in, n) + tuple(ext), dtype=x.dtype)
        buf[(slice(None), slice(None)) + dst] = xt[(slice(None), slice(None)) + src]
        return buf

    def _lower(self, xpad: Any, geom: ConvGeometry) -> Any:
        """Lowered data ``(C, *k_low, N, *cols)`` from the padded input ``(C, N, *ext)``."""
        nd, low, lift, ext = self._layout(geom)
        if not low:
            return xpad
        xp = array_module(xpad)
        k_low = tuple(geom.kernel[i] for i in low)
        spatial = tuple(geom.out_shape[i] if i in low else ext[i] for i in range(nd))
        d = xp.empty((xpad.shape[0],) + k_low + (xpad.shape[1],) + spatial, dtype=xpad.dtype)
        for offs in itertools.product(*(range(k) for k in k_low)):
            sl = [slice(None)] * nd
            for ax, o in zip(low, offs):
                sl[ax] = _win(o, geom.stride[ax], geom.dilation[ax], geom.out_shape[ax])
            d[(slice(None),) + offs] = xpad[(slice(None), slice(None)) + tuple(sl)]
        return d

    def _unlower(self, dd: Any, geom: ConvGeometry, n: int) -> Any:
        """Adjoint of :meth:`_lower`: ``(C, *k_low, N, *cols)`` -> padded ``(C, N, *ext)``."""
        nd, low, lift, ext = self._layout(geom)
        if not low:
            return dd
        xp = array_module(dd)
        k_low = tuple(geom.kernel[i] for i in low)
        acc = xp.zeros((dd.shape[0], n) + tuple(ext), dtype=dd.dtype)
        for offs in itertools.product(*(range(k) for k in k_low)):
            sl = [slice(None)] * nd
            for ax, o in zip(low, offs):
                sl[ax] = _win(o, geom.stride[ax], geom.dilation[ax], geom.out_shape[ax])
            acc[(slice(None), slice(None)) + tuple(sl)] += dd[(slice(None),) + offs]
        return acc

    def _lift_windows(self, geom: ConvGeometry):
        """(offsets over the lifted kernel axes, spatial slices into the GEMM result)."""
        nd, low, lift, ext = self._layout(geom)
        k_lift = tuple(geom.kernel[i] for i in lift)
        for offs in itertools.product(*(range(k) for k in k_lift)):
            sl = [slice(None)] * nd
            for ax, o in zip(lift, offs):
                sl[ax] = _win(o, geom.stride[ax], geom.dilation[ax], geom.out_shape[ax])
            yield offs, tuple(sl)

    def _kernel_matrix(self, wg: Any, geom: ConvGeometry) -> Any:
        """``(Mg * k_lift, Cg * k_low)`` from the group's weights ``(Mg, Cg, *kernel)``."""
        nd, low, lift, _ = self._layout(geom)
        mg = wg.shape[0]
        perm = (0,) + tuple(2 + i for i in lift) + (1,) + tuple(2 + i for i in low)
        return wg.transpose(perm).reshape(mg * math.prod(geom.kernel[i] for i in lift), -1)

    def _kernel_from_matrix(self, km: Any, geom: ConvGeometry) -> Any:
        """Inverse of :meth:`_kernel_matrix`: back to ``(Mg, Cg, *kernel)``."""
        nd, low, lift, _ = self._layout(geom)
        mg = geom.channels_out // geom.group
        cg = geom.channels_in // geom.group
        shaped = km.reshape((mg,) + tuple(geom.kernel[i] for i in lift) + (cg,) + tuple(geom.kernel[i] for i in low))
        # axes of `shaped`: 0 = m, 1..len(lift) = lifted k, then c, then lowered k
        pos = {}
        for j, ax in enumerate(lift):
            pos[ax] = 1 + j
        for j, ax in enumerate(low):
            pos[ax] = 2 + len(lift) + j
        perm = (0, 1 + len(lift)) + tuple(pos[i] for i in range(nd))
        return shaped.transpose(perm)

    def _scatter_dy(self, dyg: Any, geom: ConvGeometry, n: int) -> Any:
        """Adjoint of the lifting for one group: ``(Mg, N, *out)`` -> ``(Mg, *k_lift, N, *cols)``."""
        nd, low, lift, ext = self._layout(geom)
        xp = array_module(dyg)
        k_lift = tuple(geom.kernel[i] for i in lift)
        spatial = tuple(geom.out_shape[i] if i in low else ext[i] for i in range(nd))
        if not lift:
            return dyg  # already (Mg, N, *out)
        rb = xp.zeros((dyg.shape[0],) + k_lift + (n,) + spatial, dtype=dyg.dtype)
        for offs, sl in self._lift_windows(geom):
            rb[(slice(None),) + offs + (slice(None),) + sl] = dyg
        return rb

    # -- the three passes -------------------------------------------------------------------
    def forward(self, x: Any, w: Any, b: Any, geom: ConvGeometry) -> Any:
        """``y = conv(x, w) + b`` for the whole batch (one GEMM per group)."""
        return self.forward_into(x, w, b, geom, None)

    def forward_into(self, x: Any, w: Any, b: Any, geom: ConvGeometry, out: Any) -> Any:
        """:meth:`forward` written into ``out`` ``(N, M, *out)`` (a new array if None); returns it."""
        xp = array_module(x)
        n = x.shape[0]
        nd, low, lift, ext = self._layout(geom)
        g, cg, mg = geom.group, geom.channels_in // geom.group, geom.channels_out // geom.group
        shape = (n, geom.channels_out) + tuple(geom.out_shape)
        empty = math.prod(shape) == 0 or x.size == 0
        if out is None:
            y = (xp.zeros if empty else xp.empty)(shape, dtype=x.dtype)  # the lifting writes every element
        else:
            y = out
            if empty:
                y[...] = 0
        if empty:
            if b is not None and y.size:
                y += b.reshape((1, -1) + (1,) * nd)
            return y
        d = self._lower(self._padded_input(x, geom, ext), geom)
        yt = y.transpose((1, 0) + tuple(range(2, 2 + nd)))
        k_lift = tuple(geom.kernel[i] for i in lift)
        cols_shape = (n,) + tuple(geom.out_shape[i] if i in low else ext[i] for i in range(nd))
        for gi in range(g):
            km = self._kernel_matrix(w[gi * mg:(gi + 1) * mg], geom)
            dg = d[gi * cg:(gi + 1) * cg].reshape(km.shape[1], -1)
            ytg = yt[gi * mg:(gi + 1) * mg]
            bg = None if b is None else b[gi * mg:(gi + 1) * mg].reshape((mg,) + (1,) * (nd + 1))
            if not lift:  # everything lowered (Type 1 layout): the lifting is a copy
                res = blas.gemm(km, dg).reshape(ytg.shape)
                if bg is None:
                    ytg[...] = res
                else:
                    xp.add(res, bg, out=ytg)
                continue
            r = blas.gemm(km, dg).reshape((mg,) + k_lift + cols_shape)
            first = True
            for offs, sl in self._lift_windows(geom):
                part = r[(slice(None),) + offs + (slice(None),) + sl]
                if first:  # the first shifted slice initializes the output (with the bias fused in)
                    if bg is None:
                        ytg[...] = part
                    else:
                        xp.add(part, bg, out=ytg)
                    first = False
                else:
                    ytg += part
        return y

    def backward_data(self, dy: Any, w: Any, geom: ConvGeometry) -> Any:
        """Gradient w.r.t. the input: adjoint lifting, transposed GEMM, adjoint lowering."""
        xp = array_module(dy)
        n = dy.shape[0]
        nd, low, lift, ext = self._layout(geom)
        g, cg, mg = geom.group, geom.channels_in // geom.group, geom.channels_out // geom.group
        dst, src = geom.interior(ext)
        covered = all(sl.start == 0 and sl.stop == i for sl, i in zip(src, geom.in_shape))
        shape = (n, geom.channels_in) + tuple(geom.in_shape)
        dx = (xp.empty if covered and dy.size else xp.zeros)(shape, dtype=dy.dtype)
        if dy.size == 0 or dx.size == 0:
            return dx
        dyt = dy.transpose((1, 0) + tuple(range(2, 2 + nd)))
        k_low = tuple(geom.kernel[i] for i in low)
        cols_shape = (n,) + tuple(geom.out_shape[i] if i in low else ext[i] for i in range(nd))
        dd = xp.empty((geom.channels_in,) + k_low + cols_shape, dtype=dy.dtype)
        for gi in range(g):
            km = self._kernel_matrix(w[gi * mg:(gi + 1) * mg], geom)
            rb = self._scatter_dy(dyt[gi * mg:(gi + 1) * mg], geom, n)
            rb2 = rb.reshape(km.shape[0], -1) if rb.flags.c_contiguous else xp.ascontiguousarray(rb).reshape(
                km.shape[0], -1)
            blas.gemm(km, rb2, trans_a=True, out=dd[gi * cg:(gi + 1) * cg].reshape(km.shape[1], -1))
        dpad = self._unlower(dd, geom, n)
        dxt = dx.transpose((1, 0) + tuple(range(2, 2 + nd)))
        dxt[(slice(None), slice(None)) + src] = dpad[(slice(None), slice(None)) + dst]
        return dx

    def backward_weights(self, dy: Any, x: Any, geom: ConvGeometry) -> tuple[Any, Any]:
        """``(dw, db)`` as fresh arrays: ``dK = scatter(dy) @ lowered(x)^T`` per group."""
        xp = array_module(dy)
        n = dy.shape[0]
        nd, low, lift, ext = self._layout(geom)
        g, cg, mg = geom.group, geom.channels_in // geom.group, geom.channels_out // geom.group
        dw = xp.zeros(geom.weight_shape, dtype=dy.dtype)
        db = None
        if geom.bias_term:
            db = dy.sum(axis=(0,) + tuple(range(2, 2 + nd))) if dy.size else xp.zeros(geom.channels_out, dy.dtype)
        if dy.size == 0 or x.size == 0:
            return dw, db
        d = self._lower(self._padded_input(x, geom, ext), geom)
        dyt = dy.transpose((1, 0) + tuple(range(2, 2 + nd)))
        k_lift = math.prod(geom.kernel[i] for i in lift)
        k_low = math.prod(geom.kernel[i] for i in low)
        for gi in range(g):
            rb = self._scatter_dy(dyt[gi * mg:(gi + 1) * mg], geom, n)
            rb2 = rb.reshape(mg * k_lift, -1) if rb.flags.c_contiguous else xp.ascontiguousarray(rb).reshape(
                mg * k_lift, -1)
            dg = d[gi * cg:(gi + 1) * cg].reshape(cg * k_low, -1)
            km = blas.gemm(rb2, dg, trans_b=True)
            dw[gi * mg:(gi + 1) * mg] = self._kernel_from_matrix(km, geom)
        return dw, db


class Type2Lowering(PartialLowering):
    """CcT Type 2 ("balanced"): lower along the last spatial axis, lift along the others."""

    name = "type2"

    def lowered_axes(self, geom: ConvGeometry) -> tuple[int, ...]:
        """The last spatial axis -- unless its kernel and stride are 1: lowering it would copy the input
        unchanged, and lifting it is the same GEMM without the copy (type 3)."""
        last = geom.num_spatial - 1
        return (last,) if geom.num_spatial and (geom.kernel[last], geom.stride[last]) != (1, 1) else ()


def _win(offset: int, stride: int, dilation: int, out: int) -> slice:
    start = offset * dilation
    return slice(start, start + (out - 1) * stride + 1, stride)


register_strategy("type2", Type2Lowering)
