"""Flatten, Reshape, Crop and Tile: change a blob's shape or extent.

Flatten and Reshape only change the view of a blob: they share its arrays (``share_data`` /
``share_diff``) as Caffe does, so forward and backward move no data.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..blob import Blob
from .base import register
from .structure_base import StructureLayer, top_diff_safe


class _ViewLayer(StructureLayer):
    """A layer whose top is a reshaped view of its one bottom: data and diff are shared, so forward
    and backward move nothing. Subclasses give the top's shape in :meth:`view_shape`."""

    exact_num_bottom = 1
    exact_num_top = 1

    def view_shape(self, b: Blob) -> list[int]:
        raise NotImplementedError

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        self.no_in_place(bottom, top)
        shape = self.view_shape(bottom[0])
        top[0].share_data(bottom[0], shape)
        top[0].share_diff(bottom[0], shape)

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        pass

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        pass


@register("Flatten")
class FlattenLayer(_ViewLayer):
    """Flatten axes ``axis`` .. ``end_axis`` (inclusive) into one; top shares bottom data and diff."""

    param_fields = ("flatten_param",)

    def view_shape(self, b: Blob) -> list[int]:
        p = self.param.flatten_param
        start = self.canonical_axis(b, p.axis, "axis")
        end = self.canonical_axis(b, p.end_axis, "end_axis")
        if end + 1 < start:
            raise self.error(f"end_axis {p.end_axis} comes before axis {p.axis} for bottom shape {list(b.shape)}")
        return list(b.shape[:start]) + [b.count_range(start, end + 1)] + list(b.shape[end + 1:])


@register("Reshape")
class ReshapeLayer(_ViewLayer):
    """Caffe's Reshape: ``shape`` with 0 = copy the bottom dim, -1 = infer; ``axis``/``num_axes`` select
    the range of bottom axes replaced. Top shares bottom data and diff."""

    param_fields = ("reshape_param",)

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        self.no_in_place(bottom, top)
        dims = [int(d) for d in self.param.reshape_param.shape.dim]
        self.copy_axes = []
        self.inferred_axis = -1
        self.constant_count = 1
        for i, d in enumerate(dims):
            if d == 0:
                self.copy_axes.append(i)
            elif d == -1:
                if self.inferred_axis != -1:
                    raise self.error(
                        f"new shape {dims} contains multiple -1 dims; at most a single (1) value of -1 "
                        f"may be specified")
                self.inferred_axis = i
            elif d < -1:
                raise self.error(f"new shape {dims} has dimension {d}; dims must be >= -1")
            else:
                self.constant_count *= d
        self.dims = dims

    def view_shape(self, b: Blob) -> list[int]:
        p = self.param.reshape_param
        n = b.num_axes
        start = p.axis if p.axis >= 0 else n + p.axis + 1
        if start < 0 or start > n:
            raise self.error(f"axis {p.axis} out of range for {n}-D input blob")
        if p.num_axes < -1:
            raise self.error("num_axes must be >= 0, or -1 for all")
        end = n if p.num_axes == -1 else start + p.num_axes
        if end > n:
            raise self.error(
                f"end_axis = axis + num_axes ({start} + {p.num_axes}) is out of range for {n}-D input blob")
        shape = list(b.shape[:start]) + list(self.dims) + list(b.shape[end:])
        for i in self.copy_axes:
            if start + i >= n:
                raise self.error(
                    f"new shape {self.dims} contains a 0, but there was no corresponding bottom axis to copy "
                    f"(bottom shape {list(b.shape)})")
            shape[start + i] = b.shape[start + i]
        if self.inferred_axis >= 0:
            explicit = self.constant_count * b.count_range(0, start) * b.count_range(end)
            for i in self.copy_axes:
                explicit *= shape[start + i]
            if explicit == 0 or b.count % explicit != 0:
                raise self.error(
                    f"bottom count ({b.count}) must be divisible by the product of the specified dimensions "
                    f"({explicit}); bottom shape {list(b.shape)}, new shape {self.dims}")
            shape[start + self.inferred_axis] = b.count // explicit
        count = int(np.prod(shape, dtype=np.int64))
        if count != b.count:
            raise self.error(
                f"output count must match input count: new shape {shape} ({count}) vs bottom shape "
                f"{list(b.shape)} ({b.count})")
        return shape


