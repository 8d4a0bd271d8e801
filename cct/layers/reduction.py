"""Reduction (SUM, ASUM, SUMSQ, MEAN over the tail axes) and ArgMax (top-k indices or values)."""
from __future__ import annotations

from collections.abc import Sequence

from ..blob import Blob
from ..proto import caffe_pb2
from .base import register
from .structure_base import StructureLayer

_RED = caffe_pb2.ReductionParameter


@register("Reduction")
class ReductionLayer(StructureLayer):
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


@register("ArgMax")
class ArgMaxLayer(StructureLayer):
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
