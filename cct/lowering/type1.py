"""Type 1 lowering (CcT's "expensive lowering", i.e. Caffe's im2col), batched over the whole batch.

Lowering: the whole batch ``x`` ``(N, C, *in)`` becomes one matrix per group,
``(G, C/G * prod(k), N * P)`` (P = output pixels), laid out so each group's block is one
contiguous GEMM operand. One ``matmul`` (batched over groups) with the weights
``(G, M/G, C/G * prod(k))`` gives ``(G, M/G, N * P)``; lifting is a transpose to
``(N, M, *out)``. The backward passes are the transposed GEMMs plus col2im.

1x1 convolutions (kernel 1, stride 1, pad 0) skip im2col: the input already is the lowered
matrix, multiplied per image by a broadcast matmul.
"""
from __future__ import annotations

from typing import Any

from .. import blas
from ..backend import get_array_module
from .base import LoweringStrategy, register_strategy
from .geometry import ConvGeometry
from .im2col import col2im, im2col


def _col_buffer_view(buf: Any, nd: int) -> Any:
    """View a ``(C, *K, N, *O)`` buffer as ``(N, C, *K, *O)`` (the im2col layout)."""
    axes = (nd + 1, 0) + tuple(range(1, nd + 1)) + tuple(range(nd + 2, 2 * nd + 2))
    return buf.transpose(axes)


def _group_major(a: Any, n: int, g: int, per_group: int, p: int) -> Any:
    """``(N, G * per_group, *spatial)`` -> ``(G, per_group, N * P)`` (copy)."""
    xp = get_array_module(a)
    t = a.reshape(n, g, per_group, p).transpose(1, 2, 0, 3)
    return xp.ascontiguousarray(t).reshape(g, per_group, n * p)


class Type1Lowering(LoweringStrategy):
    """im2col over the batch, one GEMM per group, trivial lifting (see module docstring)."""

    name = "type1"

    # -- helpers -------------------------------------------------------------------
    @staticmethod
    def lower(x: Any, geom: ConvGeometry) -> Any:
        """The lowered input: ``(G, kernel_dim, N * P)``."""
        xp = get_array_module(x)
        n = x.shape[0]
        nd = geom.num_spatial
        buf = xp.empty((geom.channels_in,) + tuple(geom.kernel) + (n,) + tuple(geom.out_shape), dtype=x.dtype)
        im2col(x, geom.kernel, geom.pad, geom.stride, geom.dilation, geom.out_shape, out=_col_buffer_view(buf, nd))
        return buf.reshape(geom.group, geom.kernel_dim, n * geom.out_size)

    # -- the three products -------------------------------------------------------------
    def forward(self, x: Any, w: Any, b: Any, geom: ConvGeometry) -> Any:
        n = x.shape[0]
        g, m, p = geom.group, geom.channels_out, geom.out_size
        mg = m // g
        wg = w.reshape(g, mg, geom.kernel_dim)
        if geom.is_1x1:
            y = blas.matmul(wg, x.reshape(n, g, geom.kernel_dim, p)).reshape((n, m) + tuple(geom.out_shape))
        else:
            y = blas.matmul(wg, self.lower(x, geom))  # (G, M/G, N*P)
            y = y.reshape((m, n) + tuple(geom.out_shape)).swapaxes(0, 1)
        if b is not None:
            y = y + b.reshape((m,) + (1,) * geom.num_spatial)
        return y

    def backward_data(self, dy: Any, w: Any, geom: ConvGeometry) -> Any:
        n = dy.shape[0]
        g, p = geom.group, geom.out_size
        mg = geom.channels_out // g
        wt = w.reshape(g, mg, geom.kernel_dim).transpose(0, 2, 1)  # (G, K, M/G)
        if geom.is_1x1:
            dx = blas.matmul(wt, dy.reshape(n, g, mg, p))  # (N, G, C/G, P)
            return dx.reshape((n, geom.channels_in) + tuple(geom.in_shape))
        dcol = blas.matmul(wt, _group_major(dy, n, g, mg, p))  # (G, K, N*P)
        nd = geom.num_spatial
        dcol = dcol.reshape((geom.channels_in,) + tuple(geom.kernel) + (n,) + tuple(geom.out_shape))
        return col2im(_col_buffer_view(dcol, nd), geom.in_shape, geom.kernel, geom.pad, geom.stride, geom.dilation)

    def backward_weights(self, dy: Any, x: Any, geom: ConvGeometry) -> tuple[Any, Any]:
        n = dy.shape[0]
        g, p = geom.group, geom.out_size
        mg = geom.channels_out // g
        dyg = _group_major(dy, n, g, mg, p)  # (G, M/G, N*P)
        if geom.is_1x1:
            col = _group_major(x, n, g, geom.kernel_dim, p)
        else:
            col = self.lower(x, geom)
        dw = blas.matmul(dyg, col.transpose(0, 2, 1)).reshape(geom.weight_shape)
        db = None
        if geom.bias_term:
            db = dy.reshape(n, geom.channels_out, p).sum(axis=(0, 2))
        return dw, db


register_strategy("type1", Type1Lowering)
