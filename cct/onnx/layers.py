"""One ONNX converter per exportable Caffe layer type, each reproducing Caffe's semantics exactly.

A converter gets a :class:`LayerContext` (the built cct layer, its bottoms' ONNX value names and
shapes, the names its tops must get) and appends nodes to the context's :class:`GraphBuilder`.
Where ONNX cannot express a layer (or one of its settings) exactly, the converter raises
``ctx.refuse(reason)``: a :class:`~cct.errors.LayerError` naming the layer.

:data:`CONVERTERS` maps layer type -> converter; :data:`REFUSED` maps the layer types that are never
exportable to the reason.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..device.driver import to_host
from ..errors import LayerError
from ..layers.base import Layer
from ..proto import caffe_pb2
from .graph import GraphBuilder

_POOL = caffe_pb2.PoolingParameter
_LRN = caffe_pb2.LRNParameter
_ELT = caffe_pb2.EltwiseParameter
_RED = caffe_pb2.ReductionParameter
BATCH_DIM = "N"  # the symbolic batch axis of a --dynamic_batch export


@dataclass
class LayerContext:
    """What a converter needs: the graph, the built layer, its bottom/top value names and shapes."""

    g: GraphBuilder
    layer: Layer
    bottoms: list[str]
    tops: list[str]
    bottom_shapes: list[tuple[int, ...]]
    top_shapes: list[tuple[int, ...]]
    dynamic_batch: bool

    @property
    def lp(self) -> caffe_pb2.LayerParameter:
        """The layer's LayerParameter."""
        return self.layer.param

    @property
    def name(self) -> str:
        """The layer's name (used for node and initializer names)."""
        return self.layer.param.name

    def refuse(self, why: str) -> LayerError:
        """The clean error for a layer (or setting) ONNX cannot express exactly."""
        return LayerError(self.lp.name, self.lp.type, f"cannot be exported to ONNX exactly: {why}")

    def blob(self, i: int) -> np.ndarray:
        """The layer's i-th parameter blob as a float32 numpy array (bits unchanged)."""
        return np.asarray(to_host(self.layer.blobs[i].data), dtype=np.float32)

    def param(self, i: int, shape=None) -> str:
        """An initializer holding parameter blob ``i`` (optionally reshaped, values unchanged)."""
        arr = self.blob(i)
        return self.g.const(f"{self.name}.blobs.{i}", arr if shape is None else arr.reshape(shape))

    def scalar(self, hint: str, value: float) -> str:
        """A float32 scalar initializer."""
        return self.g.const(f"{self.name}.{hint}", np.float32(value))

    def fixes_batch(self, why: str) -> None:
        """Refuse under ``dynamic_batch`` where the exported form would pin the batch size."""
        if self.dynamic_batch:
            raise self.refuse(f"{why}, so the batch size cannot be dynamic (export without --dynamic_batch)")

    def node(self, op: str, inputs: list[str], out: int | None = None, **attrs) -> str:
        """One node named after the layer; its output is top ``out`` or a fresh temporary value."""
        return self.g.one(op, inputs, self.tops[out] if out is not None else None, name=self.name, **attrs)


Converter = Callable[[LayerContext], None]


def _axis(axis: int, ndim: int) -> int:
    return axis + ndim if axis < 0 else axis


def _reduce(c: LayerContext, op: str, x: str, axes: list[int], keepdims: int, out: int | None = None) -> str:
    """A Reduce* node over ``axes`` (axes an attribute before opset 18, an input from 18; ReduceSum from 13)."""
    if c.g.opset >= 18 or op == "ReduceSum":
        return c.node(op, [x, c.g.ints(f"{c.name}.axes", axes)], out, keepdims=keepdims)
    return c.node(op, [x], out, axes=axes, keepdims=keepdims)


def _reshape(c: LayerContext, x: str, shape: list[int], out: int | None = None) -> str:
    return c.node("Reshape", [x, c.g.ints(f"{c.name}.shape", shape)], out)


