"""Type 1 lowering (CcT's "expensive lowering", i.e. Caffe's im2col), batched over the batch.

Lowering: ``b`` images ``x`` ``(b, C, *in)`` become one matrix per group,
``(G, C/G * prod(k), b * P)`` (P = output pixels), laid out so each group's block is one
contiguous GEMM operand. One ``matmul`` (batched over groups) with the weights
``(G, M/G, C/G * prod(k))`` gives ``(G, M/G, b * P)``; lifting is a transpose to
``(b, M, *out)`` fused with the bias add. The backward passes are the transposed GEMMs plus col2im.

How many images one lowering covers (``b``) is the caller's choice: :class:`~cct.lowering.
partition.BatchedLowering` runs the batch in chunks of ``b_p`` images chosen by the cost model
(CcT lowers the whole batch when that pays; for small layers a chunk whose lowered matrix stays
in cache is faster). The chunk entry points write into caller-given arrays and reuse their
workspace across calls (per calling thread):

* :meth:`Type1Lowering.forward_into` -- convolution + bias straight into the top's layout
  (with ``b = 1`` the GEMM writes the image's ``(M, P)`` block itself: no transpose);
* :meth:`Type1Lowering.backward_into` -- weight gradient, bias gradient and data gradient of a
  chunk from ONE im2col of the chunk (recomputed while it is hot in cache, not kept from the
  forward pass); the col buffer is reused for the data-gradient GEMM's output, then col2im.

1x1 convolutions (kernel 1, stride 1, pad 0) skip im2col: the input already is the lowered
matrix, multiplied per image by a broadcast matmul.
"""
from __future__ import annotations

import threading
from typing import Any

from .. import blas
from ..device.driver import array_module
from .base import IntoLowering, register_strategy
from .gemm_ops import GemmLoweringOps
from .geometry import ConvGeometry
from .im2col import col2im, im2col

# Workspace arrays up to this size are kept between calls (per strategy object and thread, as Caffe
# keeps a col_buffer per layer); larger ones (CaffeNet-size whole-batch lowerings) are allocated per
# call. A freshly mapped 50 MB lowered matrix costs its page faults on every call (measured: type 1
# at n=13, d=256, o=128, batch 32 ran at 8.2-9.3 ms with its buffer kept, 10.3-11.2 ms without).
WORKSPACE_CACHE_BYTES = 128 << 20


def _col_buffer_view(buf: Any, nd: int) -> Any:
    """View a ``(C, *K, N, *O)`` buffer as ``(N, C, *K, *O)`` (the im2col layout)."""
    axes = (nd + 1, 0) + tuple(range(1, nd + 1)) + tuple(range(nd + 2, 2 * nd + 2))
    return buf.transpose(axes)


def _group_major(a: Any, n: int, g: int, per_group: int, p: int, out: Any = None) -> Any:
    """``(N, G * per_group, *spatial)`` -> ``(G, per_group, N * P)`` (copy, into ``out`` if given)."""
    xp = array_module(a)
    t = a.reshape(n, g, per_group, p).transpose(1, 2, 0, 3)
    if out is None:
        return xp.ascontiguousarray(t).reshape(g, per_group, n * p)
    o = out.reshape(g, per_group, n, p)
    o[...] = t
    return out.reshape(g, per_group, n * p)


