"""FFT convolution with pruned kernel transforms (ZNNi sections III and IV-A.2), 1-, 2- and 3-D.

Every spatial axis is transformed at ``F = next_fast_len(E)`` points, ``E`` the padded extent the
windows touch (:attr:`ConvGeometry.used_extent`); ``F >= E`` makes the circular products equal the
linear ones on every position used. Per group and frequency the channel sums are complex GEMMs:

* forward: ``Y[n, m] = sum_c X[n, c] * conj(W[m, c])`` (a correlation), ``y`` = the first
  ``(out - 1) * s + 1`` positions of ``irfft(Y)`` taken every ``s`` (stride);
* data gradient: ``dX[n, c] = sum_m DY[n, m] * W[m, c]`` with ``dy`` spread ``s`` apart;
* weight gradient: ``dW[m, c] = sum_n conj(DY[n, m]) * X[n, c]``, the first kernel-extent
  positions of its inverse taken every ``d`` (dilation).

The weights and the output gradient are kept as conjugate spectra (a real signal's transform with
the exponent's sign flipped is the conjugate of its transform): the forward pass and the weight
gradient then multiply spectra as they are, and the data gradient, ``conj(dX) = sum_m conj(DY) *
conj(W)``, is inverted with the sign flipped back. No pass conjugates an array.

Pruned transforms (ZNNi Figure 2): a kernel only fills ``k`` of the ``F`` points per axis, so it is
transformed one axis at a time (real FFT of the last axis first), each stage only over the lines
that are not all zero; inverse transforms keep, axis by axis, only the lines whose outputs are
used. The kernel's transform is cached from the forward pass for the data gradient of the same
iteration (reused while the weights are unchanged: they are compared with a kept copy).

Spectra are laid out frequency-major, ``(G, *freq, rows, channels)``, so that the channel sums are
one stacked GEMM per group with no transposes: the last stage of each forward transform writes that
layout directly and the first inverse stage reads it in place. Every buffer is reused from call to
call (:class:`.direct_layout.Scratch`): fresh arrays of this size cost page faults comparable to the
transforms themselves. With numpy the stages run on scipy's pocketfft binding, which writes into
given arrays (``workers`` = the BLAS thread count); cupy (and numpy without that binding) runs the
same stages through ``xp.fft`` and copies each result into place. Operations declared to the cost
model follow ZNNi Table I (``("fft", flops, points)`` per transform stage and complex GEMMs
``("cgemm", m, n, k, count)``); the workspace follows Table II.
"""
from __future__ import annotations

import functools
import math
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from .. import blas
from ..device.driver import array_module, device_of
from . import direct_layout as dl
from .base import IntoLowering, register_strategy
from .geometry import ConvGeometry


@functools.cache
def pocketfft_binding() -> Any:
    """scipy's pocketfft binding (transforms into given arrays), or None where it is missing: imported on the
    first transform (importing scipy.fft takes ~0.3 s, which every ``import cct`` paid when this was loaded
    with the module), once per process, as any import."""
    try:
        from scipy.fft._pocketfft import pypocketfft
    except ImportError:  # a scipy without it: the public API, results copied into place
        return None
    return pypocketfft if all(hasattr(pypocketfft, f) for f in ("r2c", "c2c", "c2r")) else None


def _native(a: Any) -> Any:
    """The pocketfft binding when ``a`` is in host memory and scipy has it, else None (its array module's
    FFT)."""
    return None if device_of(a).is_gpu else pocketfft_binding()


def _workers() -> int:
    return max(1, blas.get_num_threads())


def _r2c(a: Any, axis: int, conjugate: bool, out: Any) -> Any:
    """``out[...]`` = the half spectrum of real ``a`` along ``axis`` (its whole length); its conjugate
    with ``conjugate``."""
    xp = array_module(a)
    pocketfft = _native(a)
    if pocketfft is not None:
        return pocketfft.r2c(a, (axis,), not conjugate, 0, out, _workers())
    r = xp.fft.rfft(a, axis=axis)
    out[...] = xp.conj(r) if conjugate else r
    return out