def _batch_shape(c: LayerContext, shape: tuple[int, ...]) -> list[int]:
    """``shape`` with the batch axis written as 0 (copy the input's) so a dynamic batch flows through."""
    return [0] + list(shape[1:]) if shape else []


# -- vision -------------------------------------------------------------------------------------------
def _conv(c: LayerContext) -> None:
    p = c.lp.convolution_param
    if _axis(p.axis, len(c.bottom_shapes[0])) != 1:
        raise c.refuse(f"convolution_param.axis {p.axis} (ONNX convolves with channels on axis 1)")
    g = c.layer.geom  # the geometry cct convolves with (Caffe's kernel/pad/stride/dilation rules applied)
    kernel, stride, pad, dil = (list(map(int, v)) for v in (g.kernel, g.stride, g.pad, g.dilation))
    inputs = [c.bottoms[0], c.param(0)]
    if p.bias_term:
        inputs.append(c.param(1))
    op = "Conv" if c.lp.type == "Convolution" else "ConvTranspose"
    c.node(op, inputs, 0, kernel_shape=kernel, strides=stride, pads=pad + pad, dilations=dil, group=int(g.group))


def _pool(c: LayerContext) -> None:
    p = c.lp.pooling_param
    if len(c.tops) > 1:
        raise c.refuse("the MAX pooling mask top (per-plane argmax index, Caffe's tie rule) has no ONNX output")
    if p.pool not in (_POOL.MAX, _POOL.AVE):
        raise c.refuse("STOCHASTIC pooling samples at random (and Caffe has no CPU forward for it)")
    shape = c.bottom_shapes[0]
    if len(shape) != 4:
        raise c.refuse(f"pooling of a {len(shape)}-axis blob")
    if p.global_pooling:
        c.node("GlobalMaxPool" if p.pool == _POOL.MAX else "GlobalAveragePool", [c.bottoms[0]], 0)
        return
    _pool_windows(c, c.bottoms[0], shape, c.layer, p.pool == _POOL.MAX, c.top_shapes[0][2:], 0)


def _pool_windows(c: LayerContext, x: str, shape: tuple[int, ...], pool, is_max: bool, out_hw,
                  out: int | None) -> str:
    """Caffe's MAX/AVE pooling windows of the built Pooling layer ``pool`` (kernel, stride, pad) on ``x``.

    Caffe's output size (ceil or floor rounding, the last window dropped when it starts in the padding)
    is written as explicit end padding with floor rounding: the same windows, no ceil_mode rule."""
    (kh, kw), (sh, sw), (ph, pw) = pool.kernel, pool.stride, pool.pad
    (oh, ow), (h, w) = out_hw, shape[2:]
    if (oh - 1) * sh - ph >= h or (ow - 1) * sw - pw >= w:
        raise c.refuse("the last pooling window starts past the input (Caffe pools an empty window there)")
    if is_max:
        end_h, end_w = max(0, (oh - 1) * sh + kh - h - ph), max(0, (ow - 1) * sw + kw - w - pw)
        return c.node("MaxPool", [x], out, kernel_shape=[kh, kw], strides=[sh, sw], pads=[ph, pw, end_h, end_w])
    # AVE: Caffe divides by the window clipped to the padded input [-pad, H + pad): zero-pad explicitly
    # (those cells count), then pool without counting ONNX's own end padding (the ceil overhang).
    if ph or pw:
        x = c.g.one("Pad", [x, c.g.ints(f"{c.name}.pads", [0, 0, ph, pw, 0, 0, ph, pw])], name=f"{c.name}/pad",
                    mode="constant")
    end_h, end_w = max(0, (oh - 1) * sh + kh - h - 2 * ph), max(0, (ow - 1) * sw + kw - w - 2 * pw)
    return c.node("AveragePool", [x], out, kernel_shape=[kh, kw], strides=[sh, sw], pads=[0, 0, end_h, end_w],
                  count_include_pad=0)


