"""Max-pooling fragments (ZNNi, section V): pooling at every offset of the window, the offsets folded into the batch.

Pooling a blob of spatial size ``n`` with window ``p`` at offset ``o`` (``0 <= o < p`` per axis) gives
one *fragment*; when ``n + 1`` is divisible by ``p`` every fragment has ``(n + 1) / p - 1`` voxels per
axis. The fragments of all ``prod(p)`` offsets are the pooled values at every position of the window,
i.e. a pooling of stride 1 read with stride ``p`` from each offset. That is how they are computed here:
one stride-1 pooling (cct's own Pooling layer, so MAX and AVE keep Caffe's semantics), then a reshape
and transpose that puts the offset in front of the batch: fragment ``o`` of batch item ``b`` becomes
batch item ``o_flat * B + b`` (``o_flat`` the row-major index of ``o``).
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence

from ..blob import Blob
from ..layers import create_layer
from ..proto import caffe_pb2


def fragment_shape(size: Sequence[int], window: Sequence[int]) -> tuple[int, ...]:
    """Spatial size of each fragment; ``size + 1`` must be divisible by ``window`` (ZNNi's rule)."""
    if any((n + 1) % p for n, p in zip(size, window)):
        raise ValueError(f"max-pooling fragments of size {list(size)} with window {list(window)}: "
                         "size + 1 must be divisible by the window")
    return tuple((n + 1) // p - 1 for n, p in zip(size, window))


def _fold_view(dense, window: Sequence[int]):
    """``dense`` ``(B, C, *(F*p))`` as a view ``(*p, B, C, *F)``: ``(o, b, c, f)`` is ``dense[b, c, f*p + o]``."""
    b, c, spatial = dense.shape[0], dense.shape[1], dense.shape[2:]
    nd = len(spatial)
    frag = tuple(n // p for n, p in zip(spatial, window))
    split = (b, c) + tuple(itertools.chain.from_iterable(zip(frag, window)))
    order = tuple(3 + 2 * a for a in range(nd)) + (0, 1) + tuple(2 + 2 * a for a in range(nd))
    return dense.reshape(split).transpose(order)


def fold_offsets(dense, window: Sequence[int], out=None):
    """``(B, C, *(F*p))`` stride-1 pooled values -> ``(prod(p) * B, C, *F)`` fragments, offset outermost
    (written into ``out`` when given, without a temporary)."""
    view = _fold_view(dense, window)
    shape = (-1,) + view.shape[len(window) + 1:]
    if out is None:
        return view.reshape(shape)
    out.reshape(view.shape)[...] = view
    return out


def offsets(window: Sequence[int]) -> list[tuple[int, ...]]:
    """The pooling offsets in fragment order (row-major)."""
    return list(itertools.product(*(range(p) for p in window)))


class FragmentPooling:
    """A Pooling layer run as max-pooling fragments: :meth:`reshape` then :meth:`forward` on Blobs.

    Built once at setup from the pooling layer's own parameters with stride 1 (so MAX/AVE semantics
    are cct's Pooling layer's); holds the stride-1 result in its own blob.
    """

    def __init__(self, param: caffe_pb2.LayerParameter, window: Sequence[int], like: Blob) -> None:
        lp = caffe_pb2.LayerParameter()
        lp.CopyFrom(param)
        lp.name = f"{param.name} (fragments)"
        del lp.top[1:]
        pp = lp.pooling_param
        pp.ClearField("stride_h")
        pp.ClearField("stride_w")
        pp.stride = 1
        self.window = tuple(window)
        self.layer = create_layer(lp)
        self.dense = Blob((), dtype=like.dtype, xp=like.xp, name=lp.name)
        self.layer.setup([like], [self.dense])

    def reshape(self, bottom: Blob, top: Blob) -> None:
        """Shape ``top`` as the fragments of ``bottom`` (raises ValueError when ``n + 1`` breaks the rule)."""
        shape = tuple(bottom.shape)
        frag = fragment_shape(shape[2:], self.window)
        self.layer.reshape([bottom], [self.dense])
        count = 1
        for p in self.window:
            count *= p
        top.reshape((count * shape[0], shape[1]) + frag)

    def forward(self, bottom: Blob, top: Blob) -> None:
        """Pool ``bottom`` at every offset into ``top``."""
        self.layer.forward([bottom], [self.dense])
        spatial = tuple(f * p for f, p in zip(top.shape[2:], self.window))
        crop = (slice(None), slice(None)) + tuple(slice(0, n) for n in spatial)
        fold_offsets(self.dense.data[crop], self.window, out=top.data)
