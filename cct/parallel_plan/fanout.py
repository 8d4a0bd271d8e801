"""A blob read by several layers under a per-layer split: Caffe's Split layer (inserted where a blob feeds
several layers) run on a box, each of its tops the same box of the input for one reader, backward the sum
of what the readers return (as Caffe's Split)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..blob import Blob
from .boxexchange import BoxExchange
from .split import Split


@dataclass
class FanOutStep:
    """A Split layer on this rank's box: its input fetched from the producer's split (or the samples), copied
    to one box blob per top; a top read by a layer that runs by sample is returned to the samples."""

    index: int
    split: Split
    inp: Blob                     # this rank's box of the input
    outs: list[Blob]              # one box per top
    fetch: BoxExchange            # the producer's boxes (or the samples) -> the box
    source: object | None         # the producer's Placed (None: the net's blob by sample)
    idle: bool = False
    #: top index -> the exchange returning that top to the sample split (a layer outside reads it)
    gathers: dict[int, BoxExchange] = field(default_factory=dict)

    def forward(self, src: np.ndarray, tops: list[np.ndarray], view) -> int:
        """Fill every top's box from ``src`` (``view`` makes an array 4-D); the tops read by sample get
        theirs in ``tops``. Returns the bytes received."""
        moved = self.fetch.forward(view(src), view(self.inp.data))
        for k, out in enumerate(self.outs):
            if not self.idle:
                out.data[...] = self.inp.data
            if k in self.gathers:
                moved += self.gathers[k].forward(view(out.data), view(tops[k]))
        return moved

    def backward(self, top_diffs: list[np.ndarray], dst: np.ndarray, view) -> int:
        """The input's gradient: the sum of every top's (each returned from the samples where read there),
        sent back to its owners in ``dst``. Returns the bytes received."""
        moved = 0
        for k, g in self.gathers.items():
            moved += g.backward(view(top_diffs[k]), view(self.outs[k].diff))
        if not self.idle:
            self.inp.diff[...] = 0
            for out in self.outs:
                self.inp.diff[...] += out.diff
        return moved + self.fetch.backward(view(self.inp.diff), view(dst))
