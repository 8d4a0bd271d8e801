"""Output-channel splits of convolution layers on MPI ranks (a first step beyond OWT: DeePa's ``c`` split
below the fully-connected tail).

:func:`enable_conv_split` attaches a :class:`ConvChannelSplitExecutor` to a data-parallel solver: every
layer runs on the rank's own ``b`` samples as under data parallelism, except the named Convolution
layers, each of which owns a slice of its filters (rank r the output channels ``[r*C/N, (r+1)*C/N)``):

* forward: the layer's input is all-gathered by sample (every rank gets the ``N*b`` samples); the rank
  convolves them with its filters (a copy of the layer resized to its slice, fed the slice of the
  weights and bias); an all-to-all gives each rank its ``b`` samples with every channel (the next layer
  gathers the channels);
* backward mirrors it: an all-to-all of the top gradient to the channel split, the slice's weight and
  bias gradients computed where the slice lives (scaled by 1/N, Caffe's multi-solver rule; never
  all-reduced), the input gradient summed over the ranks' channel slices by a reduce-scatter by sample;
* before a snapshot or a test the owned filter rows (weights and solver history) are all-gathered, so
  rank 0 writes the single-process files and tests the whole net.

N ranks at batch b then train as one process at batch N*b. Limits (refused with a :class:`PlanError`):
grouped convolutions, layers with more than one bottom or top, in-place use, fewer filters than ranks,
combining with OWT's tail split or ``--devices`` (one executor per net), unequal batch shares.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from ..blob import Blob
from ..layers.base import Layer
from .owt import ChannelSlice, attach, exchange, gather_rows, sliced_layer, splittable
from .split import PlanError, part_bounds

log = logging.getLogger("cct")


class ConvChannelSplitExecutor:
    """The net's executor with some Convolution layers split by output channel (see module docstring)."""

    def __init__(self, net, comm, layer_names: Sequence[str]):
        self.net, self.comm = net, comm
        self.size, self.rank = comm.size, comm.rank
        self.splits: dict[int, ChannelSlice] = {}
        for name in layer_names:
            if name not in net.layer_names:
                raise PlanError(f"channel split: no layer '{name}' in net '{net.name}'")
            i = net.layer_names.index(name)
            self.splits[i] = self._split(i, net.layers[i])
        #: bytes this rank received in the split layers' exchanges of forward and backward passes
        self.bytes_moved = 0
        #: bytes this rank received gathering the slices (snapshots, tests)
        self.gather_bytes = 0

    def _split(self, i: int, layer: Layer) -> ChannelSlice:
        net = self.net
        name = net.layer_names[i]
        if layer.type != "Convolution":
            raise PlanError(f"channel split: layer '{name}' is a {layer.type}, not a Convolution")
        bottoms, tops = net.bottom_names[i], net.top_names[i]
        if len(bottoms) != 1 or len(tops) != 1 or bottoms[0] == tops[0]:
            raise PlanError(f"channel split: layer '{name}' must have one bottom and one (other) top")
        p = layer.param.convolution_param
        if (p.group or 1) != 1:
            raise PlanError(f"channel split: layer '{name}' is a grouped convolution (group: {p.group})")
        c_out = int(p.num_output)
        if c_out < self.size:
            raise PlanError(f"channel split: layer '{name}' has {c_out} filters, fewer than the {self.size} ranks")
        bounds = part_bounds(c_out, self.size)
        mine = int(bounds[self.rank, 1] - bounds[self.rank, 0])
        x = net.blobs[bottoms[0]]
        inp = Blob((x.shape[0] * self.size,) + tuple(x.shape[1:]), net.dtype, name=f"{name}_csplit_in")
        out = Blob((1,), net.dtype, name=f"{name}_csplit_out")
        part = sliced_layer(layer, "convolution_param", mine, inp, out)
        return ChannelSlice(i, layer, part, bounds, inp, out, self.rank)

    def owned_param_ids(self) -> list[int]:
        """Learnable-parameter indices of the split layers (their gradients stay local)."""
        net = self.net
        return [net.learnable_param_ids[nid] for nid, (lid, _pid) in enumerate(net.param_layer_indices)
                if lid in self.splits]

    # -- the executor interface --------------------------------------------------------------------
    def forward(self, i: int, layer: Layer, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        """Run layer ``i`` (split layers by channel, the others as they are)."""
        if i not in self.splits:
            layer.forward(bottom, top)
            return
        sp, b = self.splits[i], int(bottom[0].shape[0])
        x = np.ascontiguousarray(bottom[0].data)
        got = np.empty((self.size,) + x.shape, x.dtype)
        self.comm.allgather(x, got)
        self.bytes_moved += got.nbytes - x.nbytes
        sp.inp.data[...] = got.reshape(sp.inp.shape)
        sp.part.blobs[0].data[...] = sp.layer.blobs[0].data[sp.lo:sp.hi]
        if len(sp.layer.blobs) > 1:
            sp.part.blobs[1].data[...] = sp.layer.blobs[1].data[sp.lo:sp.hi]
        sp.part.reshape([sp.inp], [sp.out])
        sp.part.forward([sp.inp], [sp.out])
        # block q: rank q's samples of my channels; back: my samples of rank r's channels
        blocks = [sp.out.data[q * b:(q + 1) * b] for q in range(self.size)]
        got, received = exchange(self.comm, blocks, sp.widest, "alltoall")
        self.bytes_moved += received
        for r, (lo, hi) in enumerate(sp.bounds):
            top[0].data[:, lo:hi] = got[r, :, :hi - lo]

    def backward(self, i: int, layer: Layer, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        """Back-propagate layer ``i`` (see module docstring)."""
        if i not in self.splits:
            layer.backward(top, propagate_down, bottom)
            return
        sp, b = self.splits[i], int(bottom[0].shape[0])
        dtop = top[0].diff
        # block q: my samples of rank q's channels; back: rank r's samples of my channels
        got, received = exchange(self.comm, [dtop[:, lo:hi] for lo, hi in sp.bounds], sp.widest, "alltoall")
        self.bytes_moved += received
        sp.out.diff[...] = got[:, :, :sp.hi - sp.lo].reshape(sp.out.shape)
        for blob in sp.part.blobs:
            blob.diff[...] = 0
        sp.part.backward([sp.out], [bool(propagate_down[0])], [sp.inp])
        scale = self.net.dtype.type(1.0 / self.size)
        for full, part in zip(sp.layer.blobs, sp.part.blobs):
            full.diff[sp.lo:sp.hi] += part.diff * scale
        if propagate_down[0]:
            blocks = [sp.inp.diff[q * b:(q + 1) * b] for q in range(self.size)]  # rank q's samples, summed
            got, received = exchange(self.comm, blocks, int(bottom[0].shape[1]), "reduce_scatter")
            self.bytes_moved += received
            bottom[0].diff[...] = got

    def finish_backward(self) -> None:
        """Nothing is left to finish (the exchanges are synchronous)."""

    def release(self) -> None:
        """Nothing to free (the exchanges run on the ranks' own communicator)."""

    def gather_owned(self, history: Sequence[np.ndarray] = ()) -> None:
        """All-gather the owned filter rows of the weights and of the solver ``history`` (a collective)."""
        self.gather_bytes += gather_rows(self.comm, self.net, self.splits, history)


def enable_conv_split(solver, layer_names: Sequence[str]) -> ConvChannelSplitExecutor:
    """Split the Convolution layers ``layer_names`` of ``solver``'s train net by output channel over its
    data-parallel ranks (see module docstring)."""
    par = splittable(solver, "channel split")
    ex = attach(solver, ConvChannelSplitExecutor(solver.net, par.comm, layer_names))
    if par.is_root:
        log.info("Channel split on %d MPI ranks: %s by output channel, every other layer by sample", par.size,
                 ", ".join(f"{solver.net.layer_names[i]} ({sp.hi - sp.lo} of {sp.layer.blobs[0].shape[0]} filters "
                           f"per rank)" for i, sp in ex.splits.items()))
    return ex