def _spp(c: LayerContext) -> None:
    """Caffe's SPP: per pyramid level one Pooling (its built layer's windows), flattened, concatenated."""
    if c.lp.spp_param.pool == caffe_pb2.SPPParameter.STOCHASTIC:
        raise c.refuse("STOCHASTIC pooling samples at random (and Caffe has no CPU forward for it)")
    shape = c.bottom_shapes[0]
    is_max = c.lp.spp_param.pool == caffe_pb2.SPPParameter.MAX
    if len(c.layer.levels) == 1:
        pool, out = c.layer.levels[0]
        _pool_windows(c, c.bottoms[0], shape, pool, is_max, out.shape[2:], 0)
        return
    flat = [_reshape(c, _pool_windows(c, c.bottoms[0], shape, pool, is_max, out.shape[2:], None), [0, -1])
            for pool, out in c.layer.levels]
    c.node("Concat", flat, 0, axis=1)


def _lrn(c: LayerContext) -> None:
    p = c.lp.lrn_param
    size, alpha, beta = int(p.local_size), float(p.alpha), float(p.beta)
    x = c.bottoms[0]
    if p.norm_region == _LRN.ACROSS_CHANNELS:
        # ONNX LRN: x / (bias + alpha/size * sum of squares over the centred window)^beta, as Caffe.
        c.node("LRN", [x], 0, size=size, alpha=alpha, beta=beta, bias=float(p.k))
        return
    # WITHIN_CHANNEL: scale = 1 + alpha * (n x n average of x^2 over a zero-padded window), always / n^2.
    pad = (size - 1) // 2
    sq = c.node("Mul", [x, x])
    avg = c.node("AveragePool", [sq], kernel_shape=[size, size], strides=[1, 1], pads=[pad] * 4, count_include_pad=1)
    scale = c.node("Add", [c.node("Mul", [avg, c.scalar("alpha", alpha)]), c.scalar("one", 1.0)])
    c.node("Mul", [x, c.node("Pow", [scale, c.scalar("neg_beta", -beta)])], 0)


def _inner_product(c: LayerContext) -> None:
    p = c.lp.inner_product_param
    shape = c.bottom_shapes[0]
    axis = _axis(p.axis, len(shape))
    k = int(np.prod(shape[axis:], dtype=np.int64))
    if axis == 0:
        c.fixes_batch("InnerProduct with axis 0 flattens the batch axis")
    if axis == 1:
        flat = c.g.one("Flatten", [c.bottoms[0]], name=f"{c.name}/flatten", axis=1)
        inputs = [flat, c.param(0)] + ([c.param(1)] if p.bias_term else [])
        c.node("Gemm", inputs, 0, transB=0 if p.transpose else 1)
        return
    flat = c.g.one("Reshape", [c.bottoms[0], c.g.ints(f"{c.name}.shape", [0] * axis + [k])], name=f"{c.name}/reshape")
    wk = c.param(0)  # (K, N) with transpose, else (N, K): a Transpose node keeps the stored layout and bits
    if not p.transpose:
        wk = c.g.one("Transpose", [wk], name=f"{c.name}/weight_t", perm=[1, 0])
    y = c.node("MatMul", [flat, wk], None if p.bias_term else 0)
    if p.bias_term:
        c.node("Add", [y, c.param(1)], 0)


# -- activations ---------------------------------------------------------------------------------------
def _relu(c: LayerContext) -> None:
    slope = float(c.lp.relu_param.negative_slope)
    if slope == 0:
        c.node("Relu", c.bottoms[:1], 0)
    else:
        c.node("LeakyRelu", c.bottoms[:1], 0, alpha=slope)


def _prelu(c: LayerContext) -> None:
    trailing = len(c.bottom_shapes[0]) - 2
    slope = c.blob(0)
    shape = (1,) if c.lp.prelu_param.channel_shared else (slope.size,) + (1,) * max(trailing, 0)
    c.node("PRelu", [c.bottoms[0], c.param(0, shape)], 0)


def _unary(op: str, **attrs) -> Converter:
    def convert(c: LayerContext) -> None:
        c.node(op, c.bottoms[:1], 0, **attrs)

    return convert


def _elu(c: LayerContext) -> None:
    c.node("Elu", c.bottoms[:1], 0, alpha=float(c.lp.elu_param.alpha))


