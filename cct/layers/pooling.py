"""Pooling layer (MAX, AVE, STOCHASTIC) with Caffe's exact window and output-size rules.

* Output size ``ceil((H + 2p - k) / s) + 1`` (``round_mode: FLOOR``: floor); with padding, a
  last window that would start at or beyond ``H + p`` is dropped. Windows are clipped to the input.
* MAX ignores padding; ties keep the first maximum in row-major window order (strict ``>``);
  the optional second top is the flat index ``h * W + w`` of the max (as float).
* AVE divides by the window area clipped to the *padded* input ``[-p, H + p)``.
* STOCHASTIC (no CPU version in Caffe; its GPU semantics): TRAIN samples a position with
  probability proportional to its value (one uniform of the blob's dtype per output, drawn into a buffer
  allocated at reshape from the layer's device random stream, :mod:`cct.device.random`) and routes the
  gradient there; TEST gives ``sum(x^2) / sum(x)`` over the window (cct backpropagates that formula exactly).

Everything is vectorized over the batch and channels; the loops run over kernel offsets.
For numpy float arrays MAX and AVE (and the STOCHASTIC TRAIN backward) run compiled kernels
(:mod:`cct.kernels.pooling`, bitwise equal to this code) unless ``CCT_KERNELS=numpy``; MAX on 4-D
CuPy arrays runs :mod:`cct.kernels.gpu_pooling` (bitwise equal too), one launch per pass.
"""
from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence

import numpy as np

from .. import kernels
from ..blob import Blob
from ..device.driver import device_of, host_kernels_usable
from ..kernels import gpu_pooling
from ..proto import caffe_pb2
from .base import Layer, register

log = logging.getLogger("cct")

_PP = caffe_pb2.PoolingParameter
_FLT_MAX = float(np.finfo(np.float32).max)
_FLT_MIN = float(np.finfo(np.float32).tiny)


def pooled_size(size: int, kernel: int, pad: int, stride: int, padded: bool | None = None,
                round_mode: int = _PP.CEIL) -> int:
    """Caffe's pooled output size along one axis: ceil (``round_mode`` CEIL, Caffe's default) or floor
    (FLOOR) of ``(size + 2 pad - kernel) / stride``, plus one; then, if the layer has any padding
    (``padded``; default ``pad > 0``), drop a last window that starts at or beyond ``size + pad``."""
    if round_mode == _PP.CEIL:
        out = int(math.ceil(float(size + 2 * pad - kernel) / stride)) + 1
    elif round_mode == _PP.FLOOR:
        out = int(math.floor(float(size + 2 * pad - kernel) / stride)) + 1
    else:
        raise ValueError(f"unknown pooling round_mode {round_mode}")
    if padded is None:
        padded = pad > 0
    if padded and (out - 1) * stride >= size + pad:
        out -= 1
    return out


def _reusable(arr, like) -> bool:
    """Whether ``arr`` (the argmax kept from a forward) has ``like``'s shape and lives on its device."""
    return arr is not None and arr.shape == like.shape and device_of(arr) == device_of(like)


