"""Local Response Normalization (Caffe's LRN layer), both norm regions, exact backward.

* ACROSS_CHANNELS: ``scale = k + alpha / n * sum_{c' in [c - (n-1)/2, c + (n-1)/2]} x_{c'}^2``
  (channels outside the blob count as zero), ``y = x * scale^-beta``.
* WITHIN_CHANNEL: ``scale = 1 + alpha * avg`` with ``avg`` the n x n average of ``x^2`` over
  a zero-padded window (always divided by n*n; ``k`` is not used), ``y = x * scale^-beta``.

For numpy float arrays ACROSS_CHANNELS runs compiled kernels (:mod:`cct.kernels.lrn`, bitwise
equal to this code) unless ``CCT_KERNELS=numpy``.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from .. import kernels
from ..blob import Blob
from ..device.driver import array_module, host_kernels_usable
from ..proto import caffe_pb2
from .base import Layer, register

log = logging.getLogger("cct")

_LP = caffe_pb2.LRNParameter


def _box_sum(a, n: int, axes: Sequence[int]):
    """Sum over a centred window of ``n`` (odd) entries along each axis in ``axes``, zero-padded."""
    xp = array_module(a)
    half = (n - 1) // 2
    out = a
    for ax in axes:
        size = out.shape[ax]
        pad_shape = list(out.shape)
        pad_shape[ax] = size + 2 * half
        padded = xp.zeros(pad_shape, dtype=out.dtype)
        sl = [slice(None)] * out.ndim
        sl[ax] = slice(half, half + size)
        padded[tuple(sl)] = out
        acc = xp.zeros(out.shape, dtype=out.dtype)
        for o in range(n):
            sl[ax] = slice(o, o + size)
            acc += padded[tuple(sl)]
        out = acc
    return out


@register("LRN")
class LRNLayer(Layer):
    """Caffe's LRN layer on 4-D blobs ``(N, C, H, W)``."""

    param_fields = ("lrn_param",)
    exact_num_bottom = 1
    exact_num_top = 1

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.lrn_param
        self.size = int(p.local_size)
        if self.size % 2 != 1:
            raise self.error(f"LRN only supports odd values for local_size (got {self.size})")
        self.alpha = float(p.alpha)
        self.beta = float(p.beta)
        self.k = float(p.k)
        self.region = p.norm_region
        if self.region not in (_LP.ACROSS_CHANNELS, _LP.WITHIN_CHANNEL):
            raise self.unsupported(f"norm_region = {self.region}")
        if p.engine == _LP.CUDNN:
            log.warning("layer '%s' (type LRN): engine CUDNN requested; cct uses its own implementation", self.name)
        self.scale = None
        self.x_saved = None
        self.scale_pow = None  # scale ** -beta, kept by the compiled forward for its backward
        self._work = None

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        if bottom[0].num_axes != 4:
            raise self.error("Input must have 4 axes, corresponding to (num, channels, height, width); "
                             f"got shape {list(bottom[0].shape)}")
        top[0].reshape(bottom[0].shape)

    def _scale(self, x):
        sq = x * x
        if self.region == _LP.ACROSS_CHANNELS:
            return self.k + (self.alpha / self.size) * _box_sum(sq, self.size, (1,))
        return 1.0 + self.alpha * (_box_sum(sq, self.size, (2, 3)) / (self.size * self.size))

    def _kernels(self, *arrays):
        """The LRN kernel module when the compiled path applies (ACROSS_CHANNELS, numpy floats), else None."""
        if self.region != _LP.ACROSS_CHANNELS or not host_kernels_usable(*arrays, contiguous=True):
            return None
        return kernels.get("lrn")

    def _scratch(self, blob: Blob, what: str):
        """This layer's ``what`` buffer of ``blob``'s shape and dtype (allocated once, then reused)."""
        return blob.device.workspace((self, what), blob.shape, blob.dtype)

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        x = bottom[0].data
        # In place (top is bottom): keep the input for the backward pass.
        self.x_saved = x.copy() if top[0] is bottom[0] else None
        km = self._kernels(x, top[0].data)
        if km is not None:
            scale = km.scale_across(x, self._scratch(bottom[0], "scale"), self.size, self.alpha, self.k)
            self.scale = scale
            self.scale_pow = km.power(scale, -self.beta, self._scratch(bottom[0], "scale_pow"))
            np.multiply(x, self.scale_pow, out=top[0].data)
            return
        scale = self._scale(x)
        self.scale = scale
        self.scale_pow = None
        top[0].data[...] = x * scale ** (-self.beta)

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if not propagate_down[0]:
            return
        x = self.x_saved if self.x_saved is not None else bottom[0].data
        dy = top[0].diff
        scale = self.scale
        if self.scale_pow is not None:
            km = self._kernels(x, dy, bottom[0].diff, scale, self.scale_pow)
            if km is not None:
                self._work = self._scratch(bottom[0], "work")
                km.backward_across(x, dy, scale, self.scale_pow, bottom[0].diff, self.size, self.alpha, self.beta,
                                   work=self._work)
                return
        p = scale ** (-self.beta)
        if self.region == _LP.ACROSS_CHANNELS:
            # dx = dy * s^-b - 2 a b / n * x * sum_window(dy * y / s)
            ratio = dy * x * p / scale
            acc = _box_sum(ratio, self.size, (1,))
            dx = dy * p - (2.0 * self.alpha * self.beta / self.size) * x * acc
        else:
            # s = 1 + a / n^2 * box(x^2): dx = dy * s^-b - 2 x * a b / n^2 * box(dy * x * s^(-b-1))
            ratio = dy * x * p / scale
            acc = _box_sum(ratio, self.size, (2, 3))
            dx = dy * p - (2.0 * self.alpha * self.beta / (self.size * self.size)) * x * acc
        bottom[0].diff[...] = dx