def _affine(c: LayerContext, x: str, scale: float, shift: float) -> str:
    """shift + scale * x in float32, skipping identity steps."""
    if scale != 1:
        x = c.node("Mul", [x, c.scalar("scale", scale)])
    if shift != 0:
        x = c.node("Add", [x, c.scalar("shift", shift)])
    return x


def _finish(c: LayerContext, x: str) -> None:
    """Make value ``x`` top 0: the last node's fresh output is renamed; anything else gets an Identity."""
    last = c.g.nodes[-1] if c.g.nodes else None
    if last is not None and list(last.output) == [x] and x not in c.bottoms and last.name.startswith(c.name):
        last.output[0] = c.tops[0]
        return
    c.node("Identity", [x], 0)


def _power(c: LayerContext) -> None:
    p = c.lp.power_param
    power, scale, shift = float(p.power), float(p.scale), float(p.shift)
    if power * scale == 0:
        # Caffe: a constant (1 for power 0, else C's pow(shift, power) in double), whatever x holds.
        with np.errstate(all="ignore"):
            value = np.float32(1.0 if power == 0 else np.power(np.float64(shift), np.float64(power)))
        shape = c.node("Shape", [c.bottoms[0]])
        c.node("ConstantOfShape", [shape], 0, value=c.g.onnx.numpy_helper.from_array(np.array([value], np.float32)))
        return
    x = _affine(c, c.bottoms[0], scale, shift)
    if power != 1:
        x = c.node("Pow", [x, c.scalar("power", power)])
    _finish(c, x)


def _base_scale_shift(c: LayerContext, p, field: str) -> tuple[float, float, float]:
    """Exp's / Log's (base, scale, shift); a base Caffe refuses is refused here too."""
    base, scale, shift = float(p.base), float(p.scale), float(p.shift)
    if base != -1 and base <= 0:
        raise c.refuse(f"{field}.base {base} (Caffe requires base > 0 or -1)")
    return base, scale, shift


def exp_steps(base: float, scale: float, shift: float) -> tuple[np.float32, np.float32]:
    """Caffe's Exp as ``outer * exp(inner * x)``: the float32 (inner, outer) factors (1: no step)."""
    log_base = 1.0 if base == -1 else math.log(base)
    inner = np.float32(log_base * scale)
    outer = np.float32(1.0) if shift == 0 else np.float32(math.exp(log_base * shift)) if base == -1 \
        else np.float32(base) ** np.float32(shift)
    return inner, outer


def log_steps(base: float, scale: float, shift: float) -> tuple[np.float32, np.float32, np.float32]:
    """Caffe's Log as ``log(x * scale + shift) * base_scale``: the float32 (scale, shift, base_scale)
    (1, 0, 1: no step)."""
    base_scale = np.float32(1.0) if base == -1 else np.float32(1.0 / math.log(base))
    return np.float32(scale), np.float32(shift), base_scale


def _exp(c: LayerContext) -> None:
    inner, outer = exp_steps(*_base_scale_shift(c, c.lp.exp_param, "exp_param"))
    x = c.bottoms[0]
    if inner != 1:
        x = c.node("Mul", [x, c.scalar("inner_scale", inner)])
    x = c.node("Exp", [x])
    if outer != 1:
        x = c.node("Mul", [x, c.scalar("outer_scale", outer)])
    _finish(c, x)


def _log(c: LayerContext) -> None:
    scale, shift, base_scale = log_steps(*_base_scale_shift(c, c.lp.log_param, "log_param"))
    x = c.node("Log", [_affine(c, c.bottoms[0], scale, shift)])
    if base_scale != 1:
        x = c.node("Mul", [x, c.scalar("base_scale", base_scale)])
    _finish(c, x)


def _threshold(c: LayerContext) -> None:
    above = c.node("Greater", [c.bottoms[0], c.scalar("threshold", float(c.lp.threshold_param.threshold))])
    c.node("Cast", [above], 0, to=1)  # 1 = FLOAT


