"""SPP (spatial pyramid pooling), composed as Caffe composes it: Split, then per level a Pooling
layer and a Flatten, then a Concat of the flattened levels.

Level ``l`` (0 .. pyramid_height - 1) has ``2^l x 2^l`` bins: a Pooling layer with, per axis,
``kernel = ceil(size / 2^l)``, ``stride = kernel`` and ``pad = (kernel * 2^l - size + 1) / 2``
(integer division), the method of ``spp_param.pool`` (MAX, AVE or STOCHASTIC, with Pooling's
rules: STOCHASTIC allows no padding, the pad must be smaller than the kernel). The top is
``(N, C * sum_l 4^l)``; with ``pyramid_height: 1`` Caffe hands out the single Pooling layer's top
unflattened, ``(N, C, 1, 1)``, and so does cct.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from ..blob import Blob
from ..errors import LayerError
from ..proto import caffe_pb2
from .base import Layer, register
from .pooling import PoolingLayer

_SPP = caffe_pb2.SPPParameter
_PP = caffe_pb2.PoolingParameter
_METHODS = {_SPP.MAX: _PP.MAX, _SPP.AVE: _PP.AVE, _SPP.STOCHASTIC: _PP.STOCHASTIC}


def spp_pooling_param(level: int, height: int, width: int, pool: int) -> caffe_pb2.PoolingParameter:
    """The PoolingParameter of pyramid level ``level`` for a ``height x width`` input (Caffe's GetPoolingParam)."""
    bins = 2 ** level
    p = caffe_pb2.PoolingParameter()
    for axis, size in (("h", height), ("w", width)):
        kernel = int(math.ceil(size / float(bins)))
        pad = (kernel * bins - size + 1) // 2
        setattr(p, f"kernel_{axis}", kernel)
        setattr(p, f"stride_{axis}", kernel)
        setattr(p, f"pad_{axis}", pad)
    p.pool = _METHODS[pool]
    return p


@register("SPP")
class SPPLayer(Layer):
    """Caffe's SPP layer on 4-D blobs ``(N, C, H, W)``."""

    param_fields = ("spp_param",)
    exact_num_bottom = 1
    exact_num_top = 1

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.spp_param
        if p.pool not in _METHODS:
            raise self.unsupported(f"spp_param.pool = {p.pool}")
        if not p.HasField("pyramid_height") or p.pyramid_height < 1:
            raise self.error("spp_param.pyramid_height must be set to at least 1")
        self.height = int(p.pyramid_height)
        self._in_shape: tuple[int, ...] | None = None
        if self.draws_random():
            self.random_stream(bottom[0].device)

    def draws_random(self) -> bool:
        return self.param.spp_param.pool == _PP.STOCHASTIC and self.phase == caffe_pb2.TRAIN

    def _pool_layer(self, level: int, h: int, w: int) -> PoolingLayer:
        lp = caffe_pb2.LayerParameter(name=self.name, type="Pooling", phase=self.phase)
        lp.pooling_param.CopyFrom(spp_pooling_param(level, h, w, self.param.spp_param.pool))
        pool = PoolingLayer(lp)
        pool.random = self.random  # STOCHASTIC: the levels draw one after another from the SPP layer's stream
        return pool

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        x = bottom[0]
        if x.num_axes != 4:
            raise self.error("Input must have 4 axes, corresponding to (num, channels, height, width); "
                             f"got shape {list(x.shape)}")
        n, c, h, w = x.shape
        if h <= 0 or w <= 0:
            raise self.error(f"Input dimensions cannot be zero (shape {list(x.shape)}).")
        if tuple(x.shape) != self._in_shape:
            self._in_shape = tuple(x.shape)
            self.levels = []
            for level in range(self.height):
                pool = self._pool_layer(level, h, w)
                out = Blob((), dtype=x.dtype, device=x.device)
                try:
                    pool.setup([x], [out])
                except LayerError as e:
                    raise self.error(f"pyramid level {level} ({2 ** level}x{2 ** level} bins) on a {h}x{w} "
                                     f"input: {e}") from None
                self.levels.append((pool, out))
        for pool, out in self.levels:
            pool.reshape([x], [out])
        if self.height == 1:
            top[0].reshape(self.levels[0][1].shape)
        else:
            top[0].reshape((n, sum(out.count_range(1) for _, out in self.levels)))

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        n = bottom[0].shape[0]
        off = 0
        y = top[0].data.reshape(n, -1)
        for pool, out in self.levels:
            pool.forward(bottom, [out])
            k = out.count_range(1)
            y[:, off:off + k] = out.data.reshape(n, k)
            off += k

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if not propagate_down[0]:
            return
        x = bottom[0]
        n = x.shape[0]
        dy = top[0].diff.reshape(n, -1)
        total = None
        off = 0
        # Each level's Pooling backward writes into a private blob sharing the bottom's data; the
        # level diffs are summed in level order, as Caffe's Split backward sums its tops.
        for pool, out in self.levels:
            k = out.count_range(1)
            out.diff[...] = dy[:, off:off + k].reshape(out.shape)
            off += k
            scratch = Blob((), dtype=x.dtype, device=x.device)
            scratch.share_data(x)
            pool.backward([out], [True], [scratch])
            if total is None:
                total = scratch.diff
            else:
                total += scratch.diff
        x.diff[...] = total