def _c2c(a: Any, axis: int, negative: bool, scale: bool, out: Any) -> Any:
    """``out[...]`` (``out`` may be ``a``) = the complex transform of ``a`` along ``axis`` with a
    negative (``negative``) or positive exponent, divided by the length with ``scale``."""
    xp = array_module(a)
    pocketfft = _native(a)
    if pocketfft is not None:
        return pocketfft.c2c(a, (axis,), negative, 2 if scale else 0, out, _workers())
    if negative:
        out[...] = xp.fft.fft(a, axis=axis, norm="forward" if scale else "backward")
    else:
        out[...] = xp.fft.ifft(a, axis=axis, norm="backward" if scale else "forward")
    return out


def _c2r(a: Any, axis: int, points: int, conjugate: bool, out: Any) -> Any:
    """``out[...]`` = the real inverse (divided by ``points``) along ``axis`` of the half spectrum
    ``a``, or of the spectrum whose conjugate ``a`` is (``conjugate``)."""
    xp = array_module(a)
    pocketfft = _native(a)
    if pocketfft is not None:
        return pocketfft.c2r(a, (axis,), points, conjugate, 2, out, _workers())
    out[...] = xp.fft.irfft(xp.conj(a) if conjugate else a, n=points, axis=axis)
    return out


def fft_shape(geom: ConvGeometry) -> tuple[int, ...]:
    """Transform size per spatial axis: the next fast length >= the used extent."""
    import scipy.fft as sfft

    return tuple(int(sfft.next_fast_len(max(1, e), real=True)) for e in geom.used_extent)


def _complex(dtype: Any) -> Any:
    return np.complex64 if np.dtype(dtype) == np.float32 else np.complex128


def _real(dtype: Any) -> Any:
    return np.float32 if np.dtype(dtype) == np.complex64 else np.float64


def half_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The frequencies a real transform of ``shape`` points keeps per axis."""
    return tuple(shape[:-1]) + (shape[-1] // 2 + 1,)


def spectrum(a: Any, shape: tuple[int, ...], out: Any, conjugate: bool = False,
             scratch: dl.Scratch | None = None, tag: Any = None, axes: tuple[int, ...] | None = None) -> Any:
    """``out[...]`` = the half spectrum over the spatial ``axes`` of ``a`` (default: the trailing
    ``len(shape)``) zero-extended to ``shape`` (its conjugate with ``conjugate``). ``a`` comes
    zero-extended along the last spatial axis (``shape[-1]`` points); the others may be shorter. One
    axis at a time, the last one first, each stage over only the lines the zero extension leaves
    non-zero (ZNNi Figure 2), writing the head of the next stage's zero-extended buffer (from
    ``scratch``; fresh without one), so that no stage copies or zeroes anything. ``out`` may be any
    strided view."""
    xp = array_module(a)
    nd = len(shape)
    axes = tuple(range(a.ndim - nd, a.ndim)) if axes is None else tuple(axes)
    if a.shape[axes[-1]] != shape[-1]:
        raise ValueError(f"spectrum: the last axis must come zero-extended to {shape[-1]} points, "
                         f"not {a.shape[axes[-1]]}")
    cdt = _complex(a.dtype)

    def stage(i: int, have: tuple[int, ...]) -> tuple[Any, Any]:
        """(buffer, head): where the transform before axis ``i``'s writes (``have`` its shape): the head
        of a buffer ``shape[i]`` long on axis ``i``, zero beyond ``have`` there (never written)."""
        if i < 0:
            return out, out
        ax = axes[i]
        full = dl.scratch_zeros(scratch, (f"fft.stage{i}", tag), have[:ax] + (shape[i],) + have[ax + 1:], cdt, xp)
        return full, full[(slice(None),) * ax + (slice(0, have[ax]),)]

    last = axes[-1]
    cur, head = stage(nd - 2, a.shape[:last] + (shape[-1] // 2 + 1,) + a.shape[last + 1:])
    _r2c(a, last, conjugate, head)
    for i in range(nd - 2, -1, -1):
        nxt, head = stage(i - 1, cur.shape)
        _c2c(cur, axes[i], not conjugate, False, head)  # conj(transform) of a real signal: the sign flipped
        cur = nxt
    return out


def inverse_spectrum(a: Any, shape: tuple[int, ...], keep: tuple[int, ...], conjugate: bool = False,
                     scratch: dl.Scratch | None = None, tag: Any = None, axes: tuple[int, ...] | None = None) -> Any:
    """The first ``keep[i]`` positions per axis of the real inverse transform (``s=shape``) of the
    half spectrum ``a`` over its spatial ``axes`` (default: the trailing ``len(shape)``; any strides),
    or of the spectrum ``a`` is the conjugate of (``conjugate``). Each stage runs on the lines later
    stages need and keeps only ``keep[i]`` of its outputs. The result is a view of a ``scratch``
    buffer."""
    xp = array_module(a)
    nd = len(shape)
    axes = tuple(range(a.ndim - nd, a.ndim)) if axes is None else tuple(axes)
    cur = a
    for i in range(nd - 1):
        ax = axes[i]
        buf = dl.scratch_zeros(scratch, (f"fft.istage{i}", tag), cur.shape, a.dtype, xp)
        cur = _c2c(cur, ax, conjugate, True, buf)[(slice(None),) * ax + (slice(0, keep[i]),)]
    last = axes[-1]
    real = dl.scratch_zeros(scratch, ("fft.ireal", tag), cur.shape[:last] + (shape[-1],) + cur.shape[last + 1:],
                            _real(a.dtype), xp)
    return _c2r(cur, last, shape[-1], conjugate, real)[(slice(None),) * last + (slice(0, keep[-1]),)]


def _last_extended(extent: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    """``extent`` with its last axis zero-extended to the transform's points (how :func:`spectrum` takes it)."""
    return tuple(extent[:-1]) + (shape[-1],)


