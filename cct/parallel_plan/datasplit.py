"""A data layer split other than by sample (DeePa's configuration of the input): every rank reads the whole
global batch -- the records one process reads at batch ``N*b``, in its order and with its transforms -- and
keeps its box of each top (a band of rows of every image, a slice of channels, ...; the labels, which have
fewer axes, split along the axes they have: :func:`~.split.worker_boxes` of the label's shape, as the
planner's transfer counts them). A spatially split first convolution then receives only its halo.

Only layers reading a record stream that every rank can read in the same order are split (those with
``set_shard`` whose loader is sharded: Data, ImageData, HDF5Data); :meth:`DataStep.read_global` makes each
rank read every record of the global batch from rank 0's read state (a collective).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..blob import Blob
from ..layers.base import Layer
from .boxexchange import BoxExchange
from .split import Split

#: data layers that give each rank a batch of its own (or draw records at random): by sample only
UNSPLIT_SOURCES = ("Input", "DummyData", "MemoryData", "WindowData")


def data_refusal(layer: Layer) -> str | None:
    """Why a data ``layer`` cannot be split other than by sample (None: it can)."""
    if layer.type in UNSPLIT_SOURCES or not hasattr(layer, "set_shard"):
        return f"{layer.type} layers give each rank a batch of its own; only Data, ImageData and HDF5Data " \
               "layers are split other than by sample"
    return None


@dataclass
class DataStep:
    """A data layer whose tops are held on boxes: it reads the global batch into ``full`` and keeps this rank's
    box of each top in ``outs`` (see module docstring)."""

    index: int
    split: Split
    layer: Layer
    full: list[Blob]              # the global batch (every rank reads it)
    outs: list[Blob]              # this rank's box of each top
    crops: list[tuple[slice, ...]]  # each box in the global (N, C, H, W) top
    global_batch: int
    idle: bool = False
    #: top index -> the exchange returning that top to the sample split (a layer outside reads it)
    gathers: dict[int, BoxExchange] = field(default_factory=dict)

    def read_global(self, comm) -> None:
        """Make this rank's layer read every record of the global batch from rank 0's read state, as one
        process at the global batch reads them (a collective)."""
        state = comm.bcast_obj(self.layer.get_read_state() if comm.rank == 0 else None)
        g = self.global_batch
        self.layer.set_shard(0, g, state=state, block=(0, g))

    def forward(self, tops: Sequence[Blob], view: Callable[[np.ndarray], np.ndarray]) -> int:
        """Read the global batch, keep the boxes; the tops read by sample get theirs in ``tops``. Returns the
        bytes received."""
        self.layer.forward([], self.full)
        moved = 0
        for k, (full, out) in enumerate(zip(self.full, self.outs)):
            if out.count and not self.idle:
                out.data[...] = view(full.data)[self.crops[k]].reshape(out.shape)
            if k in self.gathers:
                moved += self.gathers[k].forward(view(out.data), view(tops[k].data))
        return moved
