"""Buffer layouts of the register-blocked direct kernels (:mod:`cct.kernels.conv_simd`).

The micro-kernels read whole vectors of ``lanes`` consecutive input elements per kernel tap, so
the input is copied once into a zero-padded buffer in one of two layouts:

* **rows** -- each output row is padded to a multiple of ``lanes`` (the input row to that plus the
  kernel's width); any vertical stride. Efficiency ``OW / OW_padded``.
* **flat** -- an output depth slice is the input's padded plane read as one long row (position
  ``oy * W + ox``), in whole vectors; the ``W - OW`` positions past each row's end are computed
  and dropped. Needs unit vertical stride. Efficiency ``OH * OW / (vectors * lanes)``.

:func:`plan_layout` picks the more efficient one (1-, 2- and 3-D, unit stride along the width);
the helpers build the padded input, the output buffer and the gradient buffer in that layout, and
call the kernels with the layout's strides.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..device.driver import HostDevice, Workspaces, array_module, module_device
from ..kernels import simd_tiles
from .geometry import ConvGeometry


def forward_tiles() -> dict[int, int]:
    """The forward tiles the kernels offer on this CPU: output channels -> position rows
    (:data:`cct.kernels.conv_simd.FORWARD_ROWS`)."""
    return simd_tiles.forward_rows(simd_tiles.host_vector_bytes())


def wgrad_table() -> dict[int, int]:
    """The weight-gradient tiles on this CPU: kernel columns -> input channels
    (:data:`cct.kernels.conv_simd.WGRAD_CHANNELS`)."""
    return simd_tiles.wgrad_channels(simd_tiles.host_vector_bytes())


def priced_lanes() -> int:
    """float32 elements per micro-kernel vector on this CPU (the dtype the optimizer plans for)."""
    return simd_tiles.host_vector_bytes() // 4


def wgrad_channels(kw: int, table: dict[int, int] | None = None) -> int:
    """Input channels per weight-gradient tile of a kernel ``kw`` wide (its widest column chunk), from
    ``table`` (default: this CPU's, :func:`wgrad_table`)."""
    table = table or wgrad_table()
    tiles = -(-kw // max(table))
    return table[-(-kw // tiles)]


def _tile_cycles(j: int, r: int) -> int:
    """Relative cost of one tap of a ``j x r`` tile: its multiply-adds, or its loads when those are more."""
    return max(j * r, j + r)


def forward_blocking(mg: int, nrow: int, tiles: dict[int, int] | None = None) -> tuple[int, float]:
    """``(output channels per tile, cost factor)`` for ``mg`` channels per group over ``nrow``
    position rows: the tile of ``tiles`` (default: this CPU's, :func:`forward_tiles`) with the fewest cycles
    (whole tiles, then single-row tails), and those cycles over ``mg * nrow`` (1.0: no waste)."""
    best = None
    for j, r in (tiles or forward_tiles()).items():
        cycles = -(-mg // j) * ((nrow // r) * _tile_cycles(j, r) + (nrow % r) * _tile_cycles(j, 1))
        if best is None or cycles < best[1]:
            best = (j, cycles)
    return best[0], best[1] / max(1, mg * nrow)


class Scratch:
    """Buffers reused from call to call, per calling thread (fresh allocations of large temporaries
    cost page faults that can exceed the kernel's own time): a view over a pool of the driver's scratch
    allocator (:class:`cct.device.driver.Workspaces`). A buffer is zeroed once, when created: callers
    write the same elements every time, so what they never write (padding, tails) stays zero. The newest
    ``capacity`` buffers are kept."""

    def __init__(self, capacity: int = 48):
        self.capacity = capacity
        self._pool = Workspaces(capacity)
        self._host = HostDevice()

    def __len__(self) -> int:
        """The number of buffers kept."""
        return len(self._pool)

    def zeros(self, tag: Any, shape: tuple[int, ...], dtype: Any, xp: Any = np) -> Any:
        """The buffer for ``tag`` (include what fixes the untouched elements, e.g. the geometry), an
        array of the array module ``xp`` (on its current device)."""
        device = self._host if xp is np else module_device(xp)
        key = (tag, tuple(shape), np.dtype(dtype), device.name, threading.get_ident())
        return self._pool.take(device, key, shape, dtype, zeroed=True)[0]


class SharedScratch:
    """A :class:`Scratch` for convolutions that never run at the same time on one thread (the layers of one
    forward-only pass): one buffer per role (the tag's first element, e.g. ``"xpad"``) and thread, shared by
    all of them and as large as the largest request, instead of one buffer per layer (a growing pool of
    :class:`cct.device.driver.Workspaces`). A buffer last handed out for another tag or shape is zeroed
    again before it is handed out, so what a caller never writes is zero as with :class:`Scratch`."""

    def __init__(self) -> None:
        self._pool = Workspaces()
        self._owners: dict = {}  # pool key -> (tag, shape) it was last handed out for
        self._lock = threading.Lock()
        self._host = HostDevice()

    def __len__(self) -> int:
        """The number of buffers kept."""
        return len(self._pool)

    def sizes(self) -> list[tuple[str, int]]:
        """``(role, bytes)`` of every buffer kept (one per role and thread), e.g. to check a memory plan."""
        return sorted((key[0], int(buf.nbytes)) for key, buf in self._pool.items())

    def zeros(self, tag: Any, shape: tuple[int, ...], dtype: Any, xp: Any = np) -> Any:
        """The zeroed-once buffer of ``tag``'s role for ``shape`` (see the class docstring)."""
        role = tag[0] if isinstance(tag, tuple) else tag
        device = self._host if xp is np else module_device(xp)
        key = (role, np.dtype(dtype), device.name, threading.get_ident())
        owner = (tag, tuple(shape))
        view, created = self._pool.take(device, key, shape, dtype, zeroed=True, grow=True)
        with self._lock:
            fresh = self._owners.get(key) != owner
            self._owners[key] = owner
        if fresh and not created:
            view.fill(0)
        return view


def scratch_zeros(scratch: Scratch | None, tag: Any, shape: tuple[int, ...], dtype: Any, xp: Any = np) -> Any:
    """``scratch``'s buffer for ``tag`` (zeroed when created), or a fresh zeroed array without one."""
    return xp.zeros(shape, dtype=dtype) if scratch is None else scratch.zeros(tag, shape, dtype, xp)


def as3(values: tuple[int, ...], fill: int) -> tuple[int, ...]:
    """``values`` with leading ``fill`` entries up to three spatial axes."""
    return (fill,) * (3 - len(values)) + tuple(values)


@dataclass(frozen=True)
class SimdLayout:
    """Strides and extents (elements) of one convolution's buffers for :mod:`cct.kernels.conv_simd`."""

    flat: bool
    lanes: int
    wp: int  # padded input row width
    du: int  # padded input depth and height (the windows' used extent)
    hu: int
    x_cs: int  # input buffer elements per channel
    nrow: int  # position rows (rows layout: output rows; flat: vectors) per output depth slice
    ncol: int  # vectors per row
    y_plane: int  # output buffer elements per depth slice
    efficiency: float  # useful share of the computed positions

    @property
    def drops_positions(self) -> bool:
        """Whether the kernel computes positions the output does not have (the flat layout's row ends,
        the rows layout's padded width): it then writes a buffer whose valid positions are gathered."""
        return self.flat or self.efficiency < 1

    @property
    def y_rs(self) -> int:
        return self.lanes if self.flat else self.ncol * self.lanes


def plan_layout(geom: ConvGeometry, lanes: int) -> SimdLayout | None:
    """The better of the two layouts for ``geom``, or None when the kernels cannot run it."""
    if not 1 <= geom.num_spatial <= 3 or geom.out_size == 0 or geom.stride[-1] != 1:
        return None
    od, oh, ow = as3(geom.out_shape, 1)
    kd, kh, kw = as3(geom.kernel, 1)
    _, sh, _ = as3(geom.stride, 1)
    _, _, dw = as3(geom.dilation, 1)
    du, hu, wu = as3(geom.used_extent, 1)
    owp = -(-ow // lanes) * lanes
    wp = owp + (kw - 1) * dw
    rows = SimdLayout(False, lanes, wp, du, hu, du * hu * wp, oh, owp // lanes, oh * owp, ow / owp)
    if sh != 1:
        return rows
    plane = oh * wu
    nvec = -(-plane // lanes)
    flat = SimdLayout(True, lanes, wu, du, hu, du * hu * wu + nvec * lanes - plane + wu, nvec, 1, nvec * lanes,
                      plane * ow / wu / (nvec * lanes))
    return flat if flat.efficiency > rows.efficiency else rows


def _spatial_view(buf: Any, lay: SimdLayout, nd: int) -> Any:
    """The ``(N, C, *padded extent)`` view of a layout buffer (its slack cut off)."""
    body = buf[:, :, :lay.du * lay.hu * lay.wp].reshape(buf.shape[:2] + (lay.du, lay.hu, lay.wp))
    return body.reshape(buf.shape[:2] + (lay.du, lay.hu, lay.wp)[3 - nd:])


def padded_input(x: Any, geom: ConvGeometry, lay: SimdLayout, scratch: Scratch | None = None,
                 km: Any = None) -> Any:
    """``x`` copied into a zeroed ``(N, C, x_cs)`` buffer of the layout (by ``km.copy_into`` in
    parallel when the kernels are given)."""
    buf = scratch_zeros(scratch, ("xpad", geom, lay), x.shape[:2] + (lay.x_cs,), x.dtype)
    view = _spatial_view(buf, lay, geom.num_spatial)
    _copy_interior(km, x, view, geom)
    return buf


def _copy_interior(km: Any, x: Any, buf: Any, geom: ConvGeometry) -> None:
    """``x``'s part inside the padded buffer ``buf`` (``(N, C, *extent)``) copied to its place, by
    ``km.copy_into`` in parallel when the kernels are given."""
    dst, src = geom.interior(buf.shape[2:])
    region = x[(slice(None), slice(None)) + src]
    if km is not None and region.size:
        starts = as3(tuple(d.start for d in dst), 0)
        km.copy_into(region.reshape(region.shape[:2] + as3(region.shape[2:], 1)),
                     buf.reshape(buf.shape[:2] + as3(buf.shape[2:], 1)), *starts)
    else:
        buf[(slice(None), slice(None)) + dst] = region


def output_positions(buf: Any, geom: ConvGeometry, lay: SimdLayout) -> Any:
    """The ``(N, M, *out_shape)`` view of the valid positions in a ``(N, M, OD, y_plane)`` buffer."""
    od, oh, ow = as3(geom.out_shape, 1)
    width = lay.wp if lay.flat else lay.ncol * lay.lanes
    body = buf[..., :oh * width].reshape(buf.shape[:2] + (od, oh, width))[..., :ow]
    return body.reshape(buf.shape[:2] + tuple(geom.out_shape))


def _tap_strides(geom: ConvGeometry, lay: SimdLayout) -> tuple[int, int, int, int, int]:
    """Input strides: per depth tap, row tap, column tap, output depth slice, position row."""
    sd, sh, _ = as3(geom.stride, 1)
    dd, dh, dw = as3(geom.dilation, 1)
    plane = lay.hu * lay.wp
    return dd * plane, dh * lay.wp, dw, sd * plane, (lay.lanes if lay.flat else sh * lay.wp)


def finish_output(km: Any, yb: Any, out: Any, geom: ConvGeometry, lay: SimdLayout) -> None:
    """``out`` = the valid positions of the forward buffer ``yb``, in one compiled pass when ``out`` is
    C-contiguous."""
    if not out.flags.c_contiguous:
        out[...] = output_positions(yb, geom, lay)
        return
    n, m = out.shape[:2]
    od, oh, ow = as3(geom.out_shape, 1)
    km.gather_output(yb, out.reshape(n, m, od, oh, ow), lay.wp if lay.flat else lay.ncol * lay.lanes)


def run_forward(km: Any, xbuf: Any, wblk: Any, geom: ConvGeometry, lay: SimdLayout, out: Any = None,
                scratch: Scratch | None = None, bias: Any = None) -> Any:
    """The forward kernel (plus ``bias``, or None) on a padded input: written straight into ``out``
    (``(N, M, *out_shape)``, returns None) when that is C-contiguous and the layout drops no positions,
    else into a new ``(N, M, OD, y_plane)`` buffer that is returned (:func:`output_positions` reads it)."""
    n = xbuf.shape[0]
    g = geom.group
    od = as3(geom.out_shape, 1)[0]
    kd, kh, kw = as3(geom.kernel, 1)
    direct = out is not None and out.flags.c_contiguous and not lay.drops_positions
    yb = out if direct else scratch_zeros(scratch, "y", (n, geom.channels_out, od, lay.y_plane), xbuf.dtype)
    xkd, xkh, xkw, xozs, xrs = _tap_strides(geom, lay)
    bblk = km.blocked_bias(bias, geom.channels_out, g, wblk.shape[-1], xbuf.dtype)
    km.forward(xbuf.reshape(-1), wblk.reshape(-1), yb.reshape(-1), bblk.reshape(-1), n, g, geom.channels_in // g,
               geom.channels_out // g, wblk.shape[-1], kd, kh, kw, lay.x_cs, xkd, xkh, xkw, xozs, xrs,
               od, lay.nrow, lay.ncol, lay.lanes, od * lay.y_plane, lay.y_plane, lay.y_rs)
    return None if direct else yb


def pad_input(x: Any, geom: ConvGeometry, scratch: Scratch | None = None, km: Any = None) -> Any:
    """``(N, C, *used_extent)``: ``x`` zero-padded and cropped to the region the windows touch (a
    reused buffer with ``scratch``; copied in parallel with the kernels ``km``)."""
    xp = array_module(x)
    ext = geom.used_extent
    dst, _ = geom.interior(ext)
    full = all(d.start == 0 and d.stop == e for d, e in zip(dst, ext))
    if scratch is not None:
        buf = scratch.zeros(("pad", geom), x.shape[:2] + tuple(ext), x.dtype, xp)
    else:
        buf = (xp.empty if full else xp.zeros)(x.shape[:2] + tuple(ext), dtype=x.dtype)
    _copy_interior(km, x, buf, geom)
    return buf


def weight_grad_buffers(km: Any, dy: Any, x: Any, geom: ConvGeometry, chunks: int,
                        scratch: Scratch | None = None) -> tuple[Any, Any, Any]:
    """``(dyt, xpad, part)`` for :func:`run_weight_grad_kernel`: the gradient made position-major per
    block of channels (``(N, G, NB, P, MB)``, zero past each group's channels), the padded input, and
    ``chunks`` zeroed partial sums."""
    n = x.shape[0]
    g = geom.group
    cg, mg = geom.channels_in // g, geom.channels_out // g
    kd, kh, kw = as3(geom.kernel, 1)
    mb = km.WGRAD_VECTORS * km.lanes(x.dtype)
    mgp = -(-mg // mb) * mb
    dyt = scratch_zeros(scratch, ("dyt", geom), (n, g, mgp // mb, geom.out_size, mb), dy.dtype)
    km.position_major(np.ascontiguousarray(dy).reshape(n, geom.channels_out, -1), dyt, g)
    xpad = pad_input(x, geom, scratch, km)
    part = scratch_zeros(scratch, "part", (max(1, min(chunks, n)), g, mgp // mb, cg, kd, kh, kw, mb), x.dtype)
    part[...] = 0  # sums: cleared every call
    return dyt, xpad, part


def run_weight_grad_kernel(km: Any, geom: ConvGeometry, dyt: Any, xpad: Any, part: Any) -> None:
    """The weight-gradient kernel on :func:`weight_grad_buffers` (adds into ``part``)."""
    g = geom.group
    od, oh, ow = as3(geom.out_shape, 1)
    kd, kh, kw = as3(geom.kernel, 1)
    sz, sy, sx = as3(geom.stride, 1)
    dd, dh, dw = as3(geom.dilation, 1)
    _, hu, wu = as3(geom.used_extent, 1)
    mgp = dyt.shape[2] * dyt.shape[4]
    km.weight_grad(dyt.reshape(-1), xpad.reshape(-1), part, xpad.shape[0], g, geom.channels_in // g, mgp, kd, kh, kw,
                   od, oh, ow, xpad[0, 0].size, hu * wu, wu, sz, sy, sx, dd, dh, dw)


def run_weight_grad(km: Any, dy: Any, x: Any, geom: ConvGeometry, chunks: int, scratch: Scratch | None = None) -> Any:
    """``dL/dw`` (``geom.weight_shape``) by the weight-gradient kernel: ``chunks`` partial sums over
    the images, on the gradient made position-major and the padded input."""
    g = geom.group
    cg, mg = geom.channels_in // g, geom.channels_out // g
    dyt, xpad, part = weight_grad_buffers(km, dy, x, geom, chunks, scratch)
    run_weight_grad_kernel(km, geom, dyt, xpad, part)
    kd, kh, kw = as3(geom.kernel, 1)
    dwb = np.moveaxis(part.sum(axis=0), -1, 2).reshape((g, dyt.shape[2] * dyt.shape[4], cg, kd, kh, kw))[:, :mg]
    return np.ascontiguousarray(dwb).reshape(geom.weight_shape)


def transposed_geometry(geom: ConvGeometry) -> ConvGeometry | None:
    """The unit-stride convolution whose forward pass is ``geom``'s data gradient (None when ``geom``
    has a stride above 1 or a padding wider than its kernel's reach)."""
    if any(s != 1 for s in geom.stride):
        return None
    pads = tuple((k - 1) * d - p for k, d, p in zip(geom.kernel, geom.dilation, geom.pad))
    if any(p < 0 for p in pads):
        return None
    return ConvGeometry(geom.channels_out, geom.channels_in, geom.group, tuple(geom.out_shape), tuple(geom.kernel),
                        pads, tuple(geom.stride), tuple(geom.dilation), tuple(geom.in_shape), False)


def transposed_weights(w: Any, geom: ConvGeometry) -> Any:
    """``(M, Cg, *K)`` -> ``(C, Mg, *K)``: per group, channels swapped and the kernel flipped."""
    g = geom.group
    mg, cg = geom.channels_out // g, geom.channels_in // g
    nd = geom.num_spatial
    wg = w.reshape((g, mg, cg) + tuple(geom.kernel)).swapaxes(1, 2)
    wg = wg[(slice(None),) * 3 + (slice(None, None, -1),) * nd]
    return np.ascontiguousarray(wg).reshape((geom.channels_in, mg) + tuple(geom.kernel))


def phase_geometry(geom: ConvGeometry) -> ConvGeometry | None:
    """The unit-stride convolution over the stride phases of ``geom``'s padded input (None when
    ``geom`` is unit-stride or dilated).

    Input element ``i * s + r`` of an axis with stride ``s`` becomes element ``i`` of phase plane
    ``r``; a tap ``q * s + r`` of the kernel becomes tap ``q`` on plane ``r``. The planes are
    channels (``C * prod(s)``, channel-major, so groups stay contiguous), the kernel shrinks to
    ``ceil(k / s)`` taps per axis (zero past ``k``), and the output is the same.
    """
    if all(s == 1 for s in geom.stride) or any(d != 1 for d in geom.dilation) or geom.out_size == 0:
        return None
    kq = tuple(-(-k // s) for k, s in zip(geom.kernel, geom.stride))
    ext = tuple(o + q - 1 for o, q in zip(geom.out_shape, kq))
    ones = (1,) * geom.num_spatial
    return ConvGeometry(geom.channels_in * math.prod(geom.stride), geom.channels_out, geom.group, ext, kq,
                        (0,) * geom.num_spatial, ones, ones, tuple(geom.out_shape), geom.bias_term)


def _phase_axes(nd: int, lead: int) -> tuple[int, ...]:
    """Permutation of ``(lead..., E0, s0, E1, s1, ...)`` to ``(lead..., s0, s1, ..., E0, E1, ...)``."""
    return tuple(range(lead)) + tuple(lead + 2 * i + 1 for i in range(nd)) + tuple(lead + 2 * i for i in range(nd))


def _unphase_axes(nd: int, lead: int) -> tuple[int, ...]:
    """Inverse of :func:`_phase_axes`."""
    return tuple(range(lead)) + tuple(v for i in range(nd) for v in (lead + nd + i, lead + i))


def phase_input(x: Any, geom: ConvGeometry, pgeom: ConvGeometry, km: Any = None, scratch: Scratch | None = None) -> Any:
    """``x`` zero-padded and split into the stride phases of :func:`phase_geometry` (by
    ``km.phase_split`` when the kernels are given)."""
    nd = geom.num_spatial
    if km is not None:
        strides, ext, pads = as3(geom.stride, 1), as3(pgeom.in_shape, 1), as3(geom.pad, 0)
        out = scratch_zeros(scratch, ("phase", geom), x.shape[:2] + strides + ext, x.dtype)
        km.phase_split(np.ascontiguousarray(x).reshape(x.shape[:2] + as3(geom.in_shape, 1)), out, *pads)
        return out.reshape((x.shape[0], pgeom.channels_in) + tuple(pgeom.in_shape))
    ext = tuple(e * s for e, s in zip(pgeom.in_shape, geom.stride))
    buf = np.zeros(x.shape[:2] + ext, dtype=x.dtype)
    dst, src = geom.interior(ext)
    buf[(slice(None), slice(None)) + dst] = x[(slice(None), slice(None)) + src]
    split = x.shape[:2] + tuple(v for e, s in zip(pgeom.in_shape, geom.stride) for v in (e, s))
    planes = buf.reshape(split).transpose(_phase_axes(nd, 2))
    return np.ascontiguousarray(planes).reshape((x.shape[0], pgeom.channels_in) + tuple(pgeom.in_shape))


def phase_weights(w: Any, geom: ConvGeometry, pgeom: ConvGeometry) -> Any:
    """``(M, Cg, *k)`` -> ``(M, Cg * prod(s), *ceil(k / s))``, zero taps past the kernel."""
    nd = geom.num_spatial
    full = tuple(q * s for q, s in zip(pgeom.kernel, geom.stride))
    wp = np.zeros(w.shape[:2] + full, dtype=w.dtype)
    wp[(slice(None), slice(None)) + tuple(slice(0, k) for k in geom.kernel)] = w
    split = w.shape[:2] + tuple(v for q, s in zip(pgeom.kernel, geom.stride) for v in (q, s))
    planes = wp.reshape(split).transpose(_phase_axes(nd, 2))
    return np.ascontiguousarray(planes).reshape(pgeom.weight_shape)


def unphase_weights(dwp: Any, geom: ConvGeometry, pgeom: ConvGeometry) -> Any:
    """Gradient of the phase weights back to ``geom.weight_shape`` (the padded taps dropped)."""
    nd = geom.num_spatial
    cg = geom.channels_in // geom.group
    split = (geom.channels_out, cg) + tuple(geom.stride) + tuple(pgeom.kernel)
    full = dwp.reshape(split).transpose(_unphase_axes(nd, 2)).reshape(
        (geom.channels_out, cg) + tuple(q * s for q, s in zip(pgeom.kernel, geom.stride)))
    return np.ascontiguousarray(full[(slice(None), slice(None)) + tuple(slice(0, k) for k in geom.kernel)])


def unphase_input_grad(dxp: Any, geom: ConvGeometry, pgeom: ConvGeometry, out: Any, km: Any = None) -> None:
    """``out[...]`` = the gradient of the phase planes ``dxp`` mapped back onto the unpadded input
    (by ``km.phase_merge`` when the kernels are given and ``out`` is C-contiguous)."""
    nd = geom.num_spatial
    n = dxp.shape[0]
    if km is not None and out.flags.c_contiguous:
        src = dxp.reshape((n, geom.channels_in) + as3(geom.stride, 1) + as3(pgeom.in_shape, 1))
        km.phase_merge(src, out.reshape(out.shape[:2] + as3(geom.in_shape, 1)), *as3(geom.pad, 0))
        return
    split = (n, geom.channels_in) + tuple(geom.stride) + tuple(pgeom.in_shape)
    ext = tuple(e * s for e, s in zip(pgeom.in_shape, geom.stride))
    full = dxp.reshape(split).transpose(_unphase_axes(nd, 2)).reshape((n, geom.channels_in) + ext)
    dst, src = geom.interior(ext)
    out[...] = 0
    out[(slice(None), slice(None)) + src] = full[(slice(None), slice(None)) + dst]