def _spread_extent(geom: ConvGeometry) -> tuple[int, ...]:
    """The output grid spread ``stride`` apart: ``(out - 1) * stride + 1`` per axis (the forward's kept
    positions, the extent of the spread output gradient)."""
    return tuple((o - 1) * s + 1 for o, s in zip(geom.out_shape, geom.stride))


def _uncovered(geom: ConvGeometry) -> bool:
    """Whether some input positions lie outside every window (their data gradient is zero)."""
    _, src = geom.interior()
    return any(s.stop - s.start != i for s, i in zip(src, geom.in_shape))


def _rows_major(buf: Any, nd: int) -> Any:
    """``(G, *freq, P, Q)`` viewed as ``(P, G, Q, *freq)``."""
    return buf.transpose((nd + 1, 0, nd + 2) + tuple(range(1, nd + 1)))


def _merge_groups(a: Any) -> Any:
    """``(P, G, Q, *spatial)`` as ``(P, G * Q, *spatial)``: a view for the results of
    :func:`inverse_spectrum` (group and channel strides are nested there)."""
    return a.reshape(a.shape[:1] + (a.shape[1] * a.shape[2],) + a.shape[3:])


class FFTConvolution(IntoLowering):
    """FFT convolution (see module docstring)."""

    name = "fft"

    #: weight spectra kept (the newest): a net's FFT layers each keep theirs from forward to backward
    KERNEL_CACHE = 8
    #: bytes of the largest stage buffer of the weights' transform (:meth:`weight_block`)
    WEIGHT_STAGE_BYTES = 64 << 20

    def __init__(self) -> None:
        self._wcache: OrderedDict = OrderedDict()
        self._prepared: set = set()  # device weights transformed by prepare() for the pass that follows
        self._wlock = threading.Lock()
        self._scratch = dl.Scratch(capacity=96)

    def supports(self, geom: ConvGeometry) -> bool:
        """1-, 2- and 3-D convolutions with a non-empty output."""
        return 1 <= geom.num_spatial <= 3 and geom.out_size > 0

    def share_scratch(self, scratch: dl.SharedScratch) -> None:
        """Take the reused buffers from ``scratch``, shared by role with other convolutions that never run at
        the same time (dense inference's layers), instead of keeping this layer's own per geometry."""
        self._scratch = scratch

    def _buffer(self, tag: Any, shape: tuple[int, ...], dtype: Any, xp: Any) -> Any:
        return self._scratch.zeros(tag, shape, dtype, xp)

    # -- spectra -------------------------------------------------------------------------------
    def prepare(self, w: Any, geom: ConvGeometry, pass_: str) -> None:
        """The weights' spectrum, once for all chunks of a pass (with every transform worker). Weights in
        a GPU's memory are transformed anew for every pass: comparing them with the cached copy would
        make the host wait for the device mid-iteration, and their transform costs the GPU little."""
        self.kernel_transform(w, geom, fresh=device_of(w).is_gpu)

    def kernel_transform(self, w: Any, geom: ConvGeometry, fresh: bool = False) -> Any:
        """``(G, F, Cg, Mg)`` (``F`` the frequencies, flattened; a strided view): the conjugate of the
        pruned transform of the (dilated) weights. Shared by every thread and cached while the
        weights are unchanged (per weight array: the forward's transform serves the data gradient).

        The weights are transformed spatial axes first, ``(*kernel, G, Mg, Cg)``: every transform line
        then has its neighbours next to it in memory and the spectrum comes out frequency-major and
        contiguous (on the channel-major layout the last stage's writes land ``Mg * Cg`` elements apart,
        several times slower).

        Host weights are compared with the cached copy; device weights are not (see :meth:`prepare`):
        ``fresh`` transforms them and lets the next call take that transform, any other call
        transforms them again."""
        xp = array_module(w)
        on_host = not device_of(w).is_gpu
        key = (geom, id(w), xp.__name__, w.shape, np.dtype(w.dtype))
        with self._wlock:  # one thread computes, the others wait for it instead of computing it again
            hit = self._wcache.pop(key, None)
            prepared = key in self._prepared and not fresh
            self._prepared.discard(key)
            if hit is not None and (bool(np.array_equal(hit[0], w)) if on_host else prepared):
                self._wcache[key] = hit
                return hit[1]
            shape = fft_shape(geom)
            nd, g = geom.num_spatial, geom.group
            mg, cg = geom.channels_out // g, geom.channels_in // g
            if hit is None:
                hit = (w.copy() if on_host else None, None,
                       xp.empty(half_shape(shape) + (g, mg, cg), dtype=_complex(w.dtype)))
            elif on_host:
                hit[0][...] = w
            kept, _, spec = hit
            taps = tuple(slice(None, e, d) for e, d in zip(geom.kernel_extent, geom.dilation))
            wg = w.reshape((g, mg, cg) + w.shape[2:])
            step = self.weight_block(geom, np.dtype(w.dtype).itemsize)
            for j0 in range(0, mg, step):  # a block of output maps at a time: its stage buffers stay small
                j1 = min(mg, j0 + step)
                wsp = self._buffer(("fft.wpad", geom), _last_extended(geom.kernel_extent, shape) + (g, j1 - j0, cg),
                                   w.dtype, xp)
                wsp[taps] = wg[:, j0:j1].transpose(tuple(range(3, 3 + nd)) + (0, 1, 2))
                spectrum(wsp, shape, spec[..., j0:j1, :], conjugate=True, scratch=self._scratch, tag=("w", geom),
                         axes=tuple(range(nd)))
            ws = spec.reshape(-1, g, mg, cg).transpose(1, 0, 3, 2)
            self._wcache[key] = (kept, ws, spec)
            if fresh:
                self._prepared.add(key)
            while len(self._wcache) > self.KERNEL_CACHE:
                self._prepared.discard(self._wcache.popitem(last=False)[0])
            return ws

    def weight_block(self, geom: ConvGeometry, itemsize: int = 4) -> int:
        """Output maps (per group) transformed together: as many as keep the largest stage buffer of their
        transform within :attr:`WEIGHT_STAGE_BYTES` (at least one), instead of one buffer the size of the whole
        spectrum kept for a transform made once."""
        shape = fft_shape(geom)
        per_map = 2 * itemsize * geom.group * (geom.channels_in // geom.group) * math.prod(half_shape(shape))
        return max(1, min(geom.channels_out // geom.group, self.WEIGHT_STAGE_BYTES // per_map))

    def _batch_spectrum(self, a: Any, geom: ConvGeometry, extent: tuple[int, ...], place: tuple[slice, ...],
                        src: tuple[slice, ...], tag: str, conjugate: bool) -> Any:
        """``(G, F, N, channels / G)``: the transform (its conjugate with ``conjugate``) of ``a[..., src]``
        written at ``place`` into a kept, zero-extended ``extent`` buffer (what is never written stays zero)."""
        xp = array_module(a)
        n, c, nd, g = a.shape[0], a.shape[1], geom.num_spatial, geom.group
        shape = fft_shape(geom)
        buf = self._buffer((f"fft.{tag}pad", geom), a.shape[:2] + _last_extended(extent, shape), a.dtype, xp)
        buf[(slice(None), slice(None)) + place] = a[(slice(None), slice(None)) + src]
        spec = self._buffer((f"fft.{tag}s", geom), (g,) + half_shape(shape) + (n, c // g), _complex(a.dtype), xp)
        spectrum(buf.reshape((n, g, c // g) + buf.shape[2:]), shape, _rows_major(spec, nd), conjugate=conjugate,
                 scratch=self._scratch, tag=(tag, geom))
        return spec.reshape(g, -1, n, c // g)

    def _input_spectrum(self, x: Any, geom: ConvGeometry) -> Any:
        """``(G, F, N, Cg)``: the transform of the padded input."""
        dst, src = geom.interior()
        return self._batch_spectrum(x, geom, geom.used_extent, dst, src, "x", False)

    def _gradient_spectrum(self, dy: Any, geom: ConvGeometry) -> Any:
        """``(G, F, N, Mg)``: the conjugate transform of ``dy`` spread ``stride`` apart."""
        full = _spread_extent(geom)
        place = tuple(slice(None, e, s) for e, s in zip(full, geom.stride))
        return self._batch_spectrum(dy, geom, full, place, (slice(None),) * geom.num_spatial, "dy", True)

    # -- the three passes -------------------------------------------------------------------
    def forward_into(self, x: Any, w: Any, b: Any, geom: ConvGeometry, out: Any) -> Any:
        """``out[...] = conv(x, w) + b``."""
        xp = array_module(x)
        n, nd, g = x.shape[0], geom.num_spatial, geom.group
        mg = geom.channels_out // g
        bias = None if b is None else b.reshape((1, -1) + (1,) * nd)
        if n == 0 or x.size == 0:
            out[...] = 0 if bias is None else bias
            return out
        shape = fft_shape(geom)
        xs = self._input_spectrum(x, geom)
        ys = self._buffer(("fft.ys", geom), (g,) + half_shape(shape) + (n, mg), xs.dtype, xp)
        blas.matmul(xs, self.kernel_transform(w, geom), out=ys.reshape(g, -1, n, mg))
        y = inverse_spectrum(_rows_major(ys, nd), shape, _spread_extent(geom), scratch=self._scratch, tag=("y", geom))
        y = _merge_groups(y[(slice(None),) * 3 + tuple(slice(None, None, s) for s in geom.stride)])
        if bias is None:
            out[...] = y
        else:
            xp.add(y, bias, out=out)
        return out

    def backward_into(self, dy: Any, x: Any, w: Any, geom: ConvGeometry, dw: Any = None, db: Any = None,
                      dx: Any = None) -> None:
        """Both gradients of a chunk from one transform of ``dy``: ``dw += ...``, ``db += ...``,
        ``dx[...] = ...`` (each None to skip)."""
        xp = array_module(dy)
        n, nd, g = dy.shape[0], geom.num_spatial, geom.group
        cg, mg = geom.channels_in // g, geom.channels_out // g
        if db is not None:
            db += dy.sum(axis=(0,) + tuple(range(2, 2 + nd)))
        if n == 0 or dy.size == 0:
            if dx is not None:
                dx[...] = 0
            return
        if dw is None and dx is None:
            return
        shape = fft_shape(geom)
        ds = self._gradient_spectrum(dy, geom)
        if dw is not None:
            ws = self._buffer(("fft.dws", geom), (g,) + half_shape(shape) + (mg, cg), ds.dtype, xp)
            blas.matmul(ds.swapaxes(-1, -2), self._input_spectrum(x, geom), out=ws.reshape(g, -1, mg, cg))
            # inverted spatial axes first (as the weights' transform): (G, *kernel_extent, Mg, Cg)
            wd = inverse_spectrum(ws, shape, tuple(geom.kernel_extent), scratch=self._scratch, tag=("dw", geom),
                                  axes=tuple(range(1, 1 + nd)))
            taps = wd[(slice(None),) + tuple(slice(None, None, d) for d in geom.dilation)]
            dw += taps.transpose((0, nd + 1, nd + 2) + tuple(range(1, nd + 1))).reshape(dw.shape)
        if dx is not None:
            xs = self._buffer(("fft.dxs", geom), (g,) + half_shape(shape) + (n, cg), ds.dtype, xp)
            blas.matmul(ds, self.kernel_transform(w, geom).swapaxes(-1, -2), out=xs.reshape(g, -1, n, cg))
            used = inverse_spectrum(_rows_major(xs, nd), shape, tuple(geom.used_extent), conjugate=True,
                                    scratch=self._scratch, tag=("dx", geom))
            dst, src = geom.interior()
            if _uncovered(geom):
                dx[...] = 0  # input positions no window touches
            dx[(slice(None), slice(None)) + src] = _merge_groups(used)[(slice(None), slice(None)) + dst]

    # -- what the cost model prices (ZNNi Tables I and II) -----------------------------------------
    def pass_ops(self, geom: ConvGeometry, batch: int, pass_: str) -> list[tuple]:
        """Transform stages as ``("fft", flops, points per axis)`` (``("ifft", flops)`` for inverse ones),
        pruned to the lines that are not all zero; the per-frequency channel sums as ``("cgemm", m, n,
        k, frequencies * groups)``; the copies into and out of the zero-extended buffers. The
        frequency-major writes and reads of the transforms are in their calibrated rates."""
        shape = fft_shape(geom)
        g, c, m = geom.group, geom.channels_in, geom.channels_out
        cg, mg = c // g, m // g
        freq = math.prod(half_shape(shape))
        spread = _spread_extent(geom)
        fwd_in = _fft_flops(shape, geom.used_extent)  # the padded input's transform
        fwd_dy = _fft_flops(shape, spread)  # the output gradient's
        pts = max(shape)  # the transforms' rate depends on their size
        if pass_ == "fwd":
            return [("copy", batch * c * geom.in_size), ("fft", batch * c * fwd_in, pts),
                    *self.weight_transform_ops(geom), ("cgemm", batch, mg, cg, freq * g),
                    ("ifft", batch * m * _fft_flops(shape, spread)), ("copy", batch * m * geom.out_size)]
        if pass_ == "bwd_data":
            uncovered = _uncovered(geom)
            return [("copy", batch * m * geom.out_size), ("fft", batch * m * fwd_dy, pts),
                    ("cgemm", batch, cg, mg, freq * g), ("ifft", batch * c * _fft_flops(shape, geom.used_extent)),
                    ("zero", batch * c * geom.in_size if uncovered else 0), ("copy", batch * c * geom.in_size)]
        if pass_ == "bwd_weights":
            return [("copy", batch * c * geom.in_size), ("fft", batch * c * fwd_in, pts),
                    ("copy", batch * m * geom.out_size), ("fft", batch * m * fwd_dy, pts),
                    ("cgemm", mg, cg, batch, freq * g), ("ifft", m * cg * _fft_flops(shape, geom.kernel_extent)),
                    ("sum", batch * m * geom.out_size)]
        raise ValueError(f"unknown pass {pass_!r}")

    def weight_transform_ops(self, geom: ConvGeometry) -> list[tuple]:
        """The weights' pruned transform as the forward pass declares it (once per call: the weights may have
        changed; a caller whose weights stay fixed, as dense inference's, pays it once)."""
        cg = geom.channels_in // geom.group
        shape = fft_shape(geom)
        return [("fft", geom.channels_out * cg * _fft_flops(shape, geom.kernel_extent), max(shape))]

    def workspace_bytes(self, geom: ConvGeometry, batch: int, itemsize: int = 4) -> int:
        """ZNNi Table II, as this implementation keeps it (every buffer is kept between calls): the
        zero-extended input, output gradient and kernel; the stage buffers of their transforms; the
        spectra of the input, kernel, output, output gradient and both gradients; the inverse stages."""
        shape = fft_shape(geom)
        freq = math.prod(half_shape(shape))
        c, m, cg = geom.channels_in, geom.channels_out, geom.channels_in // geom.group
        spread = _spread_extent(geom)

        def extended(extent: tuple[int, ...]) -> int:
            return math.prod(_last_extended(extent, shape))

        real = (batch * c * (extended(geom.used_extent) + extended(geom.used_extent))
                + batch * m * (extended(spread) + extended(spread)) + m * cg * 2 * extended(geom.kernel_extent))
        spectra = (batch * c + m * cg + batch * m) * freq * 2 + (batch * c + batch * m + m * cg) * freq * 2
        return int(itemsize * (real + 2 * spectra))


    def forward_buffers(self, geom: ConvGeometry, batch: int, itemsize: int = 4) -> dict[str, int]:
        """Bytes per scratch role (the tag's first element) of one forward call on ``batch`` images, as
        :meth:`forward_into` requests them: the zero-extended input and the stages and spectrum of its
        transform, the output spectrum, the inverse stages, and the weights' zero-extended copy and transform
        stages (their roles shared with the input's: the weights are transformed after it). The weights'
        spectrum itself is kept per layer (:meth:`kernel_bytes`)."""
        shape = fft_shape(geom)
        nd, half = geom.num_spatial, half_shape(shape)[-1]
        c, m, cg = geom.channels_in, geom.channels_out, geom.channels_in // geom.group
        cplx, freq = 2 * itemsize, math.prod(half_shape(shape))

        def stages(extent: tuple[int, ...]) -> list[int]:  # spectrum(): stage j spans extent[:j], shape[j:-1], half
            return [math.prod(extent[:j]) * math.prod(shape[j:nd - 1]) * half for j in range(nd - 1)]

        wmaps = geom.group * self.weight_block(geom, itemsize) * cg  # kernels transformed together
        out: dict[str, int] = {"fft.xpad": itemsize * batch * c * math.prod(_last_extended(geom.used_extent, shape)),
                               "fft.xs": cplx * batch * c * freq, "fft.ys": cplx * batch * m * freq,
                               "fft.wpad": itemsize * wmaps * math.prod(_last_extended(geom.kernel_extent, shape))}
        for j, (xn, wn) in enumerate(zip(stages(geom.used_extent), stages(geom.kernel_extent))):
            out[f"fft.stage{j}"] = cplx * max(batch * c * xn, wmaps * wn)
        keep = _spread_extent(geom)  # inverse_spectrum(): stage j spans keep[:j], shape[j:-1], half
        for j in range(nd - 1):
            out[f"fft.istage{j}"] = cplx * batch * m * math.prod(keep[:j]) * math.prod(shape[j:nd - 1]) * half
        out["fft.ireal"] = itemsize * batch * m * math.prod(keep[:nd - 1]) * shape[-1]
        return out

    def pass_workspace_bytes(self, geom: ConvGeometry, batch: int, passes: tuple[str, ...],
                             itemsize: int = 4) -> int:
        """A forward-only layer (a TEST net's, dense inference's) holds :meth:`forward_buffers` and its weights'
        spectrum (:meth:`kernel_bytes`); one with gradients what :meth:`workspace_bytes` counts."""
        if tuple(passes) != ("fwd",):
            return self.workspace_bytes(geom, batch, itemsize)
        return sum(self.forward_buffers(geom, batch, itemsize).values()) + self.kernel_bytes(geom, itemsize)

    def kernel_bytes(self, geom: ConvGeometry, itemsize: int = 4) -> int:
        """Bytes a layer keeps for its weights between calls: their spectrum and the copy they are compared with."""
        cg = geom.channels_in // geom.group
        return itemsize * geom.channels_out * cg * (2 * math.prod(half_shape(fft_shape(geom))) + math.prod(geom.kernel))


def _fft_flops(shape: tuple[int, ...], nonzero: tuple[int, ...]) -> float:
    """Flops of a pruned real N-d transform of ``shape`` points whose input (or kept output) spans
    ``nonzero`` points per axis: ``2.5 n log2 n`` per complex line of ``n`` points, half for the
    real stage; each stage only over the lines earlier stages made non-zero."""
    nd = len(shape)
    total = 0.0
    lines = math.prod(nonzero[:-1])
    n = shape[-1]
    total += lines * 1.25 * n * math.log2(max(n, 2))
    width = n // 2 + 1
    for i in range(nd - 2, -1, -1):
        lines = math.prod(nonzero[:i]) * width * math.prod(shape[i + 1:-1])
        total += lines * 2.5 * shape[i] * math.log2(max(shape[i], 2))
    return total


register_strategy("fft", FFTConvolution)