@register("Crop")
class CropLayer(StructureLayer):
    """Crop bottom[0] to the shape of bottom[1] on the axes from ``axis`` on, at ``offset``.

    One offset applies to every cropped axis; several give one per cropped axis. bottom[1]
    only supplies a shape and gets no gradient.
    """

    param_fields = ("crop_param",)
    exact_num_bottom = 2
    exact_num_top = 1

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.crop_param
        if bottom[0].num_axes != bottom[1].num_axes:
            raise self.error(
                f"bottom[0] (shape {list(bottom[0].shape)}) and bottom[1] (shape {list(bottom[1].shape)}) "
                f"must have the same number of axes")
        n = bottom[0].num_axes
        start = self.canonical_axis(bottom[0], p.axis)
        if len(p.offset) > 1 and start + len(p.offset) != n:
            raise self.error(
                f"number of offset values specified ({len(p.offset)}) must be equal to the number of "
                f"dimensions following axis {start} ({n - start})")

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.crop_param
        b0, b1 = bottom
        if b0.num_axes != b1.num_axes:
            raise self.error(
                f"bottom[0] (shape {list(b0.shape)}) and bottom[1] (shape {list(b1.shape)}) "
                f"must have the same number of axes")
        n = b0.num_axes
        start = self.canonical_axis(b0, p.axis)
        shape = list(b0.shape)
        offsets = [0] * n
        for i in range(start, n):
            if len(p.offset) == 1:
                off = int(p.offset[0])
            elif len(p.offset) > 1:
                off = int(p.offset[i - start])
            else:
                off = 0
            if b0.shape[i] - off < b1.shape[i]:
                raise self.error(
                    f"the crop for dimension {i} is out-of-bounds with size {b1.shape[i]} and offset {off} "
                    f"(bottom[0] shape {list(b0.shape)})")
            shape[i] = b1.shape[i]
            offsets[i] = off
        self.index = tuple(slice(o, o + s) for o, s in zip(offsets, shape))
        top[0].reshape(shape)

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        top[0].data[...] = bottom[0].data[self.index]

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if propagate_down[0]:
            diff = top_diff_safe(top[0], bottom)
            bottom[0].diff[...] = 0
            bottom[0].diff[self.index] = diff

    def allow_force_backward(self, bottom_index: int) -> bool:
        """bottom[1] only supplies the shape."""
        return bottom_index != 1


@register("Tile")
class TileLayer(StructureLayer):
    """Repeat the bottom ``tiles`` times along ``axis`` (blocks of axes ``axis``.. repeated whole)."""

    param_fields = ("tile_param",)
    exact_num_bottom = 1
    exact_num_top = 1

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.tile_param
        b = bottom[0]
        self.axis = self.canonical_axis(b, p.axis)
        if not p.HasField("tiles"):
            raise self.error("Number of tiles must be specified")
        if p.tiles <= 0:
            raise self.error(f"Number of tiles must be positive, got {p.tiles}")
        self.tiles = int(p.tiles)
        shape = list(b.shape)
        shape[self.axis] *= self.tiles
        self.outer = b.count_range(0, self.axis)
        self.inner = b.count_range(self.axis)
        top[0].reshape(shape)

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        out = top[0].data.reshape(self.outer, self.tiles, self.inner)
        out[...] = bottom[0].data.reshape(self.outer, 1, self.inner)

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if not propagate_down[0]:
            return
        g = top[0].diff.reshape(self.outer, self.tiles, self.inner).sum(axis=1)
        bottom[0].diff[...] = g.reshape(bottom[0].shape)
