"""Eltwise: element-wise PROD, SUM (with coefficients) or MAX of the bottoms, with Caffe's gradients."""
from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from ..blob import Blob
from ..proto import caffe_pb2
from .base import register
from .structure_base import StructureLayer, top_diff_safe

log = logging.getLogger("cct")


_PROD = caffe_pb2.EltwiseParameter.PROD
_SUM = caffe_pb2.EltwiseParameter.SUM
_MAX = caffe_pb2.EltwiseParameter.MAX


@register("Eltwise")
class EltwiseLayer(StructureLayer):
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
        top_diff = top_diff_safe(top[0], bottom)
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
