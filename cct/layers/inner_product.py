"""InnerProduct (fully connected) layer, Caffe semantics.

The bottom is flattened to ``(M, K)`` at ``axis`` (M = product of the axes before it, K of the
axes from it on); the weight is ``(N, K)``, or ``(K, N)`` with ``transpose: true``; the top is
``bottom.shape[:axis] + (N,)``.
"""
from __future__ import annotations

from collections.abc import Sequence

from .. import blas
from ..blob import Blob
from ..errors import CctError
from .base import Layer, register


@register("InnerProduct")
class InnerProductLayer(Layer):
    """Caffe's InnerProduct: ``y = x W^T + b`` (``x W + b`` when transposed)."""

    param_fields = ("inner_product_param",)
    exact_num_bottom = 1
    exact_num_top = 1

    def _axis(self, blob: Blob) -> int:
        try:
            return blob.canonical_axis(self.param.inner_product_param.axis)
        except CctError as e:
            raise self.error(str(e)) from None

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.inner_product_param
        self.num_output = int(p.num_output)
        if self.num_output <= 0:
            raise self.error("num_output must be > 0")
        self.bias_term = bool(p.bias_term)
        self.transpose = bool(p.transpose)
        axis = self._axis(bottom[0])
        self.K = bottom[0].count_range(axis)
        wshape = (self.K, self.num_output) if self.transpose else (self.num_output, self.K)
        if self.params_given(1 + int(self.bias_term)):
            if tuple(self.blobs[0].shape) != wshape:
                raise self.error(f"Incorrect weight shape: expected shape {list(wshape)}; "
                                 f"instead, shape was {list(self.blobs[0].shape)}")
            if self.bias_term and tuple(self.blobs[1].shape) != (self.num_output,):
                raise self.error(f"Incorrect bias shape: expected shape {[self.num_output]}; "
                                 f"instead, shape was {list(self.blobs[1].shape)}")
        else:
            self.blobs = [self.make_param(wshape, p.weight_filler, like=bottom[0])]
            if self.bias_term:
                self.blobs.append(self.make_param((self.num_output,), p.bias_filler, like=bottom[0]))

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        axis = self._axis(bottom[0])
        k = bottom[0].count_range(axis)
        if k != self.K:
            raise self.error(f"Input size incompatible with inner product parameters: bottom "
                             f"{list(bottom[0].shape)} gives {k} inputs per item at axis {axis}, "
                             f"the weights expect {self.K}")
        self.M = bottom[0].count_range(0, axis)
        top[0].reshape(tuple(bottom[0].shape[:axis]) + (self.num_output,))

    def _w_nk(self):
        """The weight as ``(N, K)`` (a view)."""
        w = self.blobs[0].data
        return w.T if self.transpose else w

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        x = bottom[0].data.reshape(self.M, self.K)
        y = top[0].data.reshape(self.M, self.num_output)
        blas.matmul(x, self._w_nk().T, out=y)
        if self.bias_term:
            y += self.blobs[1].data

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        dy = top[0].diff.reshape(self.M, self.num_output)
        x = bottom[0].data.reshape(self.M, self.K)
        if self.param_propagate_down[0]:
            if self.transpose:
                blas.gemm(x, dy, trans_a=True, out=self.blobs[0].diff, beta=1.0)
            else:
                blas.gemm(dy, x, trans_a=True, out=self.blobs[0].diff, beta=1.0)
        if self.bias_term and self.param_propagate_down[1]:
            self.blobs[1].diff += dy.sum(axis=0)
        if propagate_down[0]:
            blas.matmul(dy, self._w_nk(), out=bottom[0].diff.reshape(self.M, self.K))
