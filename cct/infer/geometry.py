"""The spatial geometry of a net for dense inference: each layer's window, the field of view, the size rules.

A net can be applied densely (at every position of a sliding window) when every layer between the
input and the output is one of:

* a convolution with stride 1 and no padding (any kernel, dilation, group): a window of
  ``dilation * (kernel - 1) + 1`` voxels per axis;
* a pooling layer (MAX or AVE) whose stride equals its window and that has no padding: it subsamples
  by ``p`` (ZNNi, section V: such a layer becomes a max-pooling-fragment layer);
* a layer that works on each voxel alone (ReLU, Sigmoid, BatchNorm, Scale, Softmax over channels,
  LRN across channels, Eltwise, Concat over channels, Split, Dropout, ...).

Anything else (an InnerProduct not converted by :mod:`cct.infer.surgery`, Crop, Deconvolution, padded
or strided convolutions, LRN within a channel, global pooling...) would make an output voxel depend on
where the window sits, so the net cannot be made dense: :func:`analyze` raises :class:`NotDensifiableError`
naming the layer.

The field of view ``F`` (per axis) is the input a single output voxel sees; walking the layers from
the output back, a convolution adds ``extent - 1`` and a pooling window multiplies by ``p``
(ZNNi's n337, n537, n726, n926: 85, 163, 117, 155).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import CctError, LayerError
from ..io.prototxt import read_net_prototxt
from ..lowering.geometry import conv_spatial_params
from ..proto import caffe_pb2

_PP = caffe_pb2.PoolingParameter
_LRN = caffe_pb2.LRNParameter

# Layers that act on each voxel alone (they never mix spatial positions).
POINTWISE = frozenset({
    "ReLU", "PReLU", "ELU", "Sigmoid", "TanH", "AbsVal", "Power", "Exp", "Log", "BNLL", "Threshold", "Dropout",
    "Clip", "Swish", "BatchNorm", "Split", "Eltwise", "Silence",
})


class NotDensifiableError(LayerError):
    """A layer of the net cannot be applied densely (sliding-window inference); the message says why."""


@dataclass(frozen=True)
class SpatialOp:
    """One spatial layer of a dense-inference net: ``kind`` is ``"conv"`` (a window of ``size`` voxels,
    stride 1) or ``"pool"`` (window = stride = ``size``); ``layer`` is the index in ``net.layers``."""

    kind: str
    layer: int
    name: str
    size: tuple[int, ...]


@dataclass(frozen=True)
class NetGeometry:
    """The spatial ops of a net in order, its number of spatial axes, input and output blob names."""

    ops: tuple[SpatialOp, ...]
    num_spatial: int
    input_blob: str
    output_blob: str

    @property
    def pools(self) -> tuple[SpatialOp, ...]:
        """The pooling layers (candidates for max-pooling fragments), in order."""
        return tuple(op for op in self.ops if op.kind == "pool")

    @property
    def field_of_view(self) -> tuple[int, ...]:
        """Input voxels per axis that one output voxel depends on."""
        fov = [1] * self.num_spatial
        for op in reversed(self.ops):
            for a in range(self.num_spatial):
                fov[a] = fov[a] * op.size[a] if op.kind == "pool" else fov[a] + op.size[a] - 1
        return tuple(fov)

    @property
    def stride(self) -> tuple[int, ...]:
        """The net's own output stride per axis (product of the pooling windows)."""
        s = [1] * self.num_spatial
        for op in self.pools:
            s = [a * b for a, b in zip(s, op.size)]
        return tuple(s)

    def input_size(self, grid: tuple[int, ...], mpf: tuple[bool, ...]) -> tuple[int, ...]:
        """The input patch size whose output is ``grid`` voxels per fragment and axis, with pooling layer
        ``i`` run as max-pooling fragments when ``mpf[i]`` (ZNNi: an MPF layer needs ``n + 1`` divisible by
        ``p``, a plain pooling layer ``n`` divisible by ``p``)."""
        sizes = list(grid)
        pool_i = len(self.pools)
        for op in reversed(self.ops):
            if op.kind == "conv":
                sizes = [n + k - 1 for n, k in zip(sizes, op.size)]
            else:
                pool_i -= 1
                if mpf[pool_i]:
                    sizes = [(n + 1) * p - 1 for n, p in zip(sizes, op.size)]
                else:
                    sizes = [n * p for n, p in zip(sizes, op.size)]
        return tuple(sizes)

    def layer_sizes(self, patch: tuple[int, ...], mpf: tuple[bool, ...]) -> list[tuple[int, ...]]:
        """The spatial size after each op for input ``patch`` (fragments per pooling as ``mpf`` says);
        raises CctError when the patch breaks a size rule (see :meth:`input_size`)."""
        sizes, out, pool_i = list(patch), [], 0
        for op in self.ops:
            if op.kind == "conv":
                sizes = [n - k + 1 for n, k in zip(sizes, op.size)]
                if min(sizes) < 1:
                    raise CctError(f"patch {list(patch)} is smaller than the field of view {list(self.field_of_view)}")
            else:
                rule = 1 if mpf[pool_i] else 0
                if any((n + rule) % p or n < p for n, p in zip(sizes, op.size)):
                    what = "n + 1" if rule else "n"
                    raise CctError(f"patch {list(patch)}: pooling layer '{op.name}' gets {sizes}, and {what} must be "
                                   f"divisible by its window {list(op.size)}")
                sizes = [(n + rule) // p - rule for n, p in zip(sizes, op.size)]
                pool_i += 1
            out.append(tuple(sizes))
        return out


def _conv_op(i: int, lp: caffe_pb2.LayerParameter, nd: int) -> SpatialOp:
    p = lp.convolution_param
    if p.axis != 1:
        raise NotDensifiableError(lp.name, lp.type, f"convolution axis {p.axis} (dense inference needs axis 1)")
    sp = conv_spatial_params(p, nd, err=lambda m: LayerError(lp.name, lp.type, m))
    if any(s != 1 for s in sp.stride):
        raise NotDensifiableError(lp.name, lp.type, f"stride {list(sp.stride)}: only stride 1 convolutions "
                                  "can be made dense (use pooling to subsample)")
    if any(sp.pad):
        raise NotDensifiableError(lp.name, lp.type, f"pad {list(sp.pad)}: a padded convolution sees the window's "
                                  "border, so its output depends on where the window sits")
    return SpatialOp("conv", i, lp.name, sp.kernel_extent)


def _pool_op(i: int, lp: caffe_pb2.LayerParameter, nd: int) -> SpatialOp:
    p = lp.pooling_param
    if p.pool not in (_PP.MAX, _PP.AVE):
        raise NotDensifiableError(lp.name, lp.type, f"pool {_PP.PoolMethod.Name(p.pool)}: only MAX and AVE")
    if p.global_pooling:
        raise NotDensifiableError(lp.name, lp.type, "global pooling covers the whole input")
    if len(lp.top) > 1:
        raise NotDensifiableError(lp.name, lp.type, "a pooling layer with a mask top")
    kernel = (p.kernel_h, p.kernel_w) if p.HasField("kernel_h") else (p.kernel_size,) * nd
    stride = (p.stride_h, p.stride_w) if p.HasField("stride_h") else (p.stride,) * nd
    pad = (p.pad_h, p.pad_w) if p.HasField("pad_h") else (p.pad,) * nd
    if len(kernel) != nd:
        raise NotDensifiableError(lp.name, lp.type, f"kernel_h/kernel_w on {nd} spatial axes")
    if any(pad):
        raise NotDensifiableError(lp.name, lp.type, f"pad {list(pad)}: padded pooling sees the window's border")
    if tuple(kernel) != tuple(stride):
        raise NotDensifiableError(lp.name, lp.type, f"kernel {list(kernel)} with stride {list(stride)}: max-pooling "
                                  "fragments need stride = window")
    return SpatialOp("pool", i, lp.name, tuple(int(k) for k in kernel))


def _check_channelwise(lp: caffe_pb2.LayerParameter) -> None:
    """Scale/Bias/Softmax/Concat/LRN: allowed when they act along the channel axis only."""
    t = lp.type
    if t in ("Scale", "Bias"):
        p = lp.scale_param if t == "Scale" else lp.bias_param
        if len(lp.bottom) > 1 or p.axis != 1 or p.num_axes not in (0, 1):
            raise NotDensifiableError(lp.name, t, "only a learned per-channel (axis 1, num_axes 0 or 1) "
                                      "scale/bias can be made dense")
    elif t == "Softmax" and lp.softmax_param.axis != 1:
        raise NotDensifiableError(lp.name, t, f"softmax over axis {lp.softmax_param.axis} (only over channels)")
    elif t == "Concat" and lp.concat_param.axis != 1:
        raise NotDensifiableError(lp.name, t, "concatenation along a spatial axis")
    elif t == "LRN" and lp.lrn_param.norm_region != _LRN.ACROSS_CHANNELS:
        raise NotDensifiableError(lp.name, t, "LRN within a channel normalizes over space (pads the border)")


def analyze_param(param: caffe_pb2.NetParameter, num_spatial: int, input_blob: str, output_blob: str) -> NetGeometry:
    """The :class:`NetGeometry` of the layers of ``param`` (no net is built: the geometry needs no blob);
    raises :class:`NotDensifiableError` at the first layer that cannot be made dense."""
    ops = []
    for i, lp in enumerate(param.layer):
        t = lp.type
        if t == "Input":
            continue
        if t == "Convolution":
            ops.append(_conv_op(i, lp, num_spatial))
        elif t == "Pooling":
            ops.append(_pool_op(i, lp, num_spatial))
        elif t in POINTWISE:
            continue
        elif t in ("Scale", "Bias", "Softmax", "Concat", "LRN"):
            _check_channelwise(lp)
        else:
            raise NotDensifiableError(lp.name, t, "this layer type cannot be applied densely (sliding window); "
                                      "dense inference takes Convolution, Pooling and per-voxel layers")
    return NetGeometry(tuple(ops), num_spatial, input_blob, output_blob)


def analyze(net) -> NetGeometry:
    """The :class:`NetGeometry` of a built :class:`cct.Net` with one Input blob of shape ``(N, C, *spatial)``;
    raises :class:`NotDensifiableError` at the first layer that cannot be made dense."""
    if len(net.input_blob_names) != 1:
        raise CctError(f"dense inference needs a net with exactly one input blob, got {net.input_blob_names or 'none'}"
                       " (declare it with an Input layer)")
    in_name = net.input_blob_names[0]
    nd = net.blobs[in_name].num_axes - 2
    if nd < 1 or nd > 3:
        raise CctError(f"input blob '{in_name}' has shape {list(net.blobs[in_name].shape)}: dense inference needs "
                       "(N, C, x), (N, C, y, x) or (N, C, z, y, x)")
    if len(net.output_blob_names) < 1:
        raise CctError("the net has no output blob")
    return analyze_param(net.param, nd, in_name, net.output_blob_names[-1])


def field_of_view(prototxt: str) -> tuple[int, ...]:
    """The field of view of a deploy prototxt with one Input layer, read without building the net."""
    param = read_net_prototxt(prototxt)
    inputs = [lp for lp in param.layer if lp.type == "Input"]
    if len(inputs) != 1 or not inputs[0].input_param.shape:
        raise CctError(f"{prototxt}: dense inference needs exactly one Input layer with a shape")
    nd = len(inputs[0].input_param.shape[0].dim) - 2
    return analyze_param(param, nd, inputs[0].top[0], param.layer[-1].top[0]).field_of_view


def check_chain(net, geom: NetGeometry) -> None:
    """Refuse nets whose spatial layers do not form one chain (a branch that skips a pooling layer would
    join blobs of different fragment layouts)."""
    spatial = {op.layer for op in geom.ops}
    depth: dict[str, int] = {geom.input_blob: 0}
    for i, (bnames, tnames) in enumerate(zip(net.bottom_names, net.top_names)):
        if not bnames:
            continue
        ds = {depth.get(b, -1) for b in bnames}
        lp = net.param.layer[i]
        if len(ds) > 1:
            raise NotDensifiableError(lp.name, lp.type, "joins blobs that passed through different convolution/"
                                      "pooling layers (dense inference needs the spatial layers in one chain)")
        d = ds.pop() + (1 if i in spatial else 0)
        for t in tnames:
            depth[t] = d