@register("Pooling")
class PoolingLayer(Layer):
    """Caffe's Pooling layer on 4-D blobs ``(N, C, H, W)``, and 3-D pooling of 5-D ``(N, C, D, H, W)`` ones."""

    param_fields = ("pooling_param",)
    exact_num_bottom = 1
    min_num_top = 1
    max_num_top = 2

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.pooling_param
        self.method = p.pool
        if self.method not in (_PP.MAX, _PP.AVE, _PP.STOCHASTIC):
            raise self.unsupported(f"pool = {self.method}")
        if len(top) > 1 and self.method != _PP.MAX:
            raise self.error(f"takes at most 1 top blob(s) with pool {_PP.PoolMethod.Name(self.method)}, "
                             f"got {len(top)} (only MAX pooling has the mask top)")
        has_k, has_kh, has_kw = p.HasField("kernel_size"), p.HasField("kernel_h"), p.HasField("kernel_w")
        self.global_pooling = bool(p.global_pooling)
        if self.global_pooling:
            if has_k or has_kh or has_kw:
                raise self.error("With Global_pooling: true Filter size cannot specified")
        else:
            if has_k == (has_kh and has_kw):
                raise self.error("Filter size is kernel_size OR kernel_h and kernel_w; not both")
            if not (has_k or (has_kh and has_kw)):
                raise self.error("For non-square filters both kernel_h and kernel_w are required.")
        has_p, has_ph, has_pw = p.HasField("pad"), p.HasField("pad_h"), p.HasField("pad_w")
        if not ((not has_p and has_ph and has_pw) or (not has_ph and not has_pw)):
            raise self.error("pad is pad OR pad_h and pad_w are required.")
        has_s, has_sh, has_sw = p.HasField("stride"), p.HasField("stride_h"), p.HasField("stride_w")
        if not ((not has_s and has_sh and has_sw) or (not has_sh and not has_sw)):
            raise self.error("Stride is stride OR stride_h and stride_w are required.")
        # 5-D bottoms (3-D pooling, ZNNi's volumes) take the scalar forms for every spatial axis
        self._uniform = not (has_kh or has_ph or has_sh)
        if self.global_pooling:
            self._check_axes(bottom[0])
            self.kernel = tuple(bottom[0].shape[2:])
        elif has_k:
            self.kernel = (int(p.kernel_size), int(p.kernel_size))
        else:
            self.kernel = (int(p.kernel_h), int(p.kernel_w))
        if min(self.kernel) <= 0:
            raise self.error(f"Filter dimensions cannot be zero (kernel {list(self.kernel)}).")
        self.pad = (int(p.pad_h), int(p.pad_w)) if has_ph else (int(p.pad), int(p.pad))
        self.stride = (int(p.stride_h), int(p.stride_w)) if has_sh else (int(p.stride), int(p.stride))
        if min(self.stride) <= 0:
            raise self.error(f"stride must be > 0 (stride {list(self.stride)})")
        if self.global_pooling and (any(self.pad) or any(s != 1 for s in self.stride)):
            raise self.error("With Global_pooling: true; only pad = 0 and stride = 1")
        if any(self.pad):
            if self.method not in (_PP.AVE, _PP.MAX):
                raise self.error("Padding implemented only for average and max pooling.")
            if any(p >= k for p, k in zip(self.pad, self.kernel)):
                raise self.error(f"pad {list(self.pad)} must be smaller than the kernel {list(self.kernel)}")
        self.round_mode = p.round_mode
        if self.round_mode not in (_PP.CEIL, _PP.FLOOR):
            raise self.unsupported(f"round_mode = {self.round_mode}")
        if p.engine == _PP.CUDNN:
            log.warning("layer '%s' (type Pooling): engine CUDNN requested; cct uses its own implementation",
                        self.name)
        self.arg = None
        self.pool_size = None
        self.uniform = None  # STOCHASTIC TRAIN: the draws of one forward (allocated at reshape)
        if self.draws_random():
            self.random_stream(bottom[0].device)

    def draws_random(self) -> bool:
        return self.param.pooling_param.pool == _PP.STOCHASTIC and self.phase == caffe_pb2.TRAIN

    def _check_axes(self, blob: Blob) -> None:
        if blob.num_axes == 5 and not self._uniform:
            raise self.error("3-D pooling (5-D bottom) takes kernel_size, pad and stride for every spatial axis "
                             "(not the _h/_w forms)")
        if blob.num_axes not in (4, 5):
            raise self.error("Input must have 4 axes, corresponding to (num, channels, height, width), or 5 "
                             f"(num, channels, depth, height, width); got shape {list(blob.shape)}")

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        self._check_axes(bottom[0])
        shape = tuple(bottom[0].shape)
        n, c, spatial = shape[0], shape[1], shape[2:]
        nd = len(spatial)
        if self.global_pooling:
            self.kernel = spatial
        elif len(self.kernel) != nd:  # the scalar forms, repeated per spatial axis
            self.kernel, self.pad, self.stride = ((v[0],) * nd for v in (self.kernel, self.pad, self.stride))
        padded = any(self.pad)  # Caffe applies the drop rule to every axis if any is padded
        out = tuple(pooled_size(i, k, p, s, padded, self.round_mode)
                    for i, k, p, s in zip(spatial, self.kernel, self.pad, self.stride))
        if any(o <= 0 for o in out):
            raise self.error(f"kernel {list(self.kernel)} too large for the input {'x'.join(map(str, spatial))} "
                             f"(pad {list(self.pad)})")
        self.in_hw = spatial
        self.out_hw = out
        for t in top:
            t.reshape((n, c) + out)
        # Padded working extent: every window fits, and the input sits at offset pad.
        self.ext = tuple(max(i + p, (o - 1) * s + k)
                         for i, k, p, s, o in zip(spatial, self.kernel, self.pad, self.stride, out))
        key = (spatial, tuple(self.kernel), tuple(self.pad), tuple(self.stride), bottom[0].dtype, bottom[0].xp)
        if self.method == _PP.AVE and getattr(self, "_pool_size_key", None) != key:
            # once per geometry: an unchanged reshape (every forward) must not upload (CUDA graph capture)
            self._pool_size_key = key
            xp = bottom[0].xp
            size = np.ones((), dtype=np.int64)
            for i, k, p, s, o in zip(spatial, self.kernel, self.pad, self.stride, out):
                starts = np.arange(o) * s - p
                size = np.multiply.outer(size, np.minimum(starts + k, i + p) - starts)
            self.pool_size = xp.asarray(size.astype(bottom[0].dtype))
        u, x = self.uniform, bottom[0].data
        if self.draws_random() and (u is None or type(u) is not type(x) or u.shape != top[0].shape
                                    or u.dtype != x.dtype):
            self.uniform = bottom[0].xp.empty(top[0].shape, dtype=x.dtype)

    # -- helpers -------------------------------------------------------------------
    def _offsets(self):
        return itertools.product(*(range(k) for k in self.kernel))

    def _win(self, off: tuple) -> tuple:
        return (Ellipsis,) + tuple(slice(i, i + (o - 1) * s + 1, s) for i, o, s in zip(off, self.out_hw, self.stride))

    def _padded(self, x, fill: float):
        xp = self.xp
        if not any(self.pad) and tuple(self.ext) == tuple(x.shape[2:]):
            return x
        buf = xp.full(x.shape[:2] + tuple(self.ext), fill, dtype=x.dtype)
        buf[(slice(None), slice(None)) + tuple(slice(p, p + i) for p, i in zip(self.pad, self.in_hw))] = x
        return buf

    def _crop(self, buf):
        return buf[(slice(None), slice(None)) + tuple(slice(p, p + i) for p, i in zip(self.pad, self.in_hw))]

    def _starts(self):
        """Per axis, the window starts in input coordinates, shaped to broadcast over the output."""
        nd = len(self.out_hw)
        return [(np.arange(o) * s - p).reshape((o,) + (1,) * (nd - 1 - a))
                for a, (o, s, p) in enumerate(zip(self.out_hw, self.stride, self.pad))]

    def _valid(self, off: tuple):
        """Mask over the output of windows whose offset ``off`` lies inside the (unpadded) input."""
        ok = True
        for st, i, n in zip(self._starts(), off, self.in_hw):
            ok = ok & (st + i >= 0) & (st + i < n)
        return self.xp.asarray(ok)

    # -- forward ---------------------------------------------------------------------
    @staticmethod
    def _gpu_kernels(*arrays):
        """:mod:`cct.kernels.gpu_pooling` when its kernels apply to these arrays (CuPy), else None
        (imported only then: importing cct loads no kernel module)."""
        if not device_of(arrays[0]).is_gpu:
            return None

        return gpu_pooling if gpu_pooling.usable(*arrays) else None

    def _kernels(self, *arrays):
        """The pooling kernel module when the compiled path applies to these arrays, else None."""
        if self.method == _PP.STOCHASTIC and self.phase != caffe_pb2.TRAIN:
            return None
        return kernels.get("pooling") if host_kernels_usable(*arrays, contiguous=True) else None

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        self.xp = bottom[0].xp
        x = bottom[0].data
        km = self._kernels(x, top[0].data, self.pool_size) if self.method == _PP.AVE and x.ndim == 4 else None
        if km is not None:
            km.ave_forward(x, top[0].data, self.pool_size, self.kernel, self.pad, self.stride)
        elif self.method == _PP.MAX:
            self._forward_max(x, top)
        elif self.method == _PP.AVE:
            xpad = self._padded(x, 0.0)
            out = top[0].data
            out[...] = 0
            for off in self._offsets():
                out += xpad[self._win(off)]
            with np.errstate(divide="ignore", invalid="ignore"):  # empty windows (stride > kernel), as Caffe
                out /= self.pool_size
        elif self.phase == caffe_pb2.TRAIN:
            self._forward_stochastic_train(x, top[0].data)
        else:
            xpad = self._padded(x, 0.0)
            s1 = self.xp.full(top[0].shape, _FLT_MIN, dtype=x.dtype)
            s2 = self.xp.zeros(top[0].shape, dtype=x.dtype)
            for off in self._offsets():
                v = xpad[self._win(off)]
                s1 += v
                s2 += v * v
            self.test_sum = s1
            top[0].data[...] = s2 / s1

    def _forward_max(self, x, top) -> None:
        xp = self.xp
        best = top[0].data
        km = self._kernels(x, best) if x.ndim == 4 else None
        if km is not None:
            arg = self.arg if _reusable(self.arg, best) else np.empty(best.shape, dtype=np.int32)
            km.max_forward(x, best, arg, self.kernel, self.pad, self.stride)
        elif (gk := self._gpu_kernels(x, best)) is not None:  # GPU memory: one launch, not three per offset
            arg = self.arg if _reusable(self.arg, best) else xp.empty(best.shape, dtype=np.int32)
            gk.max_forward(x, best, arg, self.kernel, self.pad, self.stride)
        else:
            xpad = self._padded(x, -np.inf)
            best[...] = -_FLT_MAX
            arg = xp.full(best.shape, -1, dtype=np.int32)
            k = 0
            for off in self._offsets():
                v = xpad[self._win(off)]
                better = v > best
                xp.copyto(best, v, where=better)
                xp.copyto(arg, np.int32(k), where=better)
                k += 1
        self.arg = arg
        if len(top) > 1:
            offs, rest = [], arg  # the window offset per axis of each maximum (row-major in the window)
            for k in reversed(self.kernel):
                offs.insert(0, rest % k)
                rest = rest // k
            flat = 0
            for st, o, n in zip(self._starts(), offs, self.in_hw):  # flat input index, row-major
                flat = flat * n + xp.asarray(st) + o
            top[1].data[...] = xp.where(arg >= 0, flat, -1)

    def _forward_stochastic_train(self, x, out) -> None:
        xp = self.xp
        xpad = self._padded(x, 0.0)
        total = xp.zeros(out.shape, dtype=x.dtype)
        for off in self._offsets():
            total += xpad[self._win(off)]
        self.random.uniform_(self.uniform)
        thres = self.uniform * total
        cum = xp.zeros(out.shape, dtype=x.dtype)
        arg = xp.full(out.shape, -1, dtype=np.int32)
        out[...] = 0
        k = 0
        for off in self._offsets():
            v = xpad[self._win(off)]
            cum += v
            take = (cum >= thres) & (arg < 0) & self._valid(off)
            xp.copyto(out, v, where=take)
            xp.copyto(arg, np.int32(k), where=take)
            k += 1
        self.arg = arg

    # -- backward --------------------------------------------------------------------
    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if not propagate_down[0]:
            return
        self.xp = xp = bottom[0].xp
        dy = top[0].diff
        if self.method == _PP.AVE and dy.ndim == 4:
            km = self._kernels(dy, bottom[0].diff, self.pool_size)
            if km is not None:
                km.ave_backward(dy, self.pool_size, bottom[0].diff, self.kernel, self.pad, self.stride)
                return
        elif _reusable(self.arg, dy) and not device_of(dy).is_gpu and dy.ndim == 4:
            km = self._kernels(dy, bottom[0].diff) if self.arg.flags.c_contiguous else None
            if km is not None:
                km.max_backward(dy, self.arg, bottom[0].diff, self.kernel, self.pad, self.stride)
                return
        elif (self.method == _PP.MAX and _reusable(self.arg, dy)
              and (gk := self._gpu_kernels(dy, bottom[0].diff)) is not None):
            gk.max_backward(dy, self.arg, bottom[0].diff, self.kernel, self.pad, self.stride)
            return
        acc = xp.zeros(tuple(bottom[0].shape[:2]) + tuple(self.ext), dtype=dy.dtype)
        if self.method == _PP.AVE:
            with np.errstate(divide="ignore", invalid="ignore"):
                g = dy / self.pool_size
            for off in self._offsets():
                acc[self._win(off)] += g
        elif self.method == _PP.MAX or self.phase == caffe_pb2.TRAIN:
            if self.arg is None:
                raise self.error("backward called before forward")
            zero = xp.zeros((), dtype=dy.dtype)
            k = 0
            for off in self._offsets():
                acc[self._win(off)] += xp.where(self.arg == k, dy, zero)
                k += 1
        else:  # STOCHASTIC, TEST: y = sum(x^2) / sum(x) -> dy/dx = (2x - y) / sum(x)
            x = bottom[0].data
            xpad = self._padded(x, 0.0)
            g = dy / self.test_sum
            y = top[0].data
            for off in self._offsets():
                v = xpad[self._win(off)]
                acc[self._win(off)] += g * (2 * v - y)
        bottom[0].diff[...] = self._crop(acc)
