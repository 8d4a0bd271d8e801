"""Normalisation layers: BatchNorm, Scale, Bias, MVN, with BVLC Caffe's exact semantics."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..blob import Blob
from ..errors import CctError
from ..proto import caffe_pb2
from .base import Layer, register


def _prod(dims) -> int:
    return int(np.prod(dims, dtype=np.int64))


@register("BatchNorm")
class BatchNormLayer(Layer):
    """Caffe's BatchNorm: normalise each channel (axis 1) by its mean and variance.

    Three blobs: running mean (C,), running variance (C,) stored unbiased (x m/(m-1)),
    and the moving-average normaliser (1,). In batch-statistics mode the forward pass
    updates them (factor = factor * maf + 1, mean = maf * mean + batch_mean, var = maf * var +
    unbiased batch_var); in global-statistics mode (``use_global_stats``, default: TEST phase)
    the running values divided by the normaliser (0 -> 0) are used. The output uses the biased
    batch variance: y = (x - mean) / sqrt(var + eps).

    These blobs are NOT learnable: as Caffe does, the layer appends ``param { lr_mult: 0 }``
    for each of them to its LayerParameter (and rejects a non-zero ``lr_mult``), and sets
    ``param_propagate_down`` to False. The net/solver must not update them (lr_mult 0).
    """

    param_fields = ("batch_norm_param",)
    exact_num_bottom = 1
    exact_num_top = 1

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.batch_norm_param
        self.moving_average_fraction = float(p.moving_average_fraction)
        if p.HasField("use_global_stats"):
            self.use_global_stats = bool(p.use_global_stats)
        else:
            self.use_global_stats = self.phase == caffe_pb2.TEST
        self.eps = float(p.eps)
        self._check_bottom(bottom[0])
        self.channels = bottom[0].shape[1]
        if not self.params_given(3):
            self.blobs = [
                self.make_param((self.channels,), None, like=bottom[0]),
                self.make_param((self.channels,), None, like=bottom[0]),
                self.make_param((1,), None, like=bottom[0]),
            ]
        for i, (blob, n) in enumerate(zip(self.blobs, (self.channels, self.channels, 1))):
            if blob.count != n:
                raise self.error(f"parameter blob {i} has {blob.count} values, expected {n}")
        # Caffe masks the statistics from optimisation: lr_mult 0 for all three blobs.
        for i in range(len(self.blobs)):
            if len(self.param.param) == i:
                self.param.param.add().lr_mult = 0.0
            elif self.param.param[i].lr_mult != 0:
                raise self.error("cannot configure batch normalization statistics as layer parameters "
                                 f"(param {i} has lr_mult {self.param.param[i].lr_mult:g}; it must be 0)")
        self.param_propagate_down = [False] * len(self.blobs)
        self.x_norm = None
        self.std = None

    def _check_bottom(self, b: Blob) -> None:
        if b.num_axes < 2:
            raise self.error(f"bottom must have at least 2 axes (N, C, ...), got shape {list(b.shape)}")

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        self._check_bottom(bottom[0])
        if bottom[0].shape[1] != self.channels:
            raise self.error(f"bottom has {bottom[0].shape[1]} channels, the layer was set up for {self.channels}")
        top[0].reshape_like(bottom[0])

    def _view(self, arr, shape):
        n, c = shape[0], shape[1]
        return arr.reshape(n, c, _prod(shape[2:]))

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        xp = bottom[0].xp
        shape = bottom[0].shape
        x = self._view(bottom[0].data, shape)
        mean_blob, var_blob, factor_blob = self.blobs
        if self.use_global_stats:
            f = float(factor_blob.data.reshape(-1)[0])
            sf = 0.0 if f == 0 else 1.0 / f
            mean = (mean_blob.data.reshape(-1) * sf).reshape(1, -1, 1)
            var = (var_blob.data.reshape(-1) * sf).reshape(1, -1, 1)
            z = x - mean
        else:
            mean = x.mean(axis=(0, 2), keepdims=True)
            z = x - mean
            var = (z * z).mean(axis=(0, 2), keepdims=True)
            maf = self.moving_average_fraction
            factor_blob.data[...] *= maf
            factor_blob.data[...] += 1
            m = bottom[0].count // self.channels
            bias_correction = m / (m - 1) if m > 1 else 1.0
            mean_blob.data[...] = (mean_blob.data.reshape(-1) * maf + mean.reshape(-1)).reshape(mean_blob.shape)
            var_blob.data[...] = (var_blob.data.reshape(-1) * maf
                                  + var.reshape(-1) * bias_correction).reshape(var_blob.shape)
        self.std = xp.sqrt(var + self.eps)
        self.x_norm = z / self.std
        top[0].data[...] = self.x_norm.reshape(shape)

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if not propagate_down[0]:
            return
        if self.std is None:
            raise self.error("backward called before forward")
        shape = top[0].shape
        dy = self._view(top[0].diff, shape)
        if self.use_global_stats:
            dx = dy / self.std
        else:
            y = self.x_norm
            dx = (dy - dy.mean(axis=(0, 2), keepdims=True)
                  - y * (dy * y).mean(axis=(0, 2), keepdims=True)) / self.std
        bottom[0].diff[...] = dx.reshape(shape)


def _param_shape(layer: Layer, b: Blob, axis: int, num_axes: int, what: str) -> tuple[int, ...]:
    """Shape of a Scale/Bias parameter blob: bottom[0]'s axes [axis, axis + num_axes) (-1: to the end)."""
    try:
        ax = b.canonical_axis(axis)
    except CctError as e:
        raise layer.error(str(e)) from None
    if num_axes < -1:
        raise layer.error(f"num_axes must be non-negative, or -1 to extend to the end of bottom[0]; got {num_axes}")
    if num_axes >= 0 and b.num_axes < ax + num_axes:
        raise layer.error(f"{what} blob's shape extends past bottom[0]'s shape {list(b.shape)} when applied "
                          f"starting with bottom[0] axis = {ax} (num_axes {num_axes})")
    end = b.num_axes if num_axes == -1 else ax + num_axes
    return tuple(b.shape[ax:end])


