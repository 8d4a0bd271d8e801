"""Direct convolution (ZNNi IV-A.1): no lowered matrix, the kernel taps applied in place.

For thin layers (few channels), 1x1 kernels, small outputs and, with the register-blocked kernels,
most small-image layers, the lowered matrix of a GEMM lowering costs more memory traffic than the
multiply-adds themselves. numpy float arrays with the kernels enabled run:

* :mod:`cct.kernels.conv_simd` -- LLVM vector micro-kernels whose accumulators stay in registers
  (near the SGEMM peak on cifar10_quick's layers): the forward pass over a padded copy of the
  input in one of :mod:`.direct_layout`'s buffer layouts; the data gradient as the forward pass of
  the transposed convolution (flipped, transposed weights on the padded output gradient); the
  weight gradient from the output gradient made position-major. A strided layer runs as the
  unit-stride convolution over its stride phases (:func:`.direct_layout.phase_geometry`).
* :mod:`cct.kernels.direct` -- the plain kernels, for the passes the register-blocked ones cannot
  run (strided and dilated layers; a padding wider than the kernel's reach in the data gradient).

1-, 2- and 3-D convolutions with groups, stride, padding and dilation. Other arrays (cupy, or
``CCT_KERNELS=numpy``) take the array-module path below, one batched contraction per kernel tap.

Operations declared to the cost model (:meth:`DirectConvolution.pass_ops`): the buffer copies
(``copy``/``zero`` sweeps) and ``("direct", multiply_adds)`` counting the positions and channels
the tiles compute and drop, priced with the calibrated kernel rate; workspace: the buffers.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import kernels
from ..device.driver import array_module, host_kernels_usable
from . import direct_layout as dl
from .base import LoweringStrategy, register_strategy
from .gemm_ops import PASSES
from .geometry import ConvGeometry

_as3 = dl.as3


pad_input = dl.pad_input


def _to3(a: Any, nd: int) -> Any:
    """View ``(N, C, *spatial)`` with exactly three spatial axes (leading unit axes added)."""
    return a.reshape(a.shape[:2] + (1,) * (3 - nd) + a.shape[2:])


def _taps(geom: ConvGeometry):
    """``(kernel offset, slices into the padded input)`` per kernel tap."""
    for k in itertools.product(*(range(v) for v in geom.kernel)):
        yield k, tuple(slice(o * d, o * d + (n - 1) * s + 1, s)
                       for o, d, n, s in zip(k, geom.dilation, geom.out_shape, geom.stride))


class DirectConvolution(LoweringStrategy):
    """Direct convolution (see module docstring)."""

    name = "direct"

    def __init__(self) -> None:
        self._scratch = dl.Scratch()

    def share_scratch(self, scratch: dl.SharedScratch) -> None:
        """Take the reused buffers from ``scratch``, shared with other convolutions that never run at the same
        time (dense inference's layers), instead of keeping this layer's own."""
        self._scratch = scratch

    def supports(self, geom: ConvGeometry) -> bool:
        """1-, 2- and 3-D convolutions with a non-empty output."""
        return 1 <= geom.num_spatial <= 3 and geom.out_size > 0

    # -- the three passes -------------------------------------------------------------------
    def forward(self, x: Any, w: Any, b: Any, geom: ConvGeometry) -> Any:
        xp = array_module(x)
        y = xp.empty((x.shape[0], geom.channels_out) + tuple(geom.out_shape), dtype=x.dtype)
        return self.forward_into(x, w, b, geom, y)

    def forward_into(self, x: Any, w: Any, b: Any, geom: ConvGeometry, out: Any) -> Any:
        """``out[...] = conv(x, w) + b`` (the register-blocked kernel writes straight into a
        C-contiguous ``out`` whose layout has no dropped positions)."""
        xp = array_module(x)
        n, nd = x.shape[0], geom.num_spatial
        pgeom = self._phased(geom, x, w)
        if pgeom is not None:
            xph = dl.phase_input(x, geom, pgeom, self._simd_kernels(), self._scratch)
            return self.forward_into(xph, dl.phase_weights(w, geom, pgeom), b, pgeom, out)
        simd = self._simd(geom, x, w) if n and x.size else None
        if simd is not None:
            km, lay = simd
            wb = self._blocked_weights(km, w, geom, lay)
            yb = dl.run_forward(km, dl.padded_input(x, geom, lay, self._scratch, km), wb, geom, lay, out, self._scratch,
                                b)
            if yb is not None:  # one parallel pass: the valid positions (the kernel added the bias)
                dl.finish_output(km, yb, out, geom, lay)
            return out
        if n and x.size:
            y = xp.zeros((n, geom.channels_out) + tuple(geom.out_shape), dtype=x.dtype)
            xpad = pad_input(x, geom)
            km = self._kernels(xpad, w, y)
            if km is not None:
                s, d = _as3(geom.stride, 1), _as3(geom.dilation, 1)
                w3 = w.reshape(w.shape[:2] + (1,) * (3 - nd) + w.shape[2:])
                km.forward(_to3(xpad, nd), km.blocked_weights(w3, geom.group), _to3(y, nd), geom.group, *s, *d)
            else:
                self._forward_xp(xpad, w, y, geom)
            out[...] = y
        else:
            out[...] = 0
        if b is not None:
            out += b.reshape((1, -1) + (1,) * nd)
        return out

    def backward_into(self, dy: Any, x: Any, w: Any, geom: ConvGeometry, dw: Any = None, db: Any = None,
                      dx: Any = None) -> None:
        """``dw += dL/dw``, ``db += dL/db``, ``dx[...] = dL/dx`` (each None to skip)."""
        pgeom = self._phased(geom, dy, w if w is not None else dy)
        if pgeom is not None:
            if dw is not None or db is not None:
                xph = dl.phase_input(x, geom, pgeom, self._simd_kernels(), self._scratch) if dw is not None else None
                dwp = None if dw is None else np.zeros(pgeom.weight_shape, dtype=dw.dtype)
                self.backward_into(dy, xph, None, pgeom, dw=dwp, db=db)
                if dw is not None:
                    dw += dl.unphase_weights(dwp, geom, pgeom).reshape(dw.shape)
            if dx is not None:
                dxp = self.backward_data(dy, dl.phase_weights(w, geom, pgeom), pgeom)  # unit stride
                dl.unphase_input_grad(dxp, geom, pgeom, dx, self._simd_kernels())
            return
        if dw is not None or db is not None:
            gw, gb = self.backward_weights(dy, x, geom) if dw is not None else (None, None)
            if dw is not None:
                dw += gw.reshape(dw.shape)
            if db is not None:
                db += gb if gb is not None else dy.reshape(dy.shape[:2] + (-1,)).sum(axis=(0, 2))
        if dx is not None:
            tgeom = dl.transposed_geometry(geom)
            if dy.shape[0] and dy.size and tgeom is not None and self._simd(tgeom, dy, w) is not None:
                self.forward_into(dy, dl.transposed_weights(w, geom), None, tgeom, dx)
            else:
                dx[...] = self._backward_data_plain(dy, w, geom)

    def backward_data(self, dy: Any, w: Any, geom: ConvGeometry) -> Any:
        xp = array_module(dy)
        dx = xp.empty((dy.shape[0], geom.channels_in) + tuple(geom.in_shape), dtype=dy.dtype)
        self.backward_into(dy, None, w, geom, dx=dx)
        return dx

    def _backward_data_plain(self, dy: Any, w: Any, geom: ConvGeometry) -> Any:
        """The data gradient by the plain kernels (or the array-module path)."""
        xp = array_module(dy)
        n, nd = dy.shape[0], geom.num_spatial
        dxp = xp.zeros((n, geom.channels_in) + tuple(geom.used_extent), dtype=dy.dtype)
        if n and dy.size:
            km = self._kernels(dy, w, dxp)
            if km is not None:
                s, d = _as3(geom.stride, 1), _as3(geom.dilation, 1)
                w3 = xp.ascontiguousarray(w.reshape(w.shape[:2] + (1,) * (3 - nd) + w.shape[2:]))
                km.backward_data(_to3(xp.ascontiguousarray(dy), nd), w3, _to3(dxp, nd), geom.group, *s, *d)
            else:
                self._backward_data_xp(dy, w, dxp, geom)
        dx = xp.zeros((n, geom.channels_in) + tuple(geom.in_shape), dtype=dy.dtype)
        dst, src = geom.interior()
        dx[(slice(None), slice(None)) + src] = dxp[(slice(None), slice(None)) + dst]
        return dx

    def backward_weights(self, dy: Any, x: Any, geom: ConvGeometry) -> tuple[Any, Any]:
        xp = array_module(dy)
        nd = geom.num_spatial
        db = dy.sum(axis=(0,) + tuple(range(2, 2 + nd))) if geom.bias_term else None
        if not (dy.shape[0] and dy.size):
            return xp.zeros(geom.weight_shape, dtype=dy.dtype), db
        pgeom = self._phased(geom, dy, x)
        if pgeom is not None:
            nobias = dataclasses.replace(pgeom, bias_term=False)
            xph = dl.phase_input(x, geom, pgeom, self._simd_kernels(), self._scratch)
            dwp, _ = self.backward_weights(dy, xph, nobias)
            return dl.unphase_weights(dwp, geom, pgeom), db
        km = self._kernels(dy, x) and kernels.get("conv_simd")
        if km:
            return dl.run_weight_grad(km, dy, x, geom, kernels.get_num_threads(), self._scratch), db
        dw = xp.zeros(geom.weight_shape, dtype=dy.dtype)
        xpad = pad_input(x, geom)
        km = self._kernels(dy, xpad, dw)
        if km is not None:
            s, d = _as3(geom.stride, 1), _as3(geom.dilation, 1)
            dw3 = dw.reshape(dw.shape[:2] + (1,) * (3 - nd) + dw.shape[2:])
            km.backward_weights(_to3(xp.ascontiguousarray(dy), nd), _to3(xpad, nd), dw3, geom.group, *s, *d)
        else:
            self._backward_weights_xp(dy, xpad, dw, geom)
        return dw, db

    def kernel_call(self, x: Any, w: Any, geom: ConvGeometry, pass_: str = "fwd") -> Callable[[], Any]:
        """A call of the forward (or ``"bwd_weights"``) multiply-add kernel alone on buffers prepared
        once (what ``("direct", multiply-adds)`` and ``"direct_wgrad"`` price; the whole numpy-path
        pass where the compiled kernels cannot run). The weight gradient uses ``x``'s output-shaped
        ones as its output gradient."""
        simd = self._simd(geom, x, w)
        if pass_ == "bwd_weights":
            dy = np.ones((x.shape[0], geom.channels_out) + tuple(geom.out_shape), dtype=x.dtype)
            if simd is None:
                return lambda: self.backward_weights(dy, x, geom)
            args = dl.weight_grad_buffers(simd[0], dy, x, geom, kernels.get_num_threads())
            return lambda: dl.run_weight_grad_kernel(simd[0], geom, *args)
        if simd is None:
            return lambda: self.forward(x, w, None, geom)
        km, lay = simd
        wb = self._blocked_weights(km, w, geom, lay)
        xb = dl.padded_input(x, geom, lay)
        yb = np.empty((x.shape[0], geom.channels_out) + tuple(geom.out_shape), dtype=x.dtype)
        return lambda: dl.run_forward(km, xb, wb, geom, lay, yb)

    @staticmethod
    def _blocked_weights(km: Any, w: Any, geom: ConvGeometry, lay: dl.SimdLayout) -> Any:
        """The weights in the forward kernel's block layout, for the tile the layout gets."""
        w3 = w.reshape(w.shape[:2] + (1,) * (3 - geom.num_spatial) + w.shape[2:])
        return km.blocked_weights(w3, geom.group, dl.forward_blocking(geom.channels_out // geom.group, lay.nrow)[0])

    def _phased(self, geom: ConvGeometry, *arrays: Any) -> ConvGeometry | None:
        """The stride-phase geometry (:func:`direct_layout.phase_geometry`) when ``geom`` is strided
        and the register-blocked kernels can run it, else None."""
        pgeom = dl.phase_geometry(geom)
        if pgeom is None or not arrays[0].shape[0] or self._simd(pgeom, *arrays) is None:
            return None
        return pgeom

    @staticmethod
    def _simd_kernels() -> Any:
        return kernels.get("conv_simd")

    @staticmethod
    def _simd(geom: ConvGeometry, *arrays: Any):
        """``(kernel module, layout)`` of the register-blocked forward kernel for ``geom``, or None."""
        if not host_kernels_usable(*arrays):
            return None
        km = kernels.get("conv_simd")
        if km is None:
            return None
        lay = dl.plan_layout(geom, km.lanes(arrays[0].dtype))
        return None if lay is None else (km, lay)

    # -- array-module path (cupy, or kernels off) ---------------------------------------------
    @staticmethod
    def _kernels(*arrays: Any):
        return kernels.get("direct") if host_kernels_usable(*arrays) else None

    @staticmethod
    def _forward_xp(xpad: Any, w: Any, y: Any, geom: ConvGeometry) -> None:
        xp = array_module(xpad)
        g, n = geom.group, xpad.shape[0]
        cg, mg = geom.channels_in // g, geom.channels_out // g
        yg = y.reshape((n, g, mg, geom.out_size))
        for k, sl in _taps(geom):
            win = xpad[(slice(None), slice(None)) + sl].reshape(n, g, cg, geom.out_size)
            wk = w[(slice(None), slice(None)) + k].reshape(g, mg, cg)
            yg += xp.einsum("gmc,ngcp->ngmp", wk, win)

    @staticmethod
    def _backward_data_xp(dy: Any, w: Any, dxp: Any, geom: ConvGeometry) -> None:
        xp = array_module(dy)
        g, n = geom.group, dy.shape[0]
        cg, mg = geom.channels_in // g, geom.channels_out // g
        dyg = dy.reshape(n, g, mg, geom.out_size)
        for k, sl in _taps(geom):
            wk = w[(slice(None), slice(None)) + k].reshape(g, mg, cg)
            contrib = xp.einsum("gmc,ngmp->ngcp", wk, dyg).reshape((n, geom.channels_in) + tuple(geom.out_shape))
            dxp[(slice(None), slice(None)) + sl] += contrib

    @staticmethod
    def _backward_weights_xp(dy: Any, xpad: Any, dw: Any, geom: ConvGeometry) -> None:
        xp = array_module(dy)
        g, n = geom.group, dy.shape[0]
        cg, mg = geom.channels_in // g, geom.channels_out // g
        dyg = dy.reshape(n, g, mg, geom.out_size)
        for k, sl in _taps(geom):
            win = xpad[(slice(None), slice(None)) + sl].reshape(n, g, cg, geom.out_size)
            dw[(slice(None), slice(None)) + k] += xp.einsum("ngmp,ngcp->gmc", dyg, win).reshape(
                geom.channels_out, cg)

    # -- what the cost model prices -------------------------------------------------------------
    def pass_ops(self, geom: ConvGeometry, batch: int, pass_: str) -> list[tuple]:
        """``copy``/``zero`` sweeps of the buffers and ``("direct", multiply-adds)``: the register-blocked
        kernels' work counts the positions and channels they compute and drop (layout and channel-block
        waste); a strided layer is priced as its stride-phase convolution plus the phase split; a pass
        only the fallback kernel runs (strided and dilated layers forward and data gradient, a padding
        wider than the kernel's reach for the data gradient) :data:`FALLBACK_SLOWDOWN` times its
        multiply-adds."""
        pgeom = dl.phase_geometry(geom)
        if pgeom is not None and pass_ in PASSES:  # the unit-stride convolution over the stride phases
            planes = batch * pgeom.channels_in * pgeom.in_size
            ops = self.pass_ops(pgeom, batch, pass_)
            return ops + [("copy", planes)]  # the phase split (or merge), into reused buffers
        macs = _macs(geom, batch)
        inp = batch * geom.channels_in * geom.in_size
        out = batch * geom.channels_out * geom.out_size
        if pass_ == "fwd":
            return self._forward_ops(geom, batch, macs)
        if pass_ == "bwd_data":
            tgeom = dl.transposed_geometry(geom)
            if tgeom is not None and dl.plan_layout(tgeom, dl.priced_lanes()) is not None:
                # the transposed forward computes every position of the padded input, the taps that
                # fall in its zero border included
                return self._forward_ops(tgeom, batch, _macs(tgeom, batch)) + [("copy", inp)]
            return [("zero", batch * geom.channels_in * math.prod(geom.used_extent)),
                    ("direct", macs * FALLBACK_SLOWDOWN), ("copy", inp)]
        if pass_ == "bwd_weights":
            g = geom.group
            mg, cg = geom.channels_out // g, geom.channels_in // g
            mb = 2 * dl.priced_lanes()
            ci = dl.wgrad_channels(geom.kernel[-1])
            waste = (-(-mg // mb) * mb / mg) * (-(-cg // ci) * ci / cg)
            padded = batch * geom.channels_in * math.prod(geom.used_extent)
            partials = 2 * math.prod(geom.weight_shape) * (-(-mg // mb) * mb / mg)  # two chunks' sums
            return [("copy", out), ("copy", min(inp, padded)), ("direct_wgrad", macs * waste), ("zero", partials),
                    ("add", partials), ("sum", out)]
        raise ValueError(f"unknown pass {pass_!r}")

    @staticmethod
    def _forward_ops(geom: ConvGeometry, batch: int, macs: int) -> list[tuple]:
        inp = batch * geom.channels_in * geom.in_size
        lay = dl.plan_layout(geom, dl.priced_lanes())
        if lay is None:
            return [("zero", batch * geom.channels_in * math.prod(geom.used_extent)), ("copy", inp),
                    ("direct", macs * FALLBACK_SLOWDOWN)]
        computed = macs / lay.efficiency * dl.forward_blocking(geom.channels_out // geom.group, lay.nrow)[1]
        ops = [("copy", inp), ("direct", computed, geom.kernel[-1])]  # the padded copy into a reused buffer
        if lay.drops_positions:  # one pass: the valid positions out of the buffer (the tiles add the bias)
            ops.append(("copy", batch * geom.channels_out * geom.out_size))
        return ops

    def workspace_bytes(self, geom: ConvGeometry, batch: int, itemsize: int = 4) -> int:
        """The largest pass's buffers: padded input and (for a layout with dropped positions) output
        buffer of the forward kernel, for the layer and for its data gradient's transposed
        convolution; the position-major gradient, padded input and two partial sums of the weight
        gradient."""
        pgeom = dl.phase_geometry(geom)
        if pgeom is not None:
            planes = batch * pgeom.channels_in * pgeom.in_size
            return int(itemsize * 2 * planes) + self.workspace_bytes(pgeom, batch, itemsize)
        lanes = 64 // itemsize
        weights = math.prod(geom.weight_shape)
        passes = []
        for g in (geom, dl.transposed_geometry(geom)):
            if g is None:
                continue
            lay = dl.plan_layout(g, lanes)
            if lay is None:
                passes.append(batch * g.channels_in * math.prod(g.used_extent))
            else:
                out = batch * g.channels_out * g.out_size / lay.efficiency if lay.efficiency < 1 else 0
                passes.append(batch * g.channels_in * lay.x_cs + out + weights)
        mb = 2 * lanes
        mg = geom.channels_out // geom.group
        dyt = batch * geom.out_size * geom.group * -(-mg // mb) * mb
        passes.append(dyt + batch * geom.channels_in * math.prod(geom.used_extent) + 2 * weights * mb / mg)
        return int(itemsize * max(passes))


def _macs(geom: ConvGeometry, batch: int) -> int:
    """Multiply-adds of a convolution over ``batch`` images (every output position, every tap)."""
    return batch * geom.channels_out * (geom.channels_in // geom.group) * geom.kernel_size * geom.out_size


#: slowdown of the fallback kernels (:mod:`cct.kernels.direct`) against the register-blocked ones,
#: measured on cifar10_quick's conv2 (Zen 5: 147 against 2.8 ms forward, 64 against 2.7 ms data
#: gradient); prices the passes only they can run so that the optimizer leaves them alone
FALLBACK_SLOWDOWN = 25.0


register_strategy("direct", DirectConvolution)
