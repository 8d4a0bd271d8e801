"""Convolution, Deconvolution and Im2col layers (Caffe semantics).

The layers hold no lowering logic: each Convolution/Deconvolution layer has a ``lowering``
attribute (a :class:`cct.lowering.LoweringStrategy`, default ``type1``) that an engine may
swap per layer, as CcT's optimizer does. Axes before ``axis`` (the channel axis) are batch
axes; every bottom/top pair shares the same weights.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from ..blob import Blob
from ..config import current
from ..device.driver import device_of
from ..errors import CctError
from ..lowering import LoweringStrategy, get_strategy
from ..lowering.engine import plan_device_lowering, plan_lowering
from ..lowering.geometry import ConvGeometry, conv_spatial_params
from ..lowering.im2col import col2im, im2col
from ..proto import caffe_pb2
from .base import Layer, register

log = logging.getLogger("cct")

_CP = caffe_pb2.ConvolutionParameter


def _check_engine(layer: Layer, engine: int) -> None:
    if engine == _CP.CUDNN:
        log.warning("layer '%s' (type %s): engine CUDNN requested; cct uses its own lowering instead",
                    layer.name, layer.type)


def _channel_axis(layer: Layer, blob: Blob, axis: int) -> int:
    if not blob.shape:
        raise layer.error("bottom must have at least one axis (the channel axis)")
    try:
        return blob.canonical_axis(axis)
    except CctError as e:
        raise layer.error(str(e)) from None


class _BaseConvolution(Layer):
    """Shared setup/reshape of Convolution and Deconvolution (Caffe's BaseConvolutionLayer)."""

    param_fields = ("convolution_param",)
    min_num_bottom = 1
    min_num_top = 1
    equal_num_bottom_top = True
    reverse: bool = False  # Deconvolution

    def __init__(self, param: caffe_pb2.LayerParameter):
        super().__init__(param)
        self._lowering: LoweringStrategy | None = None
        self._user_lowering = False
        self._device_xp = None  # the array module of blobs in a GPU's memory: no host cost model there
        self._planned_for: tuple | None = None
        self.geom: ConvGeometry | None = None
        self._geom_key: tuple | None = None
        self._itemsize = 4  # of the bottom's dtype, for the lowering's chunking (set by reshape)
        self.num = 0  # images per pass (the axes before the channel axis), set by reshape
        self._settled: tuple | None = None  # (lowering, geometry, num, itemsize) the lowering was last settled for

    @property
    def lowering(self) -> LoweringStrategy:
        """The lowering this layer runs: chosen by the engine at setup, or set by the user."""
        if self._lowering is None:
            self._plan_lowering()
        return self._lowering

    @lowering.setter
    def lowering(self, strategy: LoweringStrategy | str) -> None:
        self._lowering = get_strategy(strategy) if isinstance(strategy, str) else strategy
        self._user_lowering = True
        if self.num:
            self.prepare_lowering()  # set after setup: settle it now

    @property
    def lowering_set_by_user(self) -> bool:
        """Whether the lowering was set by hand (``layer.lowering = ...``) rather than planned."""
        return self._user_lowering

    @property
    def plan(self) -> Any:
        """The engine's :class:`~cct.lowering.optimizer.Plan` for the current shape (None for a lowering
        set by hand or one running in a GPU's memory)."""
        return getattr(self._lowering, "chosen_plan", None)

    @property
    def plan_report(self) -> str | None:
        """The plan's log line (``cct time`` prints it next to the measured time), or None."""
        return getattr(self._lowering, "plan_report", None) or None

    def _plan_lowering(self) -> None:
        if self._user_lowering or self.geom is None:
            if self._lowering is None:
                self._lowering = get_strategy("type1")
            return
        overrides = current().engine.overrides  # a config with another override for the layer replans it
        key = (self.geom, self.num, self._device_xp, overrides.get(self.name, overrides.get("*")))
        if key != self._planned_for:
            if self._device_xp is not None:
                self._lowering = plan_device_lowering(self.name, self.geom, self.num, self._device_xp,
                                                      passes=self._passes())
            else:
                self._lowering = plan_lowering(self.name, self.geom, self.num, passes=self._passes())
            self._planned_for = key

    def prepare_lowering(self) -> None:
        """Have the lowering settle its chunking and threads for the current shape, so that ``forward`` and
        ``backward`` only execute (called by ``reshape``, and by whoever changes the lowering afterwards)."""
        if self._device_xp is None and self.geom is not None:
            self._lowering.prepare_for(self.geom, self.num, self._itemsize)
            self._settled = (self._lowering, self.geom, self.num, self._itemsize)

    def _passes(self) -> tuple[str, ...]:
        """The passes the plan is priced on: no gradient to the bottom when the net says it needs none
        (``bottom_need_backward``, set by the net before setup; the layer still computes it if asked):
        for a Convolution that is ``bwd_data``, for a Deconvolution ``fwd``; a TEST-phase net's layer
        only its forward (a ``backward`` asked of it runs, on a plan priced for the forward)."""
        if self.phase == caffe_pb2.TEST:
            return ("bwd_data",) if self.reverse else ("fwd",)
        need = getattr(self, "bottom_need_backward", None)
        if need and not any(need):  # a Deconvolution's forward is the data-gradient pass
            return ("bwd_data", "bwd_weights") if self.reverse else ("fwd", "bwd_weights")
        return ("fwd", "bwd_data", "bwd_weights")

    def _geometry(self, shape: Sequence[int]) -> ConvGeometry:
        key = tuple(shape)
        if self.geom is None or self._geom_key != key:
            self.geom = ConvGeometry.from_param(self.param.convolution_param, key, reverse=self.reverse,
                                                err=self.error)
            self._geom_key = key
        return self.geom

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.convolution_param
        _check_engine(self, p.engine)
        shape = bottom[0].shape
        self.channel_axis = _channel_axis(self, bottom[0], p.axis)
        self.num_spatial = len(shape) - self.channel_axis - 1
        geom = self._geometry(shape)
        self.num_output = int(p.num_output)
        self.bias_term = bool(p.bias_term)
        weight_shape = geom.weight_shape
        bias_shape = (self.num_output,)
        if self.params_given(1 + int(self.bias_term)):
            if tuple(self.blobs[0].shape) != weight_shape:
                raise self.error(f"Incorrect weight shape: expected shape {list(weight_shape)}; "
                                 f"instead, shape was {list(self.blobs[0].shape)}")
            if self.bias_term and tuple(self.blobs[1].shape) != bias_shape:
                raise self.error(f"Incorrect bias shape: expected shape {list(bias_shape)}; "
                                 f"instead, shape was {list(self.blobs[1].shape)}")
        else:
            self.blobs = [self.make_param(weight_shape, p.weight_filler, like=bottom[0])]
            if self.bias_term:
                self.blobs.append(self.make_param(bias_shape, p.bias_filler, like=bottom[0]))

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        shape = bottom[0].shape
        if len(shape) != self.channel_axis + 1 + self.num_spatial:
            raise self.error(f"bottom num_axes may not change (was {self.channel_axis + 1 + self.num_spatial}, "
                             f"now {len(shape)})")
        want_c = self.geom.channels_out if self.reverse else self.geom.channels_in
        if shape[self.channel_axis] != want_c:
            raise self.error(f"Input size incompatible with convolution kernel: bottom has "
                             f"{shape[self.channel_axis]} channels, the weights expect {want_c}")
        for i, b in enumerate(bottom[1:], 1):
            if b.shape != shape:
                raise self.error(f"All inputs must have the same shape (bottom[0] {list(shape)}, "
                                 f"bottom[{i}] {list(b.shape)})")
        geom = self._geometry(shape)
        self.num = bottom[0].count_range(0, self.channel_axis)
        self._device_xp = bottom[0].xp if device_of(bottom[0].data).is_gpu else None
        self._itemsize = bottom[0].dtype.itemsize
        self._plan_lowering()
        if (self._lowering, geom, self.num, self._itemsize) != self._settled:  # the reshape of every forward: once
            self.prepare_lowering()
        spatial = geom.in_shape if self.reverse else geom.out_shape
        top_shape = tuple(shape[: self.channel_axis]) + (self.num_output,) + tuple(spatial)
        for t in top:
            t.reshape(top_shape)

    # shapes of the bottom/top seen by the lowering: (num, C, *spatial)
    def _conv_in_shape(self) -> tuple[int, ...]:
        g = self.geom
        return (self.num, g.channels_in) + tuple(g.in_shape)

    def _conv_out_shape(self) -> tuple[int, ...]:
        g = self.geom
        return (self.num, g.channels_out) + tuple(g.out_shape)

    def _bias_view(self, b):
        return b.reshape((self.num_output,) + (1,) * self.num_spatial)

    def _bias_grad(self, diff):
        n = self.num
        return diff.reshape(n, self.num_output, -1).sum(axis=(0, 2))


@register("Convolution")
class ConvolutionLayer(_BaseConvolution):
    """Caffe's Convolution: weights ``(num_output, C/group, *kernel)``, optional bias ``(num_output,)``."""

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        w = self.blobs[0].data
        b = self.blobs[1].data if self.bias_term else None
        lowering = self.lowering
        into = getattr(lowering, "forward_into", None)
        for bt, tp in zip(bottom, top):
            x = bt.data.reshape(self._conv_in_shape())
            if into is not None and tp.data.flags.c_contiguous:  # straight into the top blob
                into(x, w, b, self.geom, tp.data.reshape(self._conv_out_shape()))
                continue
            y = lowering.forward(x, w, b, self.geom)
            tp.data[...] = y.reshape(tp.shape)

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        w = self.blobs[0].data
        pw = self.param_propagate_down[0]
        pb = self.bias_term and self.param_propagate_down[1]
        into = getattr(self.lowering, "backward_into", None)
        for i, (tp, bt) in enumerate(zip(top, bottom)):
            dy = tp.diff.reshape(self._conv_out_shape())
            want_dx = i < len(propagate_down) and propagate_down[i]
            if into is not None and all(a.flags.c_contiguous for a in (tp.diff, bt.diff, self.blobs[0].diff)) \
                    and (not pb or self.blobs[1].diff.flags.c_contiguous):
                # one pass over the batch: weight, bias and data gradients per chunk (one lowering each)
                into(dy, bt.data.reshape(self._conv_in_shape()) if pw else None, w, self.geom,
                     dw=self.blobs[0].diff if pw else None, db=self.blobs[1].diff if pb else None,
                     dx=bt.diff.reshape(self._conv_in_shape()) if want_dx else None)
                continue
            if pw:
                geom = self.geom if pb else dataclasses.replace(self.geom, bias_term=False)
                dw, db = self.lowering.backward_weights(dy, bt.data.reshape(self._conv_in_shape()), geom)
                self.blobs[0].diff += dw.reshape(self.blobs[0].shape)
                if pb:
                    self.blobs[1].diff += db
            elif pb:
                self.blobs[1].diff += self._bias_grad(tp.diff)
            if i < len(propagate_down) and propagate_down[i]:
                dx = self.lowering.backward_data(dy, w, self.geom)
                bt.diff[...] = dx.reshape(bt.shape)


@register("Deconvolution")
class DeconvolutionLayer(_BaseConvolution):
    """Caffe's Deconvolution (transposed convolution): weights ``(C, num_output/group, *kernel)``.

    Output size ``s * (in - 1) + d * (k - 1) + 1 - 2p``; forward = the convolution's data
    gradient, backward to the bottom = the convolution's forward.
    """

    reverse = True

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        w = self.blobs[0].data
        for bt, tp in zip(bottom, top):
            x = bt.data.reshape(self._conv_out_shape())
            y = self.lowering.backward_data(x, w, self.geom)
            tp.data[...] = y.reshape(tp.shape)
            if self.bias_term:
                out = tp.data.reshape((self.num, self.num_output) + tuple(self.geom.in_shape))
                out += self._bias_view(self.blobs[1].data)

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        w = self.blobs[0].data
        pw = self.param_propagate_down[0]
        pb = self.bias_term and self.param_propagate_down[1]
        wgeom = dataclasses.replace(self.geom, bias_term=False)
        for i, (tp, bt) in enumerate(zip(top, bottom)):
            dtop = tp.diff.reshape(self._conv_in_shape())
            if pb:
                self.blobs[1].diff += self._bias_grad(tp.diff)
            if pw:
                dw, _ = self.lowering.backward_weights(bt.data.reshape(self._conv_out_shape()), dtop, wgeom)
                self.blobs[0].diff += dw.reshape(self.blobs[0].shape)
            if i < len(propagate_down) and propagate_down[i]:
                dx = self.lowering.forward(dtop, w, None, wgeom)
                bt.diff[...] = dx.reshape(bt.shape)


@register("Im2col")
class Im2colLayer(Layer):
    """Caffe's Im2col: top ``(*lead, C * prod(kernel), *out)``, channel-major rows as in Caffe's column buffer."""

    param_fields = ("convolution_param",)
    exact_num_bottom = 1
    exact_num_top = 1

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.convolution_param
        _check_engine(self, p.engine)
        for field in ("num_output", "group", "weight_filler", "bias_filler"):
            if p.HasField(field):
                log.warning("layer '%s' (type Im2col) ignores convolution_param.%s (Caffe ignores it too)",
                            self.name, field)
        shape = bottom[0].shape
        self.channel_axis = _channel_axis(self, bottom[0], p.axis)
        self.num_spatial = len(shape) - self.channel_axis - 1
        if self.num_spatial < 1:
            raise self.error(f"needs at least one spatial axis after the channel axis {self.channel_axis} "
                             f"(bottom shape {list(shape)})")
        self.sp = conv_spatial_params(p, self.num_spatial, err=self.error)

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        shape = bottom[0].shape
        if len(shape) != self.channel_axis + 1 + self.num_spatial:
            raise self.error("bottom num_axes may not change")
        ca = self.channel_axis
        self.in_shape = tuple(shape[ca + 1:])
        sp = self.sp
        out = []
        for i, k, p, s, d in zip(self.in_shape, sp.kernel, sp.pad, sp.stride, sp.dilation):
            a = i + 2 * p - (d * (k - 1) + 1)
            q = abs(a) // s
            o = (q if a >= 0 else -q) + 1
            if o < 0:
                raise self.error(f"kernel larger than the padded input {list(self.in_shape)}")
            out.append(o)
        self.out_shape = tuple(out)
        self.num = bottom[0].count_range(0, ca)
        self.channels = shape[ca]
        kp = 1
        for k in sp.kernel:
            kp *= k
        top[0].reshape(tuple(shape[:ca]) + (self.channels * kp,) + self.out_shape)

    def _col_shape(self) -> tuple[int, ...]:
        return (self.num, self.channels) + tuple(self.sp.kernel) + self.out_shape

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        x = bottom[0].data.reshape((self.num, self.channels) + self.in_shape)
        sp = self.sp
        im2col(x, sp.kernel, sp.pad, sp.stride, sp.dilation, self.out_shape,
               out=top[0].data.reshape(self._col_shape()))

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if not propagate_down[0]:
            return
        sp = self.sp
        col = top[0].diff.reshape(self._col_shape())
        dx = col2im(col, self.in_shape, sp.kernel, sp.pad, sp.stride, sp.dilation)
        bottom[0].diff[...] = dx.reshape(bottom[0].shape)