def _clip(c: LayerContext) -> None:
    p = c.lp.clip_param
    c.node("Clip", [c.bottoms[0], c.scalar("min", float(p.min)), c.scalar("max", float(p.max))], 0)


def _swish(c: LayerContext) -> None:
    beta = float(c.lp.swish_param.beta)
    s = c.node("Sigmoid", [_affine(c, c.bottoms[0], beta, 0.0)])
    c.node("Mul", [c.bottoms[0], s], 0)


def _dropout(c: LayerContext) -> None:
    if c.layer.phase == caffe_pb2.TRAIN:
        raise c.refuse("Dropout in the TRAIN phase drops units at random (build the net in the TEST phase)")
    c.node("Identity", c.bottoms[:1], 0)


# -- normalisation -------------------------------------------------------------------------------------
def _batch_norm(c: LayerContext) -> None:
    batch_norm_with_scale(c, None)


def batch_norm_with_scale(c: LayerContext, scale: Layer | None) -> None:
    """BatchNorm as ONNX BatchNormalization; with ``scale`` (a per-channel Scale layer reading only its
    output) that layer's factors and bias become the node's scale and B (the pair folded into one node)."""
    if not c.layer.use_global_stats:
        raise c.refuse("BatchNorm with batch statistics (TRAIN phase without use_global_stats) depends on the "
                       "batch; build the net in the TEST phase")
    if len(c.bottom_shapes[0]) < 2:
        raise c.refuse("BatchNorm of a blob without a channel axis")
    channels = c.blob(0).size
    m, v = c.param(0), c.param(1)
    factor = c.blob(2).reshape(-1)[0]
    if factor != 1:
        # Caffe multiplies the running sums by 1 / the moving-average normaliser (0 -> 0) in float32: the
        # three stored blobs stay initializers (bits kept) and the folding is explicit nodes.
        f = c.param(2)
        inv = c.g.one("Reciprocal", [f], name=f"{c.name}/factor_inv")
        if factor == 0:  # 1/0 is inf: take the factor itself (0) where it is 0, as Caffe
            zero = c.g.one("Equal", [f, c.scalar("zero", 0.0)], name=f"{c.name}/factor_is_0")
            inv = c.g.one("Where", [zero, f, inv], name=f"{c.name}/factor_inv_or_0")
        m = c.g.one("Mul", [m, inv], name=f"{c.name}/mean")
        v = c.g.one("Mul", [v, inv], name=f"{c.name}/var")
    if scale is None:
        gamma = c.g.const(f"{c.name}.gamma", np.ones(channels, np.float32))
        beta = c.g.const(f"{c.name}.beta", np.zeros(channels, np.float32))
    else:
        blobs = [np.asarray(to_host(b.data), np.float32) for b in scale.blobs]
        gamma = c.g.const(f"{scale.name}.blobs.0", blobs[0])
        beta = c.g.const(f"{scale.name}.blobs.1", blobs[1]) if scale.bias_term else \
            c.g.const(f"{c.name}.beta", np.zeros(channels, np.float32))
    c.node("BatchNormalization", [c.bottoms[0], gamma, beta, m, v], 0, epsilon=float(c.lp.batch_norm_param.eps))


