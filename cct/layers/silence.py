"""Silence: consumes its bottoms (so they are not net outputs); zero gradient."""
from __future__ import annotations

from collections.abc import Sequence

from ..blob import Blob
from .base import register
from .structure_base import StructureLayer


@register("Silence")
class SilenceLayer(StructureLayer):
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
