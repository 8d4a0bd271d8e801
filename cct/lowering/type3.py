"""CcT lowering Type 3 ("expensive lifting"): no replication in the lowering.

The lowered data is the zero-padded input itself, channel-major ``(C/g, N * H' * W')``; the
kernel matrix is ``(M/g * kh * kw, C/g)``; one GEMM per group gives ``(M/g * kh * kw, N * H' *
W')`` and the lifting sums the ``kh * kw`` shifted (strided, dilated) slices into the output.
This is the paper's Figure 6 column 3 (``(d, n^2)``, ``(ok^2, d)``, lifting ``m^2 k^2 o``); it
wins when the input channels outnumber the output channels. The implementation is the shared
partial-lowering scheme of :mod:`cct.lowering.type2` with no lowered axis.
"""
from __future__ import annotations

from .base import register_strategy
from .geometry import ConvGeometry
from .type2 import PartialLowering


class Type3Lowering(PartialLowering):
    """CcT Type 3: lift along every spatial axis (lowering is only padding + a transpose)."""

    name = "type3"

    def lowered_axes(self, geom: ConvGeometry) -> tuple[int, ...]:
        return ()


register_strategy("type3", Type3Lowering)
