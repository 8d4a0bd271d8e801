"""What a GEMM lowering does, in operations the cost model prices (CcT paper Figure 6).

A lowering is described by which spatial axes it replicates (:class:`LoweringShape`: type 1
lowers all of them with Caffe's im2col, type 2 the last, type 3 none) and, from that, for a batch
chunk: the matrix shapes (:meth:`LoweringShape.figure6`), the primitive operations of each pass
(:meth:`LoweringShape.ops`) and the workspace (:meth:`LoweringShape.workspace_bytes`).

The operation vocabulary every strategy declares (see :func:`cct.lowering.cost_model.price`):

* ``("gemm", m, n, k, count)`` -- ``count`` real GEMMs of ``(m, k) @ (k, n)``;
* ``("cgemm", m, n, k, count)`` -- complex GEMMs (four real ones each);
* ``("copy" | "add" | "sum" | "zero", elements)`` -- element-wise sweeps (``sum``: a reduction;
  ``("copy", elements, run)``: a copy whose contiguous runs are ``run`` elements long);
* ``("lower" | "unlower", elements)`` -- the strategy's own replication and its adjoint, per
  lowered element (priced from its calibrated curve when the machine has one);
* ``("direct", multiply_adds)`` -- a direct convolution kernel's work (``"direct_wgrad"``: the
  weight-gradient kernel's, which has a rate of its own);
* ``("fft", flops[, points])`` -- FFT work (``2.5 n log2 n`` per complex line of ``n`` points; ``points``:
  the transform's largest axis, whose size moves its rate); ``("ifft", flops)`` the same for inverse
  transforms.

:class:`GemmLoweringOps` is the mixin the GEMM lowerings use to declare theirs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .geometry import ConvGeometry

PASSES = ("fwd", "bwd_data", "bwd_weights")


@dataclass(frozen=True)
class LoweringShape:
    """Sizes of one lowering of ``batch`` images (per group unless said otherwise)."""

    g: int
    cg: int
    mg: int
    C: int
    M: int
    k_low: int  # kernel taps replicated by the lowering
    k_lift: int  # kernel taps summed by the lifting
    cols: int  # columns of the lowered data (batch * positions)
    E: int  # padded positions of the batch
    P: int  # output positions of the batch
    I: int  # noqa: E741 - input positions of the batch
    lifted: bool  # some axis is lifted (type 2/3)
    im2col: bool  # Caffe's im2col (type 1: every axis lowered, even with k = 1)
    batch: int
    direct_1x1: bool = False  # type 1 on a 1x1 convolution: no im2col, per-image GEMMs on the input
    in_run: int = 0  # contiguous run of the input's copy into the padded layout
    lift_run: int = 0  # contiguous run of a shifted output slice in the GEMM result's layout
    out_run: int = 0  # contiguous run of an output plane

    @classmethod
    def of(cls, geom: ConvGeometry, batch: int, lowered_axes: tuple[int, ...], im2col: bool = False) -> LoweringShape:
        """The sizes for ``geom`` when ``lowered_axes`` are replicated (``im2col``: type 1's padded copy)."""
        nd = geom.num_spatial
        low = set(lowered_axes)
        ext = geom.used_extent
        if im2col:  # im2col pads to max(in + 2p, ext)
            ext = tuple(max(i + 2 * p, e) for i, p, e in zip(geom.in_shape, geom.pad, ext))
        return cls(g=geom.group, cg=geom.channels_in // geom.group, mg=geom.channels_out // geom.group,
                   C=geom.channels_in, M=geom.channels_out,
                   k_low=math.prod(geom.kernel[i] for i in range(nd) if i in low),
                   k_lift=math.prod(geom.kernel[i] for i in range(nd) if i not in low),
                   cols=batch * math.prod(geom.out_shape[i] if i in low else ext[i] for i in range(nd)),
                   E=batch * math.prod(ext), P=batch * geom.out_size, I=batch * geom.in_size,
                   lifted=len(low) < nd, im2col=im2col, batch=batch, direct_1x1=im2col and geom.is_1x1,
                   in_run=contiguous_run(ext, geom.in_shape),
                   lift_run=contiguous_run(tuple(geom.out_shape[i] if i in low else ext[i] for i in range(nd)),
                                           geom.out_shape),
                   out_run=geom.out_size)

    @property
    def lowered(self) -> bool:
        """Whether a lowered (replicated) matrix is written at all."""
        return self.k_low > 1 or self.im2col

    def figure6(self) -> dict:
        """The paper's Figure 6 row: ``lowered_data``, ``lowered_kernel``, ``gemm_output`` (rows, cols),
        ``gemm_flops``, ``lifting_flops``, ``lifting_ram_read`` and ``lowering_elems`` (elements)."""
        g, cg, mg, kl, kf, cols = self.g, self.cg, self.mg, self.k_low, self.k_lift, self.cols
        return {
            "lowered_data": (cg * kl, cols),
            "lowered_kernel": (mg * kf, cg * kl),
            "gemm_output": (mg * kf, cols),
            "gemm_flops": 2 * g * mg * kf * cg * kl * cols,
            "lifting_flops": kf * self.M * self.P if self.lifted else 0,  # k (resp. k^2) adds per output
            "lifting_ram_read": g * mg * kf * cols if self.lifted else self.M * self.P,
            "lowering_elems": self.C * kl * cols if self.lowered else 0,
        }

    def ops(self, pass_: str) -> list[tuple]:
        """Primitive operations of one pass (mirrors ``type1.py`` and ``type2.py``)."""
        g, cg, mg, C, M = self.g, self.cg, self.mg, self.C, self.M
        kl, kf, cols, E, P, inp = self.k_low, self.k_lift, self.cols, self.E, self.P, self.I
        ops: list[tuple] = []

        def lower():
            if self.lowered:  # padding copy + k_low strided copies (or a compiled im2col), per lowered element
                ops.append(("lower", C * kl * cols))
            else:  # type 3: the padded, channel-major copy of the input is the lowered matrix
                ops.append(("copy", C * inp, self.in_run))
                if E != inp:
                    ops.append(("zero", C * E))

        if self.direct_1x1:  # the input is the lowered matrix (type1.py): one broadcast matmul, no lift
            per_image = P // max(self.batch, 1)  # the broadcast matmul runs one GEMM per image and group
            if pass_ == "fwd":  # contiguous bias add: one stream like a copy
                return [("gemm", mg, per_image, cg, g * self.batch), ("copy", M * P, self.out_run)]
            if pass_ == "bwd_data":
                return [("gemm", cg, per_image, mg, g * self.batch)]
            if pass_ == "bwd_weights":
                regroup = [("copy", C * inp, self.in_run), ("copy", M * P, self.out_run)] if self.batch > 1 else []
                return regroup + [("gemm", mg, cg, cols, g), ("sum", M * P)]
            raise ValueError(f"unknown pass {pass_!r}: expected one of {PASSES}")

        def scatter():  # adjoint of the lifting: dy into the (zeroed) GEMM-result layout
            if self.lifted:
                ops.append(("zero", g * mg * kf * cols))
                ops.append(("copy", kf * M * P, self.lift_run))
            elif self.batch > 1:
                ops.append(("copy", M * P, self.out_run))  # type 1: dy to group-major (one image's dy already is)

        if pass_ == "fwd":
            lower()
            ops.append(("gemm", mg * kf, cols, cg * kl, g))
            if self.lifted:
                ops.append(("copy", M * P, self.lift_run))  # first shifted slice (+ bias, fused)
                ops.append(("add", (kf - 1) * M * P))
            else:  # type 1: the transposing lift, (M, N, P) -> (N, M, P), with the bias added on the way
                ops.append(("copy", M * P, self.out_run))
        elif pass_ == "bwd_data":
            scatter()
            ops.append(("gemm", cg * kl, cols, mg * kf, g))
            if self.lowered:
                ops.append(("unlower", C * kl * cols))  # col2im-style accumulation (+ its zeroed buffer)
            if not self.im2col:
                ops.append(("copy", C * inp, self.in_run))  # crop + transpose back to (N, C, ...)
        elif pass_ == "bwd_weights":
            lower()
            scatter()
            ops.append(("gemm", mg * kf, cg * kl, cols, g))
            ops.append(("sum", M * P))  # bias reduction
        else:
            raise ValueError(f"unknown pass {pass_!r}: expected one of {PASSES}")
        return ops

    def workspace_bytes(self, itemsize: int = 4) -> int:
        """Peak temporary memory of one pass: padded input, lowered data (all groups), one group's GEMM
        output twice, the scattered gradient; linear in the batch."""
        lowered = self.C * self.k_low * self.cols if self.lowered else 0
        result = self.mg * self.k_lift * self.cols
        return int(itemsize * (self.C * self.E + lowered + 2 * result + self.M * self.P))


def contiguous_run(full: tuple[int, ...], part: tuple[int, ...]) -> int:
    """Elements of the longest contiguous run of a ``part``-shaped slice of a C-ordered ``full``-shaped
    array (the trailing axes it covers whole, times the first it cuts)."""
    run = 1
    for f, p in zip(reversed(tuple(full)), reversed(tuple(part))):
        run *= int(p)
        if p != f:
            break
    return run


class GemmLoweringOps:
    """Mixin of the GEMM lowerings: ``lowered_axes`` (and ``im2col``) determine the declared
    operations and workspace through :class:`LoweringShape`."""

    im2col: bool = False

    def lowered_axes(self, geom: ConvGeometry) -> tuple[int, ...]:
        """Spatial axes (0-based) replicated in the lowering; the rest are lifted."""
        raise NotImplementedError

    def shape(self, geom: ConvGeometry, batch: int) -> LoweringShape:
        """The sizes of this lowering for ``batch`` images."""
        return LoweringShape.of(geom, batch, tuple(self.lowered_axes(geom)), self.im2col)

    def pass_ops(self, geom: ConvGeometry, batch: int, pass_: str) -> list[tuple]:
        """Primitive operations of ``pass_`` on ``batch`` images (see module docstring)."""
        return self.shape(geom, batch).ops(pass_)

    def workspace_bytes(self, geom: ConvGeometry, batch: int, itemsize: int = 4) -> int:
        """Peak temporary bytes of one pass on ``batch`` images."""
        return self.shape(geom, batch).workspace_bytes(itemsize)
