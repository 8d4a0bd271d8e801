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
from ..device.driver import array_module
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


def stage_shapes(shape: Sequence[int], window: Sequence[int]) -> list[tuple[int, ...]]:
    """Shapes after pooling the spatial axes of ``shape`` ``(B, C, *n)`` one at a time (stride 1)."""
    out, cur = [], list(shape)
    for a, p in enumerate(window):
        cur[2 + a] = cur[2 + a] - p + 1
        out.append(tuple(cur))
    return out


def pool_stride1(x, window: Sequence[int], average: bool, stages: Sequence) -> None:
    """Stride-1 MAX (or AVE) pooling of ``x`` ``(B, C, *n)`` into ``stages[-1]``, one axis at a time.

    The maximum (sum) over a box is the maximum (sum) over each axis in turn, so ``p`` comparisons per
    axis replace ``prod(p)``; ``stages`` are the preallocated per-axis results (:func:`stage_shapes`).
    AVE divides by the window's size: the windows of a pooling with stride = window and no padding are
    never clipped (the sum's order differs from the one-pass sum, within float rounding).
    """
    src, xp = x, array_module(x)  # numpy, or cupy for a net on a GPU
    for a, (p, dst) in enumerate(zip(window, stages)):
        n = dst.shape[2 + a]

        def part(o, a=a, n=n, src=src):
            return src[(slice(None), slice(None)) + (slice(None),) * a + (slice(o, o + n),)]

        dst[...] = part(0)
        for o in range(1, p):
            if average:
                dst += part(o)
            else:
                xp.maximum(dst, part(o), out=dst)
        src = dst
    if average:
        count = 1
        for p in window:
            count *= p
        stages[-1] *= stages[-1].dtype.type(1.0 / count)


class FragmentPooling:
    """A MAX/AVE pooling layer (stride = window, no padding) run as max-pooling fragments.

    Inference only: no index of the maxima is kept (nothing propagates back), so the stride-1 pooling runs
    axis by axis (:func:`pool_stride1`) into buffers allocated by :meth:`reshape`, then the offsets fold
    into the batch (:func:`fold_offsets`).
    """

    def __init__(self, param: caffe_pb2.LayerParameter, window: Sequence[int], like: Blob) -> None:
        self.name = param.name
        self.window = tuple(window)
        self.average = param.pooling_param.pool == caffe_pb2.PoolingParameter.AVE
        self.xp = like.xp
        self.dtype = like.dtype
        self.stages: list = []

    def reshape(self, bottom: Blob, top: Blob) -> None:
        """Shape ``top`` as the fragments of ``bottom`` (raises ValueError when ``n + 1`` breaks the rule)."""
        shape = tuple(bottom.shape)
        frag = fragment_shape(shape[2:], self.window)
        shapes = stage_shapes(shape, self.window)
        if [s.shape for s in self.stages] != shapes:
            self.stages = [self.xp.empty(s, dtype=self.dtype) for s in shapes]
        count = 1
        for p in self.window:
            count *= p
        top.reshape((count * shape[0], shape[1]) + frag)

    def forward(self, bottom: Blob, top: Blob) -> None:
        """Pool ``bottom`` at every offset into ``top``."""
        pool_stride1(bottom.data, self.window, self.average, self.stages)
        fold_offsets(self.stages[-1], self.window, out=top.data)
