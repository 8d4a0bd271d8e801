"""Convolution geometry: kernel/pad/stride/dilation and the shapes they imply, as Caffe computes them.

``ConvGeometry`` always describes a *convolution* (input -> output). A Deconvolution layer is
the transpose of the convolution whose input is the deconvolution's top, so it builds its
geometry with ``reverse=True``: ``in_shape`` is then the deconvolution's output and
``out_shape`` its input.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import CctError
from ..proto import caffe_pb2

ErrorFactory = Callable[[str], Exception]


def _c_div(a: int, b: int) -> int:
    """C/C++ integer division (truncates toward zero), as Caffe's shape arithmetic uses."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


@dataclass(frozen=True)
class ConvSpatial:
    """Per-spatial-axis kernel, pad, stride and dilation of a ConvolutionParameter."""

    kernel: tuple[int, ...]
    pad: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]

    @property
    def kernel_extent(self) -> tuple[int, ...]:
        """Dilated kernel size per axis: ``d * (k - 1) + 1``."""
        return tuple(d * (k - 1) + 1 for k, d in zip(self.kernel, self.dilation))


def _per_axis(values: Sequence[int], num_spatial: int, default: int, what: str, err: ErrorFactory,
              allow_empty: bool = True) -> tuple[int, ...]:
    n = len(values)
    if not ((allow_empty and n == 0) or n == 1 or n == num_spatial):
        raise err(f"{what} must be specified once, or once per spatial dimension "
                  f"({what} specified {n} times; {num_spatial} spatial dims).")
    if n == 0:
        return (default,) * num_spatial
    return tuple(int(values[0 if n == 1 else i]) for i in range(num_spatial))


def conv_spatial_params(param: caffe_pb2.ConvolutionParameter, num_spatial: int,
                        err: ErrorFactory = CctError) -> ConvSpatial:
    """Kernel/pad/stride/dilation per spatial axis with Caffe's BaseConvolutionLayer checks."""
    # kernel
    if param.HasField("kernel_h") or param.HasField("kernel_w"):
        if num_spatial != 2:
            raise err("kernel_h & kernel_w can only be used for 2D convolution.")
        if len(param.kernel_size):
            raise err("Either kernel_size or kernel_h/w should be specified; not both.")
        kernel = (int(param.kernel_h), int(param.kernel_w))
    else:
        n = len(param.kernel_size)
        if not (n == 1 or n == num_spatial):
            raise err("kernel_size must be specified once, or once per spatial dimension "
                      f"(kernel_size specified {n} times; {num_spatial} spatial dims).")
        kernel = tuple(int(param.kernel_size[0 if n == 1 else i]) for i in range(num_spatial))
    if any(k <= 0 for k in kernel):
        raise err(f"Filter dimensions must be nonzero (kernel {list(kernel)}).")
    # stride
    if param.HasField("stride_h") or param.HasField("stride_w"):
        if num_spatial != 2:
            raise err("stride_h & stride_w can only be used for 2D convolution.")
        if len(param.stride):
            raise err("Either stride or stride_h/w should be specified; not both.")
        stride = (int(param.stride_h), int(param.stride_w))
    else:
        stride = _per_axis(param.stride, num_spatial, 1, "stride", err)
    if any(s <= 0 for s in stride):
        raise err(f"Stride dimensions must be nonzero (stride {list(stride)}).")
    # pad
    if param.HasField("pad_h") or param.HasField("pad_w"):
        if num_spatial != 2:
            raise err("pad_h & pad_w can only be used for 2D convolution.")
        if len(param.pad):
            raise err("Either pad or pad_h/w should be specified; not both.")
        pad = (int(param.pad_h), int(param.pad_w))
    else:
        pad = _per_axis(param.pad, num_spatial, 0, "pad", err)
    dilation = _per_axis(param.dilation, num_spatial, 1, "dilation", err)
    return ConvSpatial(kernel=kernel, pad=pad, stride=stride, dilation=dilation)


def conv_output_shape(in_shape: Sequence[int], sp: ConvSpatial, err: ErrorFactory = CctError) -> tuple[int, ...]:
    """Caffe's ConvolutionLayer::compute_output_shape: ``(in + 2p - ext) / s + 1`` (C division)."""
    out = tuple(_c_div(i + 2 * p - e, s) + 1
                for i, p, e, s in zip(in_shape, sp.pad, sp.kernel_extent, sp.stride))
    if any(o < 0 for o in out):
        raise err(f"kernel (extent {list(sp.kernel_extent)}) larger than the padded input "
                  f"{list(in_shape)} + 2*{list(sp.pad)}: negative output shape {list(out)}")
    return out


def deconv_output_shape(in_shape: Sequence[int], sp: ConvSpatial, err: ErrorFactory = CctError) -> tuple[int, ...]:
    """Caffe's DeconvolutionLayer::compute_output_shape: ``s * (in - 1) + ext - 2p``."""
    out = tuple(s * (i - 1) + e - 2 * p for i, p, e, s in zip(in_shape, sp.pad, sp.kernel_extent, sp.stride))
    if any(o < 0 for o in out):
        raise err(f"padding {list(sp.pad)} too large for the deconvolution of input {list(in_shape)}: "
                  f"negative output shape {list(out)}")
    return out


