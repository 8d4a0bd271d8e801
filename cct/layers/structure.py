"""Structure layers: Caffe's layers that route, combine, reshape or select blobs.

Concat, Slice, Split, Eltwise, Flatten, Reshape, Crop, Tile, Reduction, ArgMax, Silence,
Embed, Filter, BatchReindex and Parameter, each with BVLC Caffe's shapes, defaults, checks
and gradients. Layers that only change the view of a blob (Flatten, Reshape, a one-bottom
Concat, a one-top Slice, Parameter) share the arrays (``share_data`` / ``share_diff``) as
Caffe does, so their forward and backward passes move no data; Split shares data only and
sums the top diffs.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from ..blob import Blob
from ..errors import CctError
from ..proto import caffe_pb2
from .base import Layer, register

log = logging.getLogger("cct")


def _axis_slice(axis: int, start: int, stop: int) -> tuple:
    """Index tuple selecting ``[start, stop)`` along ``axis`` (all of every earlier axis)."""
    return (slice(None),) * axis + (slice(start, stop),)


def _index_add(xp, target, index, values) -> None:
    """``target[index] += values`` with repeated indices accumulating (numpy or cupy)."""
    if xp is np:
        np.add.at(target, index, values)
    else:  # pragma: no cover - needs a GPU
        import cupyx

        cupyx.scatter_add(target, index, values)


def _top_diff_safe(top: Blob, bottom: Sequence[Blob]):
    """``top.diff``, copied when the top is also a bottom (in place), so writing bottom diffs cannot clobber it."""
    if any(b is top for b in bottom):
        return top.diff.copy()
    return top.diff


class _StructureLayer(Layer):
    """Shared helpers for this module."""

    def canonical_axis(self, blob: Blob, axis: int, what: str = "axis") -> int:
        """Caffe's CanonicalAxisIndex with an error naming this layer and the blob's shape."""
        n = blob.num_axes
        if not -n <= axis < n:
            raise self.error(f"{what} {axis} out of range for {n}-D blob with shape {list(blob.shape)}")
        return axis + n if axis < 0 else axis

    def no_in_place(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        for t in top:
            if any(t is b for b in bottom):
                raise self.error(f"{self.type} layer does not allow in-place computation")


# ---------------------------------------------------------------------------------------------
@register("Concat")
class ConcatLayer(_StructureLayer):
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
            top[0].data[_axis_slice(self.axis, off, off + k)] = b.data
            off += k

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if len(bottom) == 1:
            return
        off = 0
        diff = _top_diff_safe(top[0], bottom)
        for b, prop in zip(bottom, propagate_down):
            k = b.shape[self.axis]
            if prop:
                b.diff[...] = diff[_axis_slice(self.axis, off, off + k)]
            off += k


# ---------------------------------------------------------------------------------------------
@register("Slice")
class SliceLayer(_StructureLayer):
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
            t.data[...] = bottom[0].data[_axis_slice(self.axis, off, off + s)]
            off += s

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if not propagate_down[0] or len(top) == 1:
            return
        diffs = [_top_diff_safe(t, bottom) for t in top]
        off = 0
        for d, s in zip(diffs, self.sizes):
            bottom[0].diff[_axis_slice(self.axis, off, off + s)] = d
            off += s


# ---------------------------------------------------------------------------------------------
@register("Split")
class SplitLayer(_StructureLayer):
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


# ---------------------------------------------------------------------------------------------
_PROD = caffe_pb2.EltwiseParameter.PROD
_SUM = caffe_pb2.EltwiseParameter.SUM
_MAX = caffe_pb2.EltwiseParameter.MAX


@register("Eltwise")
class EltwiseLayer(_StructureLayer):
    """Element-wise PROD, SUM (with one ``coeff`` per bottom) or MAX of two or more bottoms.

    MAX ties follow Caffe's CPU code exactly: bottom[0] and bottom[1] are compared with a
    strict ``>``, so on a tie between those two bottom[1] wins; every later bottom replaces the
    running maximum only when strictly greater, so among later bottoms the earlier one wins.
    The whole gradient goes to the winning bottom.
    """

    param_fields = ("eltwise_param",)
    min_num_bottom = 2
    exact_num_top = 1

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.eltwise_param
        self.op = p.operation
        if p.coeff and len(p.coeff) != len(bottom):
            raise self.error(
                f"Eltwise Layer takes one coefficient per bottom blob: {len(p.coeff)} coeff(s) "
                f"for {len(bottom)} bottoms")
        if self.op == _PROD and p.coeff:
            raise self.error("Eltwise layer only takes coefficients for summation.")
        if self.op == _MAX and p.coeff:
            log.warning("layer '%s' (type Eltwise): coeff has no effect with operation MAX (as in Caffe)",
                        self.name)
        self.coeffs = [float(c) for c in p.coeff] if p.coeff else [1.0] * len(bottom)
        self.stable_prod_grad = bool(p.stable_prod_grad)
        self._mask = None

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        for i, b in enumerate(bottom[1:], start=1):
            if b.shape != bottom[0].shape:
                raise self.error(
                    f"all bottoms must have the same shape: bottom[0]: {bottom[0].shape_string()}, "
                    f"bottom[{i}]: {b.shape_string()}")
        top[0].reshape(bottom[0].shape)

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        xp = bottom[0].xp
        if self.op == _PROD:
            out = bottom[0].data * bottom[1].data
            for b in bottom[2:]:
                out *= b.data
        elif self.op == _SUM:
            out = xp.zeros_like(bottom[0].data)
            for c, b in zip(self.coeffs, bottom):
                out += b.data if c == 1.0 else c * b.data
        else:
            a, b1 = bottom[0].data, bottom[1].data
            first = a > b1
            out = xp.where(first, a, b1)
            mask = xp.where(first, 0, 1).astype(np.int32)
            for k, b in enumerate(bottom[2:], start=2):
                upd = b.data > out
                out = xp.where(upd, b.data, out)
                mask[upd] = k
            self._mask = mask
        top[0].data[...] = out

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        xp = bottom[0].xp
        top_diff = _top_diff_safe(top[0], bottom)
        in_place = any(b is top[0] for b in bottom)
        if self.op == _PROD:
            top_data = top[0].data.copy() if in_place else top[0].data
            grads = []
            for i, b in enumerate(bottom):
                if not propagate_down[i]:
                    grads.append(None)
                    continue
                if self.stable_prod_grad:
                    g = None
                    for j, other in enumerate(bottom):
                        if j == i:
                            continue
                        g = other.data.copy() if g is None else g * other.data
                else:
                    g = top_data / b.data
                grads.append(g * top_diff)
            for b, g in zip(bottom, grads):
                if g is not None:
                    b.diff[...] = g
        elif self.op == _SUM:
            for i, b in enumerate(bottom):
                if propagate_down[i]:
                    c = self.coeffs[i]
                    b.diff[...] = top_diff if c == 1.0 else c * top_diff
        else:
            for i, b in enumerate(bottom):
                if propagate_down[i]:
                    b.diff[...] = xp.where(self._mask == i, top_diff, 0)


# ---------------------------------------------------------------------------------------------
@register("Flatten")
class FlattenLayer(_StructureLayer):
    """Flatten axes ``axis`` .. ``end_axis`` (inclusive) into one; top shares bottom data and diff."""

    param_fields = ("flatten_param",)
    exact_num_bottom = 1
    exact_num_top = 1

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        self.no_in_place(bottom, top)
        p = self.param.flatten_param
        b = bottom[0]
        start = self.canonical_axis(b, p.axis, "axis")
        end = self.canonical_axis(b, p.end_axis, "end_axis")
        if end + 1 < start:
            raise self.error(f"end_axis {p.end_axis} comes before axis {p.axis} for bottom shape {list(b.shape)}")
        shape = list(b.shape[:start]) + [b.count_range(start, end + 1)] + list(b.shape[end + 1:])
        top[0].share_data(b, shape)
        top[0].share_diff(b, shape)

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        pass

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        pass


# ---------------------------------------------------------------------------------------------
@register("Reshape")
class ReshapeLayer(_StructureLayer):
    """Caffe's Reshape: ``shape`` with 0 = copy the bottom dim, -1 = infer; ``axis``/``num_axes`` select
    the range of bottom axes replaced. Top shares bottom data and diff."""

    param_fields = ("reshape_param",)
    exact_num_bottom = 1
    exact_num_top = 1

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

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        self.no_in_place(bottom, top)
        p = self.param.reshape_param
        b = bottom[0]
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
        top[0].share_data(b, shape)
        top[0].share_diff(b, shape)

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        pass

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        pass


# ---------------------------------------------------------------------------------------------
@register("Crop")
class CropLayer(_StructureLayer):
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
            diff = _top_diff_safe(top[0], bottom)
            bottom[0].diff[...] = 0
            bottom[0].diff[self.index] = diff

    def allow_force_backward(self, bottom_index: int) -> bool:
        """bottom[1] only supplies the shape."""
        return bottom_index != 1


# ---------------------------------------------------------------------------------------------
@register("Tile")
class TileLayer(_StructureLayer):
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


# ---------------------------------------------------------------------------------------------
_RED = caffe_pb2.ReductionParameter


@register("Reduction")
class ReductionLayer(_StructureLayer):
    """Reduce all axes from ``axis`` on with SUM, ASUM, SUMSQ or MEAN, times ``coeff``.

    The top keeps the axes before ``axis``: the default ``axis: 0`` gives a 0-d (scalar) top.
    """

    param_fields = ("reduction_param",)
    exact_num_bottom = 1
    exact_num_top = 1

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        self.op = self.param.reduction_param.operation
        if self.op not in (_RED.SUM, _RED.ASUM, _RED.SUMSQ, _RED.MEAN):
            raise self.error(f"Unknown reduction op: {self.op}")

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.reduction_param
        b = bottom[0]
        self.axis = self.canonical_axis(b, p.axis)
        self.num = b.count_range(0, self.axis)
        self.dim = b.count_range(self.axis)
        coeff = b.dtype.type(p.coeff)
        if self.op == _RED.MEAN:
            coeff = coeff / b.dtype.type(self.dim)
        self.coeff = coeff
        top[0].reshape(b.shape[:self.axis])

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        x = bottom[0].data.reshape(self.num, self.dim)
        xp = bottom[0].xp
        if self.op in (_RED.SUM, _RED.MEAN):
            r = x.sum(axis=1)
        elif self.op == _RED.ASUM:
            r = xp.abs(x).sum(axis=1)
        else:
            r = (x * x).sum(axis=1)
        if self.coeff != 1:
            r = r * self.coeff
        top[0].data[...] = r.reshape(top[0].shape)

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if not propagate_down[0]:
            return
        xp = bottom[0].xp
        g = (top[0].diff.reshape(self.num, 1) * self.coeff)
        x = bottom[0].data.reshape(self.num, self.dim)
        if self.op in (_RED.SUM, _RED.MEAN):
            d = xp.broadcast_to(g, (self.num, self.dim))
        elif self.op == _RED.ASUM:
            d = xp.sign(x) * g
        else:
            d = x * (2 * g)
        bottom[0].diff[...] = d.reshape(bottom[0].shape)


# ---------------------------------------------------------------------------------------------
@register("ArgMax")
class ArgMaxLayer(_StructureLayer):
    """Indices (and with ``out_max_val`` values) of the ``top_k`` largest entries.

    Without ``axis``: over each item's flattened ``count(1)`` values; top ``(N, 1, top_k)``
    (``(N, 2, top_k)`` with out_max_val: indices then values), padded with trailing 1s to the
    bottom's number of axes. With ``axis``: that axis becomes ``top_k`` long and holds the
    indices, or the values only when ``out_max_val``.

    Order and ties: Caffe partially sorts (value, index) pairs with ``std::greater``, a strict
    total order on pairs, so its result is deterministic: descending value, and among equal
    values the LARGER index first. We reproduce exactly that order (a stable sort of the
    reversed sequence). NaN inputs have no defined order in Caffe. Forward only.
    """

    param_fields = ("argmax_param",)
    exact_num_bottom = 1
    exact_num_top = 1

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.argmax_param
        self.out_max_val = bool(p.out_max_val)
        self.top_k = int(p.top_k)
        self.has_axis = p.HasField("axis")
        if self.top_k < 1:
            raise self.error("top k must not be less than 1.")

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        b = bottom[0]
        if self.has_axis:
            self.axis = self.canonical_axis(b, self.param.argmax_param.axis)
            if self.top_k > b.shape[self.axis]:
                raise self.error(
                    f"top_k ({self.top_k}) must be less than or equal to the dimension of the axis "
                    f"({b.shape[self.axis]})")
            shape = list(b.shape)
            shape[self.axis] = self.top_k
        else:
            if b.num_axes < 1:
                raise self.error("bottom must have at least one axis")
            if self.top_k > b.count_range(1):
                raise self.error(
                    f"top_k ({self.top_k}) must be less than or equal to the dimension of the flattened "
                    f"bottom blob per instance ({b.count_range(1)})")
            shape = [1] * max(b.num_axes, 3)
            shape[0] = b.shape[0]
            shape[2] = self.top_k
            if self.out_max_val:
                shape[1] = 2
        top[0].reshape(shape)

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        b = bottom[0]
        xp = b.xp
        k = self.top_k
        if self.has_axis:
            x = xp.moveaxis(b.data, self.axis, -1)
        else:
            x = b.data.reshape(b.shape[0], -1)
        dim = x.shape[-1]
        rev = x[..., ::-1]
        order = xp.argsort(-rev, axis=-1, kind="stable")[..., :k]
        idx = (dim - 1) - order
        vals = xp.take_along_axis(x, idx, axis=-1)
        if self.has_axis:
            res = vals if self.out_max_val else idx.astype(b.dtype)
            top[0].data[...] = xp.moveaxis(res, -1, self.axis)
        else:
            out = top[0].data.reshape(b.shape[0], -1)
            out[:, :k] = idx
            if self.out_max_val:
                out[:, k:2 * k] = vals

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if any(propagate_down):
            raise self.error("ArgMax has no backward pass (Caffe: NOT_IMPLEMENTED)")


# ---------------------------------------------------------------------------------------------
@register("Silence")
class SilenceLayer(_StructureLayer):
    """Consumes bottoms and produces nothing; backward zeroes the bottom diffs."""

    min_num_bottom = 1
    exact_num_top = 0

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        pass

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        pass

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        for b, prop in zip(bottom, propagate_down):
            if prop:
                b.diff[...] = 0


# ---------------------------------------------------------------------------------------------
@register("Embed")
class EmbedLayer(_StructureLayer):
    """Look up rows of a ``(input_dim, num_output)`` weight by integer indices (stored as floats).

    Top shape = bottom shape + ``(num_output,)``; optional bias. Indices must be integers in
    ``[0, input_dim)``. No gradient to the index bottom; weight gradients accumulate over
    repeated indices.
    """

    param_fields = ("embed_param",)
    exact_num_bottom = 1
    exact_num_top = 1

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.embed_param
        self.N = int(p.num_output)
        if self.N <= 0:
            raise self.error("EmbedLayer num_output must be positive.")
        self.K = int(p.input_dim)
        if self.K <= 0:
            raise self.error("EmbedLayer input_dim must be positive.")
        self.bias_term = bool(p.bias_term)
        n_params = 2 if self.bias_term else 1
        if self.params_given(n_params):
            if self.blobs[0].shape != (self.K, self.N):
                raise self.error(f"weight blob has shape {list(self.blobs[0].shape)}, expected {[self.K, self.N]}")
            if self.bias_term and self.blobs[1].shape != (self.N,):
                raise self.error(f"bias blob has shape {list(self.blobs[1].shape)}, expected {[self.N]}")
        else:
            self.blobs = [self.make_param((self.K, self.N), p.weight_filler, like=bottom[0])]
            if self.bias_term:
                self.blobs.append(self.make_param((self.N,), p.bias_filler, like=bottom[0]))
        self.param_propagate_down = [True] * len(self.blobs)

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        top[0].reshape(tuple(bottom[0].shape) + (self.N,))

    def _indices(self, bottom: Blob):
        xp = bottom.xp
        data = bottom.data.reshape(-1)
        idx = data.astype(np.int64)
        bad = (idx < 0) | (idx >= self.K) | (idx.astype(data.dtype) != data)
        if bool(xp.any(bad)):
            first = int(xp.argmax(bad))
            raise self.error(
                f"index {float(data[first])!r} at position {first} is not an integer in [0, input_dim={self.K})")
        return idx

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        idx = self._indices(bottom[0])
        out = top[0].data.reshape(-1, self.N)
        out[...] = self.blobs[0].data[idx]
        if self.bias_term:
            out += self.blobs[1].data

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if propagate_down[0]:
            raise self.error("Can't backpropagate to EmbedLayer input.")
        g = top[0].diff.reshape(-1, self.N)
        if self.param_propagate_down[0]:
            idx = self._indices(bottom[0])
            _index_add(bottom[0].xp, self.blobs[0].diff, idx, g)
        if self.bias_term and self.param_propagate_down[1]:
            self.blobs[1].diff += g.sum(axis=0)

    def allow_force_backward(self, bottom_index: int) -> bool:
        """The index bottom cannot get a gradient."""
        return False


# ---------------------------------------------------------------------------------------------
@register("Filter")
class FilterLayer(_StructureLayer):
    """Keep the items (axis 0) of bottoms[:-1] whose selector (last bottom) is nonzero.

    As in Caffe, the very first reshape (at setup, before any selector values exist) gives
    the tops the bottoms' full batch size; later reshapes use the selector.
    """

    min_num_bottom = 2
    min_num_top = 1

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        if len(top) != len(bottom) - 1:
            raise self.error(f"needs one top per filtered bottom: {len(bottom) - 1} expected, got {len(top)}")
        self.first_reshape = True
        self.num_bottom = len(bottom)

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        sel = bottom[-1]
        if sel.num_axes < 1:
            raise self.error("the selector blob needs at least one axis")
        for i in range(1, sel.num_axes):
            if sel.shape[i] != 1:
                raise self.error(
                    f"Selector blob dimensions must be singletons (1), except the first; got {list(sel.shape)}")
        for i, b in enumerate(bottom[:-1]):
            if b.num_axes < 1 or b.shape[0] != sel.shape[0]:
                raise self.error(
                    f"Each bottom should have the same 0th dimension as the selector blob: bottom[{i}] shape "
                    f"{list(b.shape)}, selector shape {list(sel.shape)}")
        xp = sel.xp
        self.indices = xp.nonzero(sel.data.reshape(-1) != 0)[0]
        n = int(self.indices.shape[0])
        if self.first_reshape:
            n = bottom[0].shape[0]
            self.first_reshape = False
        for t, b in zip(top, bottom):
            t.reshape((n,) + tuple(b.shape[1:]))

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        for t, b in zip(top, bottom):
            t.data[...] = b.data[self.indices]

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if propagate_down[-1]:
            raise self.error("Layer cannot backpropagate to filter index inputs")
        for i, t in enumerate(top):
            if propagate_down[i]:
                diff = _top_diff_safe(t, bottom)
                bottom[i].diff[...] = 0
                bottom[i].diff[self.indices] = diff

    def allow_force_backward(self, bottom_index: int) -> bool:
        """The selector gets no gradient."""
        n = len(self.param.bottom) or getattr(self, "num_bottom", 0)
        return bottom_index != n - 1


# ---------------------------------------------------------------------------------------------
@register("BatchReindex")
class BatchReindexLayer(_StructureLayer):
    """top[i] = bottom[0][bottom[1][i]] along axis 0; backward accumulates; no gradient to the indices."""

    exact_num_bottom = 2
    exact_num_top = 1

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        if bottom[1].num_axes != 1:
            raise self.error(f"the index bottom must be 1-D, got shape {list(bottom[1].shape)}")
        if bottom[0].num_axes < 1:
            raise self.error("bottom[0] needs at least one axis")
        top[0].reshape((bottom[1].shape[0],) + tuple(bottom[0].shape[1:]))

    def _indices(self, bottom):
        xp = bottom[0].xp
        r = bottom[1].data
        num = bottom[0].shape[0]
        if r.size:
            if bool(xp.any(r < 0)):
                raise self.error("Index specified for reindex layer was negative.")
            if bool(xp.any(r >= num)):
                raise self.error(f"Index specified for reindex layer was greater than batch size ({num}).")
        return r.astype(np.int64)  # truncation toward zero, as Caffe's static_cast<int>

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        idx = self._indices(bottom)
        if top[0].count == 0:
            return
        top[0].data[...] = bottom[0].data[idx]

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if propagate_down[1]:
            raise self.error("Cannot backprop to index.")
        if not propagate_down[0]:
            return
        idx = self._indices(bottom)
        diff = _top_diff_safe(top[0], bottom)
        bottom[0].diff[...] = 0
        _index_add(bottom[0].xp, bottom[0].diff, idx, diff)

    def allow_force_backward(self, bottom_index: int) -> bool:
        """The index bottom gets no gradient."""
        return bottom_index != 1


# ---------------------------------------------------------------------------------------------
@register("Parameter")
class ParameterLayer(_StructureLayer):
    """One learnable blob of ``parameter_param.shape`` exposed as the top (data and diff shared)."""

    param_fields = ("parameter_param",)
    exact_num_bottom = 0
    exact_num_top = 1

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        shape = tuple(int(d) for d in self.param.parameter_param.shape.dim)
        if self.params_given(1):
            if self.blobs[0].shape != shape:
                raise self.error(f"parameter blob has shape {list(self.blobs[0].shape)}, expected {list(shape)}")
        else:
            try:
                self.blobs = [self.make_param(shape, None, like=top[0])]
            except CctError as e:
                raise self.error(str(e)) from e
        self.param_propagate_down = [True]

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        top[0].share_data(self.blobs[0])
        top[0].share_diff(self.blobs[0])

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        top[0].share_data(self.blobs[0])
        top[0].share_diff(self.blobs[0])

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        pass
