"""Several split executors on one train net: spatial splits, convolution channel splits and the
fully-connected tail's split together (DeePa's configurations, one per layer, in one plan).

Each executor (:mod:`.spatial`, :mod:`.convsplit`, :mod:`.owt`) runs its own layers and hands every
other layer's blobs over by sample (each rank its ``b`` samples, as data parallelism): a spatial band
is gathered back to the samples before a layer outside it reads it, a channel split's output is
returned to the samples by its all-to-all, the tail all-gathers its input by sample. So they compose
layer by layer: :class:`CombinedExecutor` gives each layer to the executor that claims it, the others
run as they are, the owned parameters are the union, and the gathers before snapshots and tests run in
turn. A layer claimed by two executors is refused.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import numpy as np

from ..blob import Blob
from ..layers.base import Layer
from .convsplit import ConvChannelSplitExecutor
from .owt import ChannelSplitExecutor, attach, splittable
from .spatial import SpatialSplitExecutor
from .split import PlanError, Split

log = logging.getLogger("cct")


def claimed_layers(ex) -> set[int]:
    """The layer indices a split executor runs itself."""
    if isinstance(ex, SpatialSplitExecutor):
        return set(ex.steps)
    if isinstance(ex, ConvChannelSplitExecutor):
        return set(ex.splits)
    if isinstance(ex, ChannelSplitExecutor):
        return set(ex.chain)
    raise PlanError(f"not a split executor: {type(ex).__name__}")


class CombinedExecutor:
    """The net's executor made of several split executors, each running the layers it claims."""

    def __init__(self, net, parts: Sequence):
        self.net, self.parts = net, list(parts)
        self.owner: dict[int, object] = {}
        for ex in self.parts:
            for i in claimed_layers(ex):
                if i in self.owner:
                    raise PlanError(f"layer '{net.layer_names[i]}' is split by two executors "
                                    f"({type(self.owner[i]).__name__}, {type(ex).__name__})")
                self.owner[i] = ex

    @property
    def bytes_moved(self) -> int:
        """Bytes this rank received in the parts' exchanges of forward and backward passes."""
        return sum(ex.bytes_moved for ex in self.parts)

    @property
    def gather_bytes(self) -> int:
        """Bytes this rank received gathering the parts' slices (snapshots, tests)."""
        return sum(ex.gather_bytes for ex in self.parts)

    def owned_param_ids(self) -> list[int]:
        """The parts' owned learnable parameters (their gradients stay local)."""
        return sorted({k for ex in self.parts for k in ex.owned_param_ids()})

    def forward(self, i: int, layer: Layer, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        """Run layer ``i`` with the executor that claims it (unclaimed layers as they are)."""
        ex = self.owner.get(i)
        if ex is None:
            layer.forward(bottom, top)
        else:
            ex.forward(i, layer, bottom, top)

    def backward(self, i: int, layer: Layer, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        """Back-propagate layer ``i`` with the executor that claims it."""
        ex = self.owner.get(i)
        if ex is None:
            layer.backward(top, propagate_down, bottom)
        else:
            ex.backward(i, layer, top, propagate_down, bottom)

    def finish_backward(self) -> None:
        """Every part's (their exchanges are synchronous: nothing is left)."""
        for ex in self.parts:
            ex.finish_backward()

    def release(self) -> None:
        """Free every part's sub-communicators."""
        for ex in self.parts:
            ex.release()

    def gather_owned(self, history: Sequence[np.ndarray] = ()) -> None:
        """Every part's gather of its owned slices (a collective, in the same order on every rank)."""
        for ex in self.parts:
            ex.gather_owned(history)


def build_splits(net, comm, groups: int, convs: Sequence[str], spatial: Mapping[str, Split]):
    """The executor of a plan: ``spatial`` layers by height and width, ``convs`` by output channel, the
    tail with ``groups`` sample groups (``groups == comm.size``: by sample); one part alone is returned
    as it is, several as a :class:`CombinedExecutor`, none as None."""
    parts = []
    if spatial:
        parts.append(SpatialSplitExecutor(net, comm, spatial))
    if convs:
        parts.append(ConvChannelSplitExecutor(net, comm, convs))
    if groups != comm.size:
        parts.append(ChannelSplitExecutor(net, comm, groups))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else CombinedExecutor(net, parts)


def enable_splits(solver, groups: int, convs: Sequence[str], spatial: Mapping[str, Split]):
    """Run ``solver``'s train net with :func:`build_splits`' executor on its data-parallel ranks (nothing
    when every layer runs by sample); returns the executor."""
    par = splittable(solver, "per-layer split")
    ex = build_splits(solver.net, par.comm, groups, convs, spatial)
    if ex is None:
        return None
    attach(solver, ex)
    if par.is_root:
        log.info("Per-layer splits on %d MPI ranks: %s; every other layer by sample", par.size, describe(ex))
    return ex


def describe(ex) -> str:
    """What a split executor (or a :class:`CombinedExecutor`) splits, for the log."""
    parts = ex.parts if isinstance(ex, CombinedExecutor) else [ex]
    what: list[str] = []
    for part in parts:
        net = part.net
        if isinstance(part, SpatialSplitExecutor):
            what += [f"{name} h={s.h} w={s.w}" for name, s in part.splits.items()]
        elif isinstance(part, ConvChannelSplitExecutor):
            what += [f"{net.layer_names[i]} c={part.size}" for i in part.splits]
        else:
            what.append(f"the fully-connected tail n={part.sample_groups} c={part.size}")
    return ", ".join(what)