class Type1Lowering(GemmLoweringOps, IntoLowering):
    """im2col over the batch, one GEMM per group, trivial lifting (see module docstring)."""

    name = "type1"
    im2col = True

    def lowered_axes(self, geom: ConvGeometry) -> tuple[int, ...]:
        """Every spatial axis (im2col)."""
        return tuple(range(geom.num_spatial))

    def __init__(self) -> None:
        self._tls = threading.local()

    # -- workspace ---------------------------------------------------------------------------
    def _buffer(self, key: str, shape: tuple, dtype: Any, xp: Any) -> Any:
        """A work array of ``shape`` (contents undefined), reused across calls when small enough."""
        size = 1
        for s in shape:
            size *= int(s)
        nbytes = size * xp.dtype(dtype).itemsize
        if nbytes > WORKSPACE_CACHE_BYTES:
            return xp.empty(shape, dtype=dtype)
        cache = getattr(self._tls, "bufs", None)
        if cache is None:
            cache = self._tls.bufs = {}
        flat = cache.get(key)
        if flat is None or flat.size < size or flat.dtype != dtype or array_module(flat) is not xp:
            flat = cache[key] = xp.empty(size, dtype=dtype)
        return flat[:size].reshape(shape)

    # -- helpers -------------------------------------------------------------------------------
    @staticmethod
    def lower(x: Any, geom: ConvGeometry, out: Any = None) -> Any:
        """The lowered input: ``(G, kernel_dim, N * P)`` (written into ``out``, a flat-able buffer, if given)."""
        xp = array_module(x)
        n = x.shape[0]
        nd = geom.num_spatial
        shape = (geom.channels_in,) + tuple(geom.kernel) + (n,) + tuple(geom.out_shape)
        buf = xp.empty(shape, dtype=x.dtype) if out is None else out.reshape(shape)
        im2col(x, geom.kernel, geom.pad, geom.stride, geom.dilation, geom.out_shape, out=_col_buffer_view(buf, nd))
        return buf.reshape(geom.group, geom.kernel_dim, n * geom.out_size)

    def _col(self, n: int, geom: ConvGeometry, dtype: Any, xp: Any) -> Any:
        return self._buffer("col", (geom.group, geom.kernel_dim, n * geom.out_size), dtype, xp)

    # -- chunk entry points (write into given arrays) ------------------------------------------
    def forward_into(self, x: Any, w: Any, b: Any, geom: ConvGeometry, out: Any) -> Any:
        """``out[...] = conv(x, w) + b`` for ``x`` ``(n, C, *in)``; ``out`` ``(n, M, *out)`` (C-contiguous)."""
        xp = array_module(x)
        n = x.shape[0]
        g, m, p = geom.group, geom.channels_out, geom.out_size
        mg = m // g
        wg = w.reshape(g, mg, geom.kernel_dim)
        if n == 0:
            return out
        if geom.is_1x1:
            blas.matmul(wg, x.reshape(n, g, geom.kernel_dim, p), out=out.reshape(n, g, mg, p))
            if b is not None:
                out.reshape(n, m, p)[...] += b.reshape(m, 1)
            return out
        col = self.lower(x, geom, out=self._col(n, geom, x.dtype, xp))
        if n == 1:  # the GEMM writes the image's (M, P) block directly
            blas.matmul(wg, col, out=out.reshape(g, mg, p))
            if b is not None:
                out.reshape(m, p)[...] += b.reshape(m, 1)
            return out
        res = self._buffer("res", (g, mg, n * p), x.dtype, xp)
        blas.matmul(wg, col, out=res)
        lifted = res.reshape(m, n, p).swapaxes(0, 1)
        if b is not None:
            xp.add(lifted, b.reshape(m, 1), out=out.reshape(n, m, p))
        else:
            out.reshape(n, m, p)[...] = lifted
        return out

    #: :meth:`backward_into` can accumulate the weight gradient transposed (``dwt``), see there
    transposed_weight_grad = True

    def backward_into(self, dy: Any, x: Any, w: Any, geom: ConvGeometry, dw: Any = None, db: Any = None,
                      dx: Any = None, dwt: Any = None) -> None:
        """Gradients of a chunk from one im2col: ``dw += ...`` (``weight_shape`` or ``(G, M/G, K)``),
        ``db += ...`` (``(M,)``), ``dx[...] = ...`` (``(n, C, *in)``); each None to skip.

        ``dwt`` (instead of ``dw``): a ``(G, K, M/G)`` array the *transposed* weight gradient is
        accumulated into by the GEMM itself (``beta = 1``). A caller running many chunks
        (:class:`~cct.lowering.partition.BatchedLowering`) passes one and transposes it into ``dw``
        once at the end, instead of one strided transpose-add of the whole weight per chunk.
        """
        xp = array_module(dy)
        n = dy.shape[0]
        if n == 0:
            if dx is not None:
                dx[...] = 0
            return
        g, m, p = geom.group, geom.channels_out, geom.out_size
        mg, kd = m // g, geom.kernel_dim
        if db is not None:
            db += dy.reshape(n, m, p).sum(axis=(0, 2))
        if dw is None and dwt is None and dx is None:
            return
        if n == 1:
            dyg = dy.reshape(g, mg, p)
        else:
            dyg = _group_major(dy, n, g, mg, p, out=self._buffer("dyg", (g, mg, n * p), dy.dtype, xp))
        col = None
        if dw is not None or dwt is not None:
            if geom.is_1x1:
                col = x.reshape(g, kd, p) if n == 1 else _group_major(
                    x, n, g, kd, p, out=self._buffer("xg", (g, kd, n * p), x.dtype, xp))
            else:
                col = self.lower(x, geom, out=self._col(n, geom, x.dtype, xp))
            # dW^T = col @ dy^T: OpenBLAS runs this orientation about 2x faster than dy @ col^T
            # (measured for thin M, both contracting over the contiguous pixel axis)
            if dwt is not None:
                for gi in range(g):
                    blas.gemm(col[gi], dyg[gi], out=dwt[gi], trans_b=True, beta=1.0)
            else:
                tmp = self._buffer("dwt", (g, kd, mg), dy.dtype, xp)
                blas.matmul(col, dyg.transpose(0, 2, 1), out=tmp)
                dw.reshape(g, mg, kd)[...] += tmp.transpose(0, 2, 1)
        if dx is None:
            return
        wt = w.reshape(g, mg, kd).transpose(0, 2, 1)  # (G, K, M/G)
        if geom.is_1x1:
            blas.matmul(wt, dy.reshape(n, g, mg, p), out=dx.reshape(n, g, kd, p))
            return
        dcol = col if col is not None else self._col(n, geom, dy.dtype, xp)  # reuse the col buffer
        blas.matmul(wt, dyg, out=dcol)
        nd = geom.num_spatial
        dcol = dcol.reshape((geom.channels_in,) + tuple(geom.kernel) + (n,) + tuple(geom.out_shape))
        col2im(_col_buffer_view(dcol, nd), geom.in_shape, geom.kernel, geom.pad, geom.stride, geom.dilation,
               out=dx)


register_strategy("type1", Type1Lowering)