def _broadcast_dims(layer: Layer, b: Blob, operand_shape: tuple[int, ...], axis: int,
                    what: str) -> tuple[int, int, int]:
    """(outer, dim, inner) for applying an operand of ``operand_shape`` to bottom ``b`` from ``axis``.

    A 0-axis (scalar) operand ignores ``axis`` (Caffe sets it to 0).
    """
    n = len(operand_shape)
    if n == 0:
        ax = 0
    else:
        try:
            ax = b.canonical_axis(axis)
        except CctError as e:
            raise layer.error(str(e)) from None
    if b.num_axes < ax + n:
        raise layer.error(f"{what} blob's shape {list(operand_shape)} extends past bottom[0]'s shape "
                          f"{list(b.shape)} when applied starting with bottom[0] axis = {ax}")
    for i in range(n):
        if b.shape[ax + i] != operand_shape[i]:
            raise layer.error(f"dimension mismatch between bottom[0] shape {list(b.shape)} at axis {ax + i} "
                              f"({b.shape[ax + i]}) and {what} shape {list(operand_shape)} at axis {i} "
                              f"({operand_shape[i]})")
    return _prod(b.shape[:ax]), _prod(operand_shape), _prod(b.shape[ax + n:])


@register("Bias")
class BiasLayer(Layer):
    """y = x + b, with b broadcast over bottom[0] from ``axis``.

    b is either a learnable blob of shape bottom[0].shape[axis : axis + num_axes]
    (num_axes -1: all remaining axes, 0: a scalar; filler default constant 0) or bottom[1].
    """

    param_fields = ("bias_param",)
    min_num_bottom = 1
    max_num_bottom = 2
    exact_num_top = 1

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.bias_param
        self.axis = int(p.axis)
        if len(bottom) == 1:
            if not self.params_given(1):
                shape = _param_shape(self, bottom[0], p.axis, p.num_axes, "bias")
                self.blobs = [self.make_param(shape, p.filler, like=bottom[0])]
            self.param_propagate_down = [True]
        else:
            self.params_given(0)

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        bias = bottom[1] if len(bottom) > 1 else self.blobs[0]
        self.dims = _broadcast_dims(self, bottom[0], bias.shape, self.axis, "bias")
        top[0].reshape_like(bottom[0])

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        o, d, i = self.dims
        bias = bottom[1] if len(bottom) > 1 else self.blobs[0]
        y = bottom[0].data.reshape(o, d, i) + bias.data.reshape(1, d, 1)
        top[0].data[...] = y.reshape(top[0].shape)

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        o, d, i = self.dims
        dy = top[0].diff
        if len(bottom) == 1:
            if self.param_propagate_down[0]:
                b = self.blobs[0]
                b.diff[...] += dy.reshape(o, d, i).sum(axis=(0, 2)).reshape(b.shape)
        elif propagate_down[1]:
            bottom[1].diff[...] = dy.reshape(o, d, i).sum(axis=(0, 2)).reshape(bottom[1].shape)
        if propagate_down[0] and bottom[0] is not top[0]:
            bottom[0].diff[...] = dy


