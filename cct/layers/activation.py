"""Elementwise activation ("neuron") layers, with BVLC Caffe's exact semantics.

Every layer here takes one bottom and gives one top of the same shape, and may be used
in place (``bottom[0] is top[0]``) except AbsVal, which Caffe refuses to run in place.
Where the backward pass needs the layer's *input* and the layer runs in place, the
input is kept in a private copy during forward (Caffe does this for PReLU; for the other
layers Caffe silently reads the overwritten data, which cct does not reproduce).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from .. import kernels
from ..blob import Blob
from ..device.driver import host_kernels_usable
from ..proto import caffe_pb2
from .base import Layer, log, register

# Caffe's BNLL backward clamps the exponent at this value (kBNLL_THRESHOLD).
BNLL_THRESHOLD = 50.0


def _sigmoid(xp, x):
    """Overflow-free logistic function (Caffe's ``0.5 * tanh(0.5 x) + 0.5``)."""
    return 0.5 * xp.tanh(0.5 * x) + 0.5


def _scalar_pow(base: float, exponent: float) -> float:
    """C's pow(): NaN for a negative base with a non-integer exponent, inf for 0 ** negative."""
    if base == 0 and exponent < 0:
        return float("inf")
    if base < 0 and not float(exponent).is_integer():
        return float("nan")
    try:
        return math.pow(base, exponent)
    except OverflowError:
        return float("inf")


class NeuronLayer(Layer):
    """Base of the elementwise layers: one bottom, one top of the same shape, in-place allowed.

    Subclasses that need the forward input in backward set ``needs_input = True`` and read it
    with ``self._input(bottom)``, which returns a saved copy when the layer runs in place.
    """

    exact_num_bottom = 1
    exact_num_top = 1
    allow_in_place = True
    needs_input = False

    def __init__(self, param: caffe_pb2.LayerParameter):
        super().__init__(param)
        self._saved_input = None

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        """Reject in-place use where Caffe does."""
        if not self.allow_in_place and bottom[0] is top[0]:
            raise self.error("does not allow in-place computation (bottom and top are the same blob)")

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        """Top takes the bottom's shape."""
        top[0].reshape_like(bottom[0])

    def _save_input(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        """Call at the start of forward: keep a copy of the input if it is about to be overwritten."""
        if self.needs_input_now() and bottom[0] is top[0]:
            x = bottom[0].data
            saved = self._saved_input
            if saved is None or type(saved) is not type(x) or saved.shape != x.shape or saved.dtype != x.dtype:
                self._saved_input = x.copy()
            else:
                self._saved_input[...] = x
        else:
            self._saved_input = None

    def needs_input_now(self) -> bool:
        """Whether backward needs the forward input (may depend on the parameters)."""
        return self.needs_input

    def _input(self, bottom: Sequence[Blob]):
        """The forward input: the saved copy when run in place, else the bottom data."""
        return self._saved_input if self._saved_input is not None else bottom[0].data


@register("ReLU")
class ReLULayer(NeuronLayer):
    """y = max(x, 0) + negative_slope * min(x, 0); dy/dx = 1 for x > 0, negative_slope for x <= 0."""

    param_fields = ("relu_param",)

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        super().layer_setup(bottom, top)
        p = self.param.relu_param
        self.negative_slope = float(p.negative_slope)
        if p.engine == caffe_pb2.ReLUParameter.CUDNN:
            log.warning("layer '%s' (ReLU): engine CUDNN requested; cct uses its own implementation", self.name)

    def needs_input_now(self) -> bool:
        # With a non-negative slope, sign(y) == sign(x) for x != 0, so y (in place) suffices.
        return self.negative_slope < 0

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        self._save_input(bottom, top)
        xp = bottom[0].xp
        x = bottom[0].data
        ke = kernels.get("elementwise") if host_kernels_usable(x, top[0].data, contiguous=True) else None
        if ke is not None:  # compiled CPU kernel: same bits, fewer passes over memory
            ke.relu_forward(x, top[0].data, self.negative_slope)
        elif self.negative_slope == 0:
            xp.maximum(x, 0, out=top[0].data)
        else:
            top[0].data[...] = xp.where(x > 0, x, x * self.negative_slope)

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if not propagate_down[0]:
            return
        xp = bottom[0].xp
        x = self._input(bottom)
        dy = top[0].diff
        ke = kernels.get("elementwise") if host_kernels_usable(x, dy, bottom[0].diff, contiguous=True) else None
        if ke is not None:
            ke.relu_backward(x, dy, bottom[0].diff, self.negative_slope)
        elif self.negative_slope == 0:
            bottom[0].diff[...] = xp.where(x > 0, dy, 0)
        else:
            bottom[0].diff[...] = xp.where(x > 0, dy, dy * self.negative_slope)


@register("PReLU")
class PReLULayer(NeuronLayer):
    """Parametric ReLU: y = max(x, 0) + a_c * min(x, 0), slopes ``a`` per channel (axis 1) or shared."""

    param_fields = ("prelu_param",)
    needs_input = True

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        super().layer_setup(bottom, top)
        if bottom[0].num_axes < 2:
            raise self.error(f"bottom must have at least 2 axes, got shape {list(bottom[0].shape)}")
        p = self.param.prelu_param
        self.channel_shared = bool(p.channel_shared)
        channels = bottom[0].channels
        if not self.params_given(1):
            if p.HasField("filler"):
                filler = p.filler
            else:
                filler = caffe_pb2.FillerParameter(type="constant", value=0.25)
            shape = () if self.channel_shared else (channels,)
            self.blobs = [self.make_param(shape, filler, like=bottom[0])]
        expected = 1 if self.channel_shared else channels
        if self.blobs[0].count != expected:
            raise self.error(f"negative slope size {self.blobs[0].count} is inconsistent with the prototxt "
                             f"config (channel_shared: {str(self.channel_shared).lower()}, expected {expected})")
        self.param_propagate_down = [True]

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        if bottom[0].num_axes < 2:
            raise self.error(f"bottom must have at least 2 axes, got shape {list(bottom[0].shape)}")
        if not self.channel_shared and bottom[0].channels != self.blobs[0].count:
            raise self.error(f"bottom has {bottom[0].channels} channels, slopes were set up for "
                             f"{self.blobs[0].count}")
        super().reshape(bottom, top)

    def _slopes(self, bottom: Blob):
        a = self.blobs[0].data
        if self.channel_shared:
            return a.reshape(())
        shape = [1] * bottom.num_axes
        shape[1] = bottom.shape[1]
        return a.reshape(shape)

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        self._save_input(bottom, top)
        xp = bottom[0].xp
        x = bottom[0].data
        top[0].data[...] = xp.where(x > 0, x, x * self._slopes(bottom[0]))

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        xp = bottom[0].xp
        x = self._input(bottom)
        dy = top[0].diff
        if self.param_propagate_down[0]:
            g = xp.where(x > 0, 0, dy * x)
            slope = self.blobs[0]
            if self.channel_shared:
                slope.diff[...] += g.sum()
            else:
                axes = (0,) + tuple(range(2, g.ndim))
                slope.diff[...] += g.sum(axis=axes).reshape(slope.shape)
        if propagate_down[0]:
            bottom[0].diff[...] = xp.where(x > 0, dy, dy * self._slopes(bottom[0]))


@register("ELU")
class ELULayer(NeuronLayer):
    """y = x for x > 0, alpha * (exp(x) - 1) otherwise."""

    param_fields = ("elu_param",)

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        super().layer_setup(bottom, top)
        self.alpha = float(self.param.elu_param.alpha)

    def needs_input_now(self) -> bool:
        # For alpha >= 0, y > 0 exactly where x > 0, and dy/dx = alpha + y for x <= 0.
        return self.alpha < 0

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        self._save_input(bottom, top)
        xp = bottom[0].xp
        x = bottom[0].data
        neg = self.alpha * (xp.exp(xp.minimum(x, 0)) - 1)
        top[0].data[...] = xp.where(x > 0, x, neg)

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if not propagate_down[0]:
            return
        xp = bottom[0].xp
        x = self._input(bottom)
        y = top[0].data
        dy = top[0].diff
        bottom[0].diff[...] = xp.where(x > 0, dy, dy * (self.alpha + y))


@register("Sigmoid")
class SigmoidLayer(NeuronLayer):
    """y = 1 / (1 + exp(-x)); dy/dx = y (1 - y)."""

    param_fields = ("sigmoid_param",)

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        super().layer_setup(bottom, top)
        if self.param.sigmoid_param.engine == caffe_pb2.SigmoidParameter.CUDNN:
            log.warning("layer '%s' (Sigmoid): engine CUDNN requested; cct uses its own implementation", self.name)

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        top[0].data[...] = _sigmoid(bottom[0].xp, bottom[0].data)

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if propagate_down[0]:
            y = top[0].data
            bottom[0].diff[...] = top[0].diff * y * (1 - y)


@register("TanH")
class TanHLayer(NeuronLayer):
    """y = tanh(x); dy/dx = 1 - y^2."""

    param_fields = ("tanh_param",)

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        super().layer_setup(bottom, top)
        if self.param.tanh_param.engine == caffe_pb2.TanHParameter.CUDNN:
            log.warning("layer '%s' (TanH): engine CUDNN requested; cct uses its own implementation", self.name)

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        bottom[0].xp.tanh(bottom[0].data, out=top[0].data)

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if propagate_down[0]:
            y = top[0].data
            bottom[0].diff[...] = top[0].diff * (1 - y * y)


@register("AbsVal")
class AbsValLayer(NeuronLayer):
    """y = |x|; dy/dx = sign(x) (0 at 0). Like Caffe, refuses in-place use."""

    allow_in_place = False

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        bottom[0].xp.abs(bottom[0].data, out=top[0].data)

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if propagate_down[0]:
            xp = bottom[0].xp
            bottom[0].diff[...] = top[0].diff * xp.sign(bottom[0].data)


@register("Power")
class PowerLayer(NeuronLayer):
    """y = (shift + scale * x) ^ power.

    Caffe's special cases: if ``power * scale == 0`` the output is the constant
    ``1`` (power 0) or ``shift ^ power`` and the gradient is 0; for power 1 the gradient is
    the constant ``scale``. Otherwise dy/dx = power * scale * (shift + scale x)^(power - 1)
    (Caffe computes it as ``power * scale * y / (shift + scale x)``, equal except where the
    base is 0, where Caffe produces 0/0).
    """

    param_fields = ("power_param",)

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        super().layer_setup(bottom, top)
        p = self.param.power_param
        self.power = float(p.power)
        self.scale = float(p.scale)
        self.shift = float(p.shift)
        self.diff_scale = self.power * self.scale

    def needs_input_now(self) -> bool:
        return not (self.diff_scale == 0 or self.power == 1)

    def _base(self, x):
        b = x
        if self.scale != 1:
            b = b * self.scale
        if self.shift != 0:
            b = b + self.shift
        return b

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        self._save_input(bottom, top)
        xp = bottom[0].xp
        if self.diff_scale == 0:
            top[0].data[...] = 1.0 if self.power == 0 else _scalar_pow(self.shift, self.power)
            return
        b = self._base(bottom[0].data)
        if self.power == 1:
            top[0].data[...] = b
        else:
            top[0].data[...] = xp.power(b, bottom[0].dtype.type(self.power))

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if not propagate_down[0]:
            return
        xp = bottom[0].xp
        dy = top[0].diff
        if self.diff_scale == 0 or self.power == 1:
            bottom[0].diff[...] = dy * self.diff_scale
            return
        b = self._base(self._input(bottom))
        if self.power == 2:
            grad = b * self.diff_scale
        else:
            grad = xp.power(b, bottom[0].dtype.type(self.power - 1)) * self.diff_scale
        bottom[0].diff[...] = dy * grad


@register("Exp")
class ExpLayer(NeuronLayer):
    """y = base ^ (shift + scale * x); base -1 means e. dy/dx = y * scale * ln(base)."""

    param_fields = ("exp_param",)

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        super().layer_setup(bottom, top)
        p = self.param.exp_param
        base = float(p.base)
        if base != -1 and not base > 0:
            raise self.error(f"exp_param.base must be strictly positive (or -1 for e), got {base:g}")
        log_base = 1.0 if base == -1 else math.log(base)
        if not math.isfinite(log_base):
            raise self.error(f"exp_param.base {base:g} gives a non-finite log(base)")
        self.inner_scale = log_base * float(p.scale)
        shift = float(p.shift)
        if shift == 0:
            self.outer_scale = 1.0
        else:
            self.outer_scale = math.exp(shift) if base == -1 else math.pow(base, shift)

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        xp = bottom[0].xp
        x = bottom[0].data
        y = xp.exp(x if self.inner_scale == 1 else x * self.inner_scale)
        if self.outer_scale != 1:
            y *= self.outer_scale
        top[0].data[...] = y

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if propagate_down[0]:
            g = top[0].data * top[0].diff
            if self.inner_scale != 1:
                g *= self.inner_scale
            bottom[0].diff[...] = g


@register("Log")
class LogLayer(NeuronLayer):
    """y = log_base(shift + scale * x); base -1 means e. dy/dx = scale / (ln(base) (shift + scale x))."""

    param_fields = ("log_param",)
    needs_input = True

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        super().layer_setup(bottom, top)
        p = self.param.log_param
        base = float(p.base)
        if base != -1 and not base > 0:
            raise self.error(f"log_param.base must be strictly positive (or -1 for e), got {base:g}")
        log_base = 1.0 if base == -1 else math.log(base)
        if not math.isfinite(log_base) or log_base == 0:
            raise self.error(f"log_param.base {base:g} gives log(base) = {log_base:g}; 1/log(base) is not finite")
        self.base_scale = 1.0 / log_base
        self.input_scale = float(p.scale)
        self.input_shift = float(p.shift)
        self.backward_num_scale = self.input_scale / log_base

    def _base(self, x):
        b = x
        if self.input_scale != 1:
            b = b * self.input_scale
        if self.input_shift != 0:
            b = b + self.input_shift
        return b

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        self._save_input(bottom, top)
        xp = bottom[0].xp
        y = xp.log(self._base(bottom[0].data))
        if self.base_scale != 1:
            y *= self.base_scale
        top[0].data[...] = y

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if propagate_down[0]:
            b = self._base(self._input(bottom))
            bottom[0].diff[...] = top[0].diff * self.backward_num_scale / b


@register("BNLL")
class BNLLLayer(NeuronLayer):
    """Binomial normal log likelihood: y = log(1 + exp(x)), computed without overflow.

    Backward as Caffe: dy/dx = e / (e + 1) with e = exp(min(x, 50)).
    """

    needs_input = True

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        self._save_input(bottom, top)
        xp = bottom[0].xp
        x = bottom[0].data
        # x > 0: x + log(1 + exp(-x)); else log(1 + exp(x)); both = max(x, 0) + log1p(exp(-|x|)).
        top[0].data[...] = xp.maximum(x, 0) + xp.log1p(xp.exp(-xp.abs(x)))

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if propagate_down[0]:
            xp = bottom[0].xp
            e = xp.exp(xp.minimum(self._input(bottom), BNLL_THRESHOLD))
            bottom[0].diff[...] = top[0].diff * e / (e + 1)


@register("Threshold")
class ThresholdLayer(NeuronLayer):
    """y = 1 if x > threshold else 0. Forward only: Caffe has no backward for it."""

    param_fields = ("threshold_param",)

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        super().layer_setup(bottom, top)
        self.threshold = float(self.param.threshold_param.threshold)

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        x = bottom[0].data
        top[0].data[...] = x > x.dtype.type(self.threshold)

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if any(propagate_down):
            raise self.error("has no backward pass (Caffe's ThresholdLayer::Backward is not implemented)")


@register("Dropout")
class DropoutLayer(NeuronLayer):
    """TRAIN: y = x * mask, mask = 1 / (1 - p) with probability 1 - p, else 0; TEST: y = x.

    The mask is drawn where the blob lives from the layer's counter-based stream (:mod:`cct.device.random`,
    a float32 uniform below 1 - p keeps the element) into a buffer allocated at reshape; backward reuses it.
    """

    param_fields = ("dropout_param",)

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        super().layer_setup(bottom, top)
        ratio = float(self.param.dropout_param.dropout_ratio)
        if not 0.0 <= ratio < 1.0:
            raise self.error(f"dropout_ratio must be in [0, 1), got {ratio:g}")
        self.dropout_ratio = ratio
        self.scale = 1.0 / (1.0 - ratio)
        self.mask = None
        self._drawn = False
        if self.draws_random():
            self.random_stream(bottom[0].device)

    def draws_random(self) -> bool:
        return self.phase == caffe_pb2.TRAIN

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        super().reshape(bottom, top)
        x = bottom[0].data
        mask = self.mask
        if self.draws_random() and (mask is None or type(mask) is not type(x) or mask.shape != x.shape
                                    or mask.dtype != x.dtype):
            self.mask = bottom[0].xp.empty(x.shape, dtype=x.dtype)
            self._drawn = False

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        x = bottom[0].data
        if self.phase == caffe_pb2.TRAIN:
            self.random.bernoulli_(self.mask, 1.0 - self.dropout_ratio, self.scale)
            self._drawn = True
            bottom[0].xp.multiply(x, self.mask, out=top[0].data)
        elif bottom[0] is not top[0]:
            top[0].data[...] = x

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if not propagate_down[0]:
            return
        if self.phase == caffe_pb2.TRAIN:
            if not self._drawn or self.mask.shape != top[0].diff.shape:
                raise self.error("backward called before forward")
            top[0].xp.multiply(top[0].diff, self.mask, out=bottom[0].diff)
        elif bottom[0] is not top[0]:
            bottom[0].diff[...] = top[0].diff


@register("Clip")
class ClipLayer(NeuronLayer):
    """y = max(min, min(x, max)); the gradient passes where min <= x <= max."""

    param_fields = ("clip_param",)
    needs_input = True

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        super().layer_setup(bottom, top)
        p = self.param.clip_param
        for f in ("min", "max"):
            if not p.HasField(f):
                raise self.error(f"clip_param.{f} is required")
        self.min = float(p.min)
        self.max = float(p.max)

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        self._save_input(bottom, top)
        xp = bottom[0].xp
        x = bottom[0].data
        lo, hi = x.dtype.type(self.min), x.dtype.type(self.max)
        top[0].data[...] = xp.maximum(lo, xp.minimum(x, hi))

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if propagate_down[0]:
            xp = bottom[0].xp
            x = self._input(bottom)
            lo, hi = x.dtype.type(self.min), x.dtype.type(self.max)
            bottom[0].diff[...] = xp.where((x >= lo) & (x <= hi), top[0].diff, 0)


@register("Swish")
class SwishLayer(NeuronLayer):
    """y = x * sigmoid(beta x); dy/dx = beta y + s (1 - beta y) with s = sigmoid(beta x)."""

    param_fields = ("swish_param",)

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        super().layer_setup(bottom, top)
        self.beta = float(self.param.swish_param.beta)
        self.sig = None

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        xp = bottom[0].xp
        x = bottom[0].data
        self.sig = _sigmoid(xp, x * self.beta)
        top[0].data[...] = x * self.sig

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if propagate_down[0]:
            by = top[0].data * self.beta
            bottom[0].diff[...] = top[0].diff * (by + self.sig * (1 - by))


__all__ = [
    "NeuronLayer", "ReLULayer", "PReLULayer", "ELULayer", "SigmoidLayer", "TanHLayer", "AbsValLayer",
    "PowerLayer", "ExpLayer", "LogLayer", "BNLLLayer", "ThresholdLayer", "DropoutLayer", "ClipLayer",
    "SwishLayer",
]