def _operand_shape(c: LayerContext, operand_shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    """The operand's shape with trailing 1s: ONNX's right-aligned broadcast then matches Caffe's from ``axis``."""
    ndim = len(c.bottom_shapes[0])
    ax = _axis(axis, ndim)
    return tuple(operand_shape) + (1,) * (ndim - ax - len(operand_shape))


def _scale_or_bias(c: LayerContext, op: str, axis: int, first_param: int) -> str:
    """Mul/Add of the broadcast operand (a parameter blob, or bottom[1] reshaped); returns the result value."""
    if len(c.bottoms) > 1:
        shape = _operand_shape(c, c.bottom_shapes[1], axis)
        rank = len(c.bottom_shapes[1])
        operand = _reshape(c, c.bottoms[1], [0] * rank + [1] * (len(shape) - rank))
        return c.node(op, [c.bottoms[0], operand])
    shape = _operand_shape(c, c.layer.blobs[first_param].shape, axis)
    return c.node(op, [c.bottoms[0], c.param(first_param, shape)])


def _scale(c: LayerContext) -> None:
    p = c.lp.scale_param
    y = _scale_or_bias(c, "Mul", p.axis, 0)
    if p.bias_term:
        bias_index = len(c.layer.blobs) - 1
        shape = _operand_shape(c, c.layer.blobs[bias_index].shape, p.axis)
        y = c.node("Add", [y, c.param(bias_index, shape)])
    _finish(c, y)


def _bias(c: LayerContext) -> None:
    _finish(c, _scale_or_bias(c, "Add", c.lp.bias_param.axis, 0))


def _mvn(c: LayerContext) -> None:
    p = c.lp.mvn_param
    ndim = len(c.bottom_shapes[0])
    axes = list(range(1 if p.across_channels else 2, ndim))
    x = c.bottoms[0]

    def mean(v: str) -> str:  # over no axes (a 2-D bottom per channel): the value itself, as Caffe's 1-term mean
        return _reduce(c, "ReduceMean", v, axes, 1) if axes else v

    centred = c.node("Sub", [x, mean(x)])
    if not p.normalize_variance:
        _finish(c, centred)
        return
    var = mean(c.node("Mul", [centred, centred]))
    std = c.node("Add", [c.node("Sqrt", [var]), c.scalar("eps", float(p.eps))])  # eps outside the sqrt, as Caffe
    c.node("Div", [centred, std], 0)


# -- structure -----------------------------------------------------------------------------------------
def _flatten(c: LayerContext) -> None:
    p = c.lp.flatten_param
    shape = c.bottom_shapes[0]
    start, end = _axis(p.axis, len(shape)), _axis(p.end_axis, len(shape))
    if start == 0:
        c.fixes_batch("Flatten from axis 0 merges the batch axis")
    _reshape(c, c.bottoms[0], [0] * start + [-1] + list(shape[end + 1:]), 0)


def _reshape_layer(c: LayerContext) -> None:
    p = c.lp.reshape_param
    shape = c.bottom_shapes[0]
    start = _axis(p.axis, len(shape) + 1) if p.axis < 0 else p.axis
    end = len(shape) if p.num_axes == -1 else start + p.num_axes
    dims = [int(d) for d in p.shape.dim]
    out = [0] * start + dims + list(shape[end:])
    # Caffe's 0 copies the bottom dim at the same position as ONNX's 0 does (leading axes are kept).
    if start == 0 and dims and dims[0] != 0 and -1 not in dims:
        c.fixes_batch("Reshape sets the batch axis to a fixed size")
    _reshape(c, c.bottoms[0], out, 0)


def _concat(c: LayerContext) -> None:
    p = c.lp.concat_param
    axis = int(p.concat_dim) if p.HasField("concat_dim") else int(p.axis)
    c.node("Concat", c.bottoms, 0, axis=_axis(axis, len(c.bottom_shapes[0])))


def _slice(c: LayerContext) -> None:
    p = c.lp.slice_param
    ndim = len(c.bottom_shapes[0])
    axis = _axis(int(p.slice_dim) if p.HasField("slice_dim") else int(p.axis), ndim)
    sizes = [s[axis] for s in c.top_shapes]
    if axis == 0:
        c.fixes_batch("Slice along axis 0 splits the batch at fixed points")
    c.g.node("Split", [c.bottoms[0], c.g.ints(f"{c.name}.split", sizes)], c.tops, name=c.name, axis=axis)


def _split(c: LayerContext) -> None:
    for i in range(len(c.tops)):
        c.node("Identity", c.bottoms[:1], i)


def _crop(c: LayerContext) -> None:
    """Caffe's Crop: bottom[0] from ``offset`` to ``offset`` + bottom[1]'s size on every axis from ``axis``.

    The ends are computed from bottom[1]'s shape (Shape, Add), so the graph keeps Caffe's two bottoms (and a
    dynamic batch flows through a crop from axis 0); the top's shape is declared, as inference cannot derive it."""
    p = c.lp.crop_param
    shape = c.bottom_shapes[0]
    start = _axis(p.axis, len(shape))
    offsets = [int(p.offset[0] if len(p.offset) == 1 else p.offset[i - start]) if p.offset else 0
               for i in range(start, len(shape))]
    axes = list(range(start, len(shape)))
    if c.g.opset >= 15:
        ref = c.node("Shape", [c.bottoms[1]], start=start)
    else:
        whole = c.node("Shape", [c.bottoms[1]])
        ref = c.g.one("Slice", [whole, c.g.ints(f"{c.name}.axis", [start]), c.g.ints(f"{c.name}.rank", [len(shape)]),
                                c.g.ints(f"{c.name}.zero", [0])], name=f"{c.name}/ref_shape")
    starts = c.g.ints(f"{c.name}.starts", offsets)
    ends = c.g.one("Add", [ref, starts], name=f"{c.name}/ends")
    c.g.one("Slice", [c.bottoms[0], starts, ends, c.g.ints(f"{c.name}.axes", axes)], c.tops[0], name=f"{c.name}/crop")
    out = list(c.top_shapes[0])
    c.g.add_value_info(c.tops[0], [BATCH_DIM] + out[1:] if c.dynamic_batch and out else out)


def _softmax(c: LayerContext) -> None:
    c.node("Softmax", c.bottoms[:1], 0, axis=_axis(c.lp.softmax_param.axis, len(c.bottom_shapes[0])))


def _tile(c: LayerContext) -> None:
    p = c.lp.tile_param
    ndim = len(c.bottom_shapes[0])
    axis = _axis(p.axis, ndim)
    if axis == 0:
        c.fixes_batch("Tile along axis 0 multiplies the batch")
    repeats = [1] * ndim
    repeats[axis] = int(p.tiles)
    c.node("Tile", [c.bottoms[0], c.g.ints(f"{c.name}.repeats", repeats)], 0)


def _reduction(c: LayerContext) -> None:
    p = c.lp.reduction_param
    shape = c.bottom_shapes[0]
    axis = _axis(p.axis, len(shape))
    if axis == 0:
        c.fixes_batch("Reduction from axis 0 sums over the batch")
    axes = list(range(axis, len(shape)))
    op = {_RED.SUM: "ReduceSum", _RED.ASUM: "ReduceL1", _RED.SUMSQ: "ReduceSumSquare",
          _RED.MEAN: "ReduceMean"}[p.operation]
    coeff = float(p.coeff)
    if not axes:  # nothing to reduce: Caffe's sum over one element
        y = c.bottoms[0] if op in ("ReduceSum", "ReduceMean") else c.node(
            "Abs" if op == "ReduceL1" else "Mul", [c.bottoms[0]] if op == "ReduceL1" else [c.bottoms[0]] * 2)
    else:
        y = _reduce(c, op, c.bottoms[0], axes, 0)
    if coeff != 1:
        y = c.node("Mul", [y, c.scalar("coeff", coeff)])
    _finish(c, y)


def _argmax(c: LayerContext) -> None:
    p = c.lp.argmax_param
    shape = c.bottom_shapes[0]
    k = int(p.top_k)
    x = c.bottoms[0]
    if p.HasField("axis"):
        axis = _axis(p.axis, len(shape))
        n = shape[axis]
    else:
        axis, n = 1, int(np.prod(shape[1:], dtype=np.int64))
        x = _reshape(c, x, [0, n])
    # Caffe orders equal values by descending index; ONNX TopK by ascending index: take TopK of the
    # reversed axis and map the indices back (n - 1 - i), which gives Caffe's order exactly.
    big = np.iinfo(np.int64).max
    rev = c.node("Slice", [x, c.g.ints(f"{c.name}.start", [-1]), c.g.ints(f"{c.name}.end", [-big]),
                           c.g.ints(f"{c.name}.axis", [axis]), c.g.ints(f"{c.name}.step", [-1])])
    values, rev_idx = c.g.node("TopK", [rev, c.g.ints(f"{c.name}.k", [k])], [c.g.fresh(f"{c.name}.values"),
                               c.g.fresh(f"{c.name}.indices")], name=c.name, axis=axis, largest=1, sorted=1)
    idx = c.node("Sub", [c.g.ints(f"{c.name}.last", [n - 1]), rev_idx])
    idx = c.node("Cast", [idx], to=1)
    if p.HasField("axis"):
        _finish(c, values if p.out_max_val else idx)
        return
    parts = [c.node("Unsqueeze", [idx, c.g.ints(f"{c.name}.ax1", [1])])]
    if p.out_max_val:
        parts.append(c.node("Unsqueeze", [values, c.g.ints(f"{c.name}.ax1", [1])]))
    y = c.node("Concat", parts, axis=1) if len(parts) > 1 else parts[0]
    _reshape(c, y, _batch_shape(c, c.top_shapes[0]), 0)


def _embed(c: LayerContext) -> None:
    p = c.lp.embed_param
    idx = c.node("Cast", [c.bottoms[0]], to=7)  # 7 = INT64; truncates as Caffe's static_cast<int>
    y = c.node("Gather", [c.param(0), idx], None if p.bias_term else 0, axis=0)
    if p.bias_term:
        c.node("Add", [y, c.param(1)], 0)


def _parameter(c: LayerContext) -> None:
    c.node("Identity", [c.param(0)], 0)


def _eltwise(c: LayerContext) -> None:
    p = c.lp.eltwise_param
    if p.operation == _ELT.SUM:
        coeffs = list(p.coeff) or [1.0] * len(c.bottoms)
        terms = [b if float(k) == 1 else c.node("Mul", [b, c.scalar(f"coeff{i}", float(k))])
                 for i, (b, k) in enumerate(zip(c.bottoms, coeffs))]
        c.node("Sum", terms, 0)
    elif p.operation == _ELT.PROD:
        y = c.bottoms[0]
        for b in c.bottoms[1:]:
            y = c.node("Mul", [y, b])
        _finish(c, y)
    else:
        c.node("Max", c.bottoms, 0)


CONVERTERS: dict[str, Converter] = {
    "Convolution": _conv, "Deconvolution": _conv, "Pooling": _pool, "LRN": _lrn, "InnerProduct": _inner_product,
    "ReLU": _relu, "PReLU": _prelu, "ELU": _elu, "Sigmoid": _unary("Sigmoid"), "TanH": _unary("Tanh"),
    "AbsVal": _unary("Abs"), "BNLL": _unary("Softplus"), "Power": _power, "Exp": _exp, "Log": _log,
    "Threshold": _threshold, "Clip": _clip, "Swish": _swish, "Dropout": _dropout,
    "BatchNorm": _batch_norm, "Scale": _scale, "Bias": _bias, "MVN": _mvn,
    "Eltwise": _eltwise, "Concat": _concat, "Slice": _slice, "Split": _split, "Flatten": _flatten,
    "Reshape": _reshape_layer, "Crop": _crop, "Softmax": _softmax, "Tile": _tile, "Reduction": _reduction,
    "ArgMax": _argmax, "Embed": _embed, "Parameter": _parameter, "SPP": _spp,
}



_LOSS = "a training loss (export the deploy net, which ends before the loss)"
_DATA = "a data source layer (export a deploy net whose inputs are Input layers)"
REFUSED: dict[str, str] = {
    **{t: _LOSS for t in ("SoftmaxWithLoss", "EuclideanLoss", "SigmoidCrossEntropyLoss", "HingeLoss",
                          "ContrastiveLoss", "MultinomialLogisticLoss", "InfogainLoss")},
    "Accuracy": "a training metric that compares with labels (export the deploy net)",
    **{t: _DATA for t in ("Data", "ImageData", "HDF5Data", "MemoryData", "WindowData", "DummyData")},
    "HDF5Output": "writes HDF5 files as a side effect; ONNX graphs have no file output",
    "Python": "runs arbitrary Python code",
    "Filter": "its output batch size depends on the values of the selector input",
    "BatchReindex": "gathers items of the batch by runtime indices into a batch of another size",
    "Im2col": "not implemented in the exporter",
}
