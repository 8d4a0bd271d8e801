"""Concat, Slice and Split: join blobs along an axis, cut one into pieces, copy one to many.

A one-bottom Concat and a one-top Slice share the arrays (no data moves); Split shares data and sums
the top diffs, as Caffe does.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..blob import Blob
from .base import register
from .structure_base import StructureLayer, axis_slice, top_diff_safe


@register("Concat")
class ConcatLayer(StructureLayer):
    """Concatenate the bottoms along ``axis`` (legacy ``concat_dim``); backward splits the diff."""

    param_fields = ("concat_param",)
    min_num_bottom = 1
    exact_num_top = 1

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.concat_param
        if p.HasField("axis") and p.HasField("concat_dim"):
            raise self.error("Either axis or concat_dim should be specified; not both.")

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.concat_param
        n = bottom[0].num_axes
        if p.HasField("concat_dim"):
            axis = int(p.concat_dim)
            if axis >= n:
                raise self.error(f"concat_dim {axis} out of range for {n}-D bottom with shape {list(bottom[0].shape)}")
        else:
            axis = self.canonical_axis(bottom[0], p.axis)
        self.axis = axis
        shape = list(bottom[0].shape)
        for i, b in enumerate(bottom[1:], start=1):
            if b.num_axes != n:
                raise self.error(
                    f"All inputs must have the same #axes: bottom[0] has shape {list(bottom[0].shape)}, "
                    f"bottom[{i}] has shape {list(b.shape)}")
            for j in range(n):
                if j != axis and b.shape[j] != bottom[0].shape[j]:
                    raise self.error(
                        f"All inputs must have the same shape, except at concat_axis {axis}: bottom[0] has shape "
                        f"{list(bottom[0].shape)}, bottom[{i}] has shape {list(b.shape)}")
            shape[axis] += b.shape[axis]
        if len(bottom) == 1:
            top[0].share_data(bottom[0])
            top[0].share_diff(bottom[0])
        else:
            top[0].reshape(shape)

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        if len(bottom) == 1:
            return
        off = 0
        for b in bottom:
            k = b.shape[self.axis]
            top[0].data[axis_slice(self.axis, off, off + k)] = b.data
            off += k

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if len(bottom) == 1:
            return
        off = 0
        diff = top_diff_safe(top[0], bottom)
        for b, prop in zip(bottom, propagate_down):
            k = b.shape[self.axis]
            if prop:
                b.diff[...] = diff[axis_slice(self.axis, off, off + k)]
            off += k


@register("Slice")
class SliceLayer(StructureLayer):
    """Split the bottom along ``axis`` (legacy ``slice_dim``) at ``slice_point`` or into equal parts."""

    param_fields = ("slice_param",)
    exact_num_bottom = 1
    min_num_top = 1

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.slice_param
        if p.HasField("axis") and p.HasField("slice_dim"):
            raise self.error("Either axis or slice_dim should be specified; not both.")
        self.slice_points = [int(s) for s in p.slice_point]

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.slice_param
        b = bottom[0]
        n = b.num_axes
        if p.HasField("slice_dim"):
            axis = int(p.slice_dim)
            if axis >= n:
                raise self.error(f"slice_dim {axis} out of range for {n}-D bottom with shape {list(b.shape)}")
        else:
            axis = self.canonical_axis(b, p.axis)
        self.axis = axis
        dim = b.shape[axis]
        if self.slice_points:
            if len(self.slice_points) != len(top) - 1:
                raise self.error(
                    f"{len(self.slice_points)} slice_point(s) given for {len(top)} tops; "
                    f"need exactly one fewer slice_point than tops")
            if len(top) > dim:
                raise self.error(f"{len(top)} tops exceed the size {dim} of slice axis {axis}")
            sizes = []
            prev = 0
            for sp in self.slice_points:
                if sp <= prev:
                    raise self.error(
                        f"slice_point values must be strictly increasing and positive, got {self.slice_points}")
                sizes.append(sp - prev)
                prev = sp
            if prev > dim:
                raise self.error(
                    f"slice_point {prev} is beyond the size {dim} of slice axis {axis} "
                    f"(bottom shape {list(b.shape)})")
            sizes.append(dim - prev)
        else:
            if dim % len(top) != 0:
                raise self.error(
                    f"Number of top blobs ({len(top)}) should evenly divide input slice axis ({dim})")
            sizes = [dim // len(top)] * len(top)
        self.sizes = sizes
        if len(top) == 1:
            top[0].share_data(b)
            top[0].share_diff(b)
            return
        for t, s in zip(top, sizes):
            shape = list(b.shape)
            shape[axis] = s
            t.reshape(shape)

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        if len(top) == 1:
            return
        off = 0
        for t, s in zip(top, self.sizes):
            t.data[...] = bottom[0].data[axis_slice(self.axis, off, off + s)]
            off += s

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if not propagate_down[0] or len(top) == 1:
            return
        diffs = [top_diff_safe(t, bottom) for t in top]
        off = 0
        for d, s in zip(diffs, self.sizes):
            bottom[0].diff[axis_slice(self.axis, off, off + s)] = d
            off += s


@register("Split")
class SplitLayer(StructureLayer):
    """One bottom to N tops sharing its data; backward sums the top diffs (the net inserts these)."""

    exact_num_bottom = 1
    min_num_top = 1

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        self.no_in_place(bottom, top)
        for t in top:
            t.share_data(bottom[0])

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        pass

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if not propagate_down[0]:
            return
        diff = bottom[0].diff
        if len(top) == 1:
            diff[...] = top[0].diff
            return
        bottom[0].xp.add(top[0].diff, top[1].diff, out=diff)
        for t in top[2:]:
            diff += t.diff