@register("Scale")
class ScaleLayer(Layer):
    """y = x * s (+ b with ``bias_term``), s broadcast over bottom[0] from ``axis``.

    s is either a learnable blob of shape bottom[0].shape[axis : axis + num_axes]
    (num_axes -1: all remaining axes, 0: a scalar; filler default constant 1) or bottom[1].
    The optional bias has the same shape as s (filler ``bias_filler``, default constant 0) and
    is always a learnable blob (the last one).
    """

    param_fields = ("scale_param",)
    min_num_bottom = 1
    max_num_bottom = 2
    exact_num_top = 1

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.scale_param
        self.axis = int(p.axis)
        self.bias_term = bool(p.bias_term)
        one = len(bottom) == 1
        expected = int(one) + int(self.bias_term)
        if not self.params_given(expected):
            blobs = []
            if one:
                shape = _param_shape(self, bottom[0], p.axis, p.num_axes, "scale")
                filler = p.filler if p.HasField("filler") else caffe_pb2.FillerParameter(type="constant", value=1.0)
                blobs.append(self.make_param(shape, filler, like=bottom[0]))
            if self.bias_term:
                nax = bottom[1].num_axes if not one else p.num_axes
                shape = _param_shape(self, bottom[0], p.axis, nax, "bias")
                filler = p.bias_filler if p.HasField("bias_filler") else \
                    caffe_pb2.FillerParameter(type="constant", value=0.0)
                blobs.append(self.make_param(shape, filler, like=bottom[0]))
            self.blobs = blobs
        self.bias_index = len(self.blobs) - 1 if self.bias_term else None
        self.param_propagate_down = [True] * len(self.blobs)
        self._saved_input = None

    def _scale(self, bottom: Sequence[Blob]) -> Blob:
        return bottom[1] if len(bottom) > 1 else self.blobs[0]

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        self.dims = _broadcast_dims(self, bottom[0], self._scale(bottom).shape, self.axis, "scale")
        if self.bias_term:
            self.bias_dims = _broadcast_dims(self, bottom[0], self.blobs[self.bias_index].shape, self.axis, "bias")
        top[0].reshape_like(bottom[0])

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        x = bottom[0].data
        if bottom[0] is top[0]:
            # Keep the input for the scale gradient (Caffe's temp_).
            self._saved_input = x.copy()
        else:
            self._saved_input = None
        o, d, i = self.dims
        y = x.reshape(o, d, i) * self._scale(bottom).data.reshape(1, d, 1)
        if self.bias_term:
            bo, bd, bi = self.bias_dims
            y = y.reshape(bo, bd, bi)
            y += self.blobs[self.bias_index].data.reshape(1, bd, 1)
        top[0].data[...] = y.reshape(top[0].shape)

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        o, d, i = self.dims
        dy = top[0].diff
        if self.bias_term and self.param_propagate_down[self.bias_index]:
            bo, bd, bi = self.bias_dims
            b = self.blobs[self.bias_index]
            b.diff[...] += dy.reshape(bo, bd, bi).sum(axis=(0, 2)).reshape(b.shape)
        one = len(bottom) == 1
        if (one and self.param_propagate_down[0]) or (not one and propagate_down[1]):
            x = self._saved_input if self._saved_input is not None else bottom[0].data
            g = (dy.reshape(o, d, i) * x.reshape(o, d, i)).sum(axis=(0, 2))
            s = self._scale(bottom)
            if one:
                s.diff[...] += g.reshape(s.shape)
            else:
                s.diff[...] = g.reshape(s.shape)
        if propagate_down[0]:
            s = self._scale(bottom).data.reshape(1, d, 1)
            bottom[0].diff[...] = (dy.reshape(o, d, i) * s).reshape(bottom[0].shape)


@register("MVN")
class MVNLayer(Layer):
    """Mean-variance normalisation per (n, c) plane, or per item with ``across_channels``.

    y = (x - mean) / (sqrt(var) + eps) (eps OUTSIDE the sqrt, as Caffe), or x - mean without
    ``normalize_variance``. Uses Caffe's legacy num/channels view (at most 4 axes).
    Backward is Caffe's: dx = (dy - mean(dy) - y * mean(y * dy)) / (sqrt(var) + eps), which is
    the exact gradient when eps = 0 (Caffe's formula drops a factor (sqrt(var) + eps) / sqrt(var)
    on the last term; with the default eps 1e-9 the difference is far below float precision).
    """

    param_fields = ("mvn_param",)
    exact_num_bottom = 1
    exact_num_top = 1

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.mvn_param
        self.normalize_variance = bool(p.normalize_variance)
        self.across_channels = bool(p.across_channels)
        self.eps = float(p.eps)
        self.std = None

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        b = bottom[0]
        try:
            num, channels = b.num, b.channels
        except CctError as e:
            raise self.error(str(e)) from None
        self.rows = num if self.across_channels else num * channels
        self.dim = b.count // self.rows if self.rows else 0
        top[0].reshape_like(b)

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        xp = bottom[0].xp
        x = bottom[0].data.reshape(self.rows, self.dim)
        z = x - x.mean(axis=1, keepdims=True)
        if self.normalize_variance:
            var = (z * z).mean(axis=1, keepdims=True)
            self.std = xp.sqrt(var) + self.eps
            z /= self.std
        top[0].data[...] = z.reshape(top[0].shape)

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if not propagate_down[0]:
            return
        dy = top[0].diff.reshape(self.rows, self.dim)
        if self.normalize_variance:
            if self.std is None:
                raise self.error("backward called before forward")
            y = top[0].data.reshape(self.rows, self.dim)
            dx = (dy - dy.mean(axis=1, keepdims=True) - y * (y * dy).mean(axis=1, keepdims=True)) / self.std
        else:
            dx = dy - dy.mean(axis=1, keepdims=True)
        bottom[0].diff[...] = dx.reshape(bottom[0].shape)


__all__ = ["BatchNormLayer", "BiasLayer", "ScaleLayer", "MVNLayer"]