@dataclass(frozen=True)
class ConvGeometry:
    """Everything a lowering needs about one convolution (N-d spatial).

    Weights are ``(channels_out, channels_in // group, *kernel)``; the input is
    ``(batch, channels_in, *in_shape)``, the output ``(batch, channels_out, *out_shape)``.
    """

    channels_in: int
    channels_out: int
    group: int
    in_shape: tuple[int, ...]
    kernel: tuple[int, ...]
    pad: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    out_shape: tuple[int, ...]
    bias_term: bool = True

    # -- derived -------------------------------------------------------------
    @property
    def num_spatial(self) -> int:
        """Number of spatial axes."""
        return len(self.in_shape)

    @property
    def kernel_extent(self) -> tuple[int, ...]:
        """Dilated kernel size per axis: ``d * (k - 1) + 1``."""
        return tuple(d * (k - 1) + 1 for k, d in zip(self.kernel, self.dilation))

    @property
    def kernel_size(self) -> int:
        """Product of the kernel dimensions."""
        return math.prod(self.kernel)

    @property
    def kernel_dim(self) -> int:
        """Rows of the lowered matrix per group: ``channels_in / group * prod(kernel)``."""
        return self.channels_in // self.group * self.kernel_size

    @property
    def in_size(self) -> int:
        """Input pixels per channel (product of ``in_shape``)."""
        return math.prod(self.in_shape)

    @property
    def out_size(self) -> int:
        """Output pixels per channel (product of ``out_shape``)."""
        return math.prod(self.out_shape)

    @property
    def used_extent(self) -> tuple[int, ...]:
        """Padded extent the windows touch per axis: ``(out - 1) * stride + (k - 1) * dilation + 1``
        (0 for an empty output). Padded inputs of the lowerings are cropped to it."""
        return tuple(max(0, (o - 1) * s + (k - 1) * d + 1) if o > 0 else 0
                     for o, s, k, d in zip(self.out_shape, self.stride, self.kernel, self.dilation))

    def interior(self, ext: Sequence[int] | None = None) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
        """Slices (into a padded buffer of extent ``ext``, default :attr:`used_extent`; into the input)
        of the input region that lies inside the padded buffer."""
        ext = self.used_extent if ext is None else ext
        dst, src = [], []
        for i, p, e in zip(self.in_shape, self.pad, ext):
            lo = min(p, e)
            hi = max(lo, min(p + i, e))
            dst.append(slice(lo, hi))
            src.append(slice(lo - p, hi - p))
        return tuple(dst), tuple(src)

    @property
    def weight_shape(self) -> tuple[int, ...]:
        """``(channels_out, channels_in // group, *kernel)``."""
        return (self.channels_out, self.channels_in // self.group) + tuple(self.kernel)

    @property
    def is_1x1(self) -> bool:
        """Caffe's is_1x1_: every kernel dim 1, stride 1, pad 0 (im2col is then the identity)."""
        return all(k == 1 and s == 1 and p == 0 for k, s, p in zip(self.kernel, self.stride, self.pad))

    # -- construction ----------------------------------------------------------
    @classmethod
    def from_param(cls, param: caffe_pb2.ConvolutionParameter, bottom_shape: Sequence[int],
                   reverse: bool = False, err: ErrorFactory = CctError) -> ConvGeometry:
        """Geometry of a Convolution (or, with ``reverse``, Deconvolution) layer on ``bottom_shape``.

        Applies Caffe's checks (axis, kernel spec, num_output > 0, group divisibility).
        """
        bottom_shape = tuple(int(d) for d in bottom_shape)
        nax = len(bottom_shape)
        axis = int(param.axis)
        if not -nax <= axis < nax:
            raise err(f"axis {axis} out of range for a bottom with {nax} axes")
        channel_axis = axis + nax if axis < 0 else axis
        spatial = bottom_shape[channel_axis + 1:]
        sp = conv_spatial_params(param, len(spatial), err)
        channels = bottom_shape[channel_axis]
        num_output = int(param.num_output)
        if num_output <= 0:
            raise err("num_output must be > 0")
        group = int(param.group)
        if group <= 0:
            raise err(f"group must be > 0, got {group}")
        if channels % group:
            raise err(f"the number of input channels ({channels}) must be a multiple of group ({group})")
        if num_output % group:
            raise err("Number of output should be multiples of group "
                      f"(num_output {num_output}, group {group}).")
        if reverse:
            out = deconv_output_shape(spatial, sp, err)
            return cls(channels_in=num_output, channels_out=channels, group=group, in_shape=out,
                       kernel=sp.kernel, pad=sp.pad, stride=sp.stride, dilation=sp.dilation,
                       out_shape=tuple(spatial), bias_term=bool(param.bias_term))
        out = conv_output_shape(spatial, sp, err)
        return cls(channels_in=channels, channels_out=num_output, group=group, in_shape=tuple(spatial),
                   kernel=sp.kernel, pad=sp.pad, stride=sp.stride, dilation=sp.dilation,
                   out_shape=out, bias_term=bool(param.bias_term))
