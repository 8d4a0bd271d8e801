"""Execution of Krizhevsky's "one weird trick" on MPI ranks: the layers below the fully-connected tail
split by sample (as data parallelism), the tail's InnerProduct layers split by output channel.

:func:`enable_owt` attaches a :class:`ChannelSplitExecutor` to a data-parallel solver (one built under
``mpiexec``). Each rank runs the layers below the tail on its own ``b`` samples; at the tail:

* forward: the tail's input is all-gathered (every rank gets the ``N*b`` samples); rank r computes the
  output channels ``[r*C/N, (r+1)*C/N)`` of each InnerProduct for all samples with the layer itself
  (a copy resized to its slice, fed the slice of the weights), element-wise layers between them run on
  the slice, the next InnerProduct all-gathers the slices (channels); the last one's output goes back
  to a sample split by an all-to-all (rank r gets its b samples, every channel) for the loss;
* backward mirrors it: all-to-all of the top gradient to the channel split, each InnerProduct's input
  gradient summed over ranks by a reduce-scatter (by channel, or by sample below the tail); the weight
  and bias gradients of a slice are computed only where it lives, scaled by 1/N (Caffe's multi-solver
  rule) and never all-reduced (:meth:`~cct.distributed.parallel.DataParallel.keep_local`);
* the update: each rank's solver updates its parameters; only the owned rows of the tail are read
  afterwards. Before a snapshot or a test (collectives), the owned rows of the weights and of the
  solver's history are all-gathered so that rank 0 writes the single-process files and tests the
  whole net.

N ranks at batch b then train as one process at batch N*b (tested on LeNet against Caffe's batch-4
run; on 3 ranks, whose slices are uneven -- 167, 167, 166 of 500 --, against one process). The
exchanges of uneven slices pad each to the largest. Not supported: Dropout masks equal to a single
process's (each rank draws its own), unequal batch shares, fewer outputs than ranks.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..blob import Blob
from ..distributed.threadcomm import ranks_word
from ..layers.base import Layer, create_layer
from ..proto import caffe_pb2
from .graph import ELEMENTWISE
from .split import PlanError, part_bounds

log = logging.getLogger("cct")


@dataclass
class ChannelSlice:
    """One layer split by output channel: the net's layer (full weights), this rank's resized copy, every
    rank's ``[lo, hi)`` of the channels, and the copy's input and output blobs."""

    index: int              # layer index in the net
    layer: Layer            # the net's layer (holds the full weights)
    part: Layer             # a copy resized to this rank's slice
    bounds: np.ndarray      # (N, 2): every rank's [lo, hi) of the output channels
    inp: Blob               # (N*b, K): the whole input
    out: Blob               # (N*b, hi - lo): this rank's slice of the output

    @property
    def lo(self) -> int:
        return int(self.bounds[self.part_rank, 0])

    @property
    def hi(self) -> int:
        return int(self.bounds[self.part_rank, 1])

    @property
    def widest(self) -> int:
        return int(np.max(self.bounds[:, 1] - self.bounds[:, 0]))

    part_rank: int = 0


def tail_layers(net) -> list[int]:
    """Indices of the fully-connected tail: from the first InnerProduct of the last chain of InnerProduct
    and element-wise layers (each feeding only the next) to its last InnerProduct."""
    ips = [i for i, layer in enumerate(net.layers) if layer.type == "InnerProduct"]
    if not ips:
        raise PlanError("OWT: the net has no InnerProduct layer to split by channel")
    last = ips[-1]
    start = last
    while start > 0:
        prev = start - 1
        layer = net.layers[prev]
        if layer.type not in ("InnerProduct",) and layer.type not in ELEMENTWISE:
            break
        if len(net.bottom_names[prev]) != 1 or len(net.top_names[prev]) != 1:
            break
        if net.top_names[prev][0] != net.bottom_names[start][0]:
            break
        start = prev
    while net.layers[start].type != "InnerProduct":
        start += 1
    chain = list(range(start, last + 1))
    for a, b in zip(chain, chain[1:]):
        top = net.top_names[a][0]
        users = [i for i, names in enumerate(net.bottom_names) if top in names and i not in chain]
        if users and net.top_names[b][0] != top:
            raise PlanError(f"OWT: blob '{top}' of the fully-connected tail also feeds layer "
                            f"'{net.layer_names[users[0]]}'")
    return chain


class ChannelSplitExecutor:
    """The net's executor under OWT (see module docstring): layers outside the tail run as they are."""

    #: data parallelism's buckets start after the whole backward (as with every executor but the per-layer one)
    diffs_final_per_layer = False

    def __init__(self, net, comm, sample_groups: int = 1):
        if sample_groups < 1 or comm.size % sample_groups:
            raise PlanError(f"the fully-connected tail's {sample_groups} sample group(s) must divide the "
                            f"{comm.size} ranks")
        self.net, self.world, self.sample_groups = net, comm, sample_groups
        width = comm.size // sample_groups  # ranks splitting the channels within one group of samples
        #: the exchanges run within a sample group (ranks g*width .. g*width + width-1)
        self.comm = comm.split(comm.rank // width, comm.rank % width) if sample_groups > 1 else comm
        #: the ranks holding the same channel slice (one per sample group): their slice gradients are summed
        self.slice_comm = comm.split(comm.rank % width, comm.rank // width) if sample_groups > 1 else None
        self.size, self.rank = self.comm.size, self.comm.rank
        self.chain = tail_layers(net)
        first = self.chain[0]
        bottom = net.blobs[net.bottom_names[first][0]]
        self.batch = int(bottom.shape[0])
        total = self.batch * self.size
        self.in_features = int(np.prod(bottom.shape[1:]))
        self.fcs: dict[int, ChannelSlice] = {}
        self.slices: dict[int, Blob] = {}  # element-wise layer index -> the slice blob it runs on
        cur: Blob | None = None
        for i in self.chain:
            layer = net.layers[i]
            if layer.type == "InnerProduct":
                p = layer.param.inner_product_param
                if p.transpose or p.axis not in (1, -len(net.blobs[net.bottom_names[i][0]].shape) + 1):
                    raise PlanError(f"OWT: layer '{layer.name}': only axis 1 without transpose is split by channel")
                c_out = int(p.num_output)
                if c_out < self.size:
                    raise PlanError(f"OWT: layer '{layer.name}' has {c_out} outputs, fewer than the {self.size} "
                                    f"ranks")
                bounds = part_bounds(c_out, self.size)
                mine = int(bounds[self.rank, 1] - bounds[self.rank, 0])
                k = int(layer.blobs[0].shape[1])
                inp = Blob((total, k), net.dtype, name=f"{layer.name}_owt_in")
                out = Blob((total, mine), net.dtype, name=f"{layer.name}_owt_out")
                part = sliced_layer(layer, "inner_product_param", mine, inp, out)
                self.fcs[i] = ChannelSlice(i, layer, part, bounds, inp, out, self.rank)
                cur = out
            else:
                if net.top_names[i][0] != net.bottom_names[i][0]:
                    nxt = Blob(cur.shape, net.dtype, name=f"{layer.name}_owt")
                    self.slices[i] = nxt
                    cur = nxt
                else:
                    self.slices[i] = cur
        #: bytes this rank received in the tail's exchanges of forward and backward passes
        self.bytes_moved = 0
        #: bytes this rank received gathering the slices (snapshots)
        self.gather_bytes = 0

    # -- which learnable parameters are split -------------------------------------------------------
    def owned_param_ids(self) -> list[int]:
        """Learnable-parameter indices of the tail's InnerProduct layers (their gradients stay local)."""
        net = self.net
        ids = []
        for nid, (lid, _pid) in enumerate(net.param_layer_indices):
            if lid in self.fcs:
                ids.append(net.learnable_param_ids[nid])
        return ids

    # -- the executor interface --------------------------------------------------------------------
    def forward(self, i: int, layer: Layer, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        """Run layer ``i``; the tail runs as a whole at its last layer."""
        if i not in self.chain:
            layer.forward(bottom, top)
        elif i == self.chain[-1]:
            self._forward_tail(top[0])

    def backward(self, i: int, layer: Layer, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        """Back-propagate layer ``i``; the tail runs as a whole at its last layer."""
        if i not in self.chain:
            layer.backward(top, propagate_down, bottom)
        elif i == self.chain[-1]:
            self._backward_tail()

    def finish_backward(self) -> None:
        """Nothing is left to finish (the tail's communication is synchronous)."""

    # -- the tail ------------------------------------------------------------------------------------
    def _exchange(self, blocks: list[np.ndarray], widest: int, how: str) -> np.ndarray:
        """:func:`exchange` within this executor's sample group, counting the bytes received."""
        got, received = exchange(self.comm, blocks, widest, how)
        self.bytes_moved += received
        return got

    def _gather_channels(self, part: np.ndarray, fc: ChannelSlice, out: np.ndarray) -> None:
        """``out (B, C)`` = every rank's channel slice ``part (B, hi - lo)`` of ``fc``'s output side by side."""
        got = self._exchange([part], fc.widest, "allgather")
        for r, (lo, hi) in enumerate(fc.bounds):
            out[:, lo:hi] = got[r, :, :hi - lo]

    def _forward_tail(self, top: Blob) -> None:
        net, b, n = self.net, self.batch, self.size
        first = self.chain[0]
        x = net.blobs[net.bottom_names[first][0]].data.reshape(b, self.in_features)
        cur: Blob | None = None
        prev: ChannelSlice | None = None
        for i in self.chain:
            if i in self.fcs:
                fc = self.fcs[i]
                if cur is None:
                    got = np.empty((n, b, self.in_features), x.dtype)
                    self.comm.allgather(np.ascontiguousarray(x), got)
                    self.bytes_moved += got.nbytes - x.nbytes
                    fc.inp.data[...] = got.reshape(fc.inp.shape)
                else:
                    self._gather_channels(cur.data, prev, fc.inp.data)
                fc.part.blobs[0].data[...] = fc.layer.blobs[0].data[fc.lo:fc.hi]
                if len(fc.layer.blobs) > 1:
                    fc.part.blobs[1].data[...] = fc.layer.blobs[1].data[fc.lo:fc.hi]
                fc.part.reshape([fc.inp], [fc.out])
                fc.part.forward([fc.inp], [fc.out])
                cur, prev = fc.out, fc
            else:
                layer, dst = net.layers[i], self.slices[i]
                layer.reshape([cur], [dst])
                layer.forward([cur], [dst])
                cur = dst
        last = self.fcs[self.chain[-1]]
        # block q: rank q's samples of my channels; back: my samples of rank r's channels
        got = self._exchange([cur.data[q * b:(q + 1) * b] for q in range(n)], last.widest, "alltoall")
        out = top.data.reshape(b, -1)
        for r, (lo, hi) in enumerate(last.bounds):
            out[:, lo:hi] = got[r, :, :hi - lo]

    def _backward_tail(self) -> None:
        net, b, n = self.net, self.batch, self.size
        last = self.fcs[self.chain[-1]]
        dtop = net.blobs[net.top_names[self.chain[-1]][0]].diff.reshape(b, -1)
        # block q: my samples of rank q's channels; back: rank r's samples of my channels
        got = self._exchange([dtop[:, lo:hi] for lo, hi in last.bounds], last.widest, "alltoall")
        grad = got[:, :, :last.hi - last.lo].reshape(n * b, last.hi - last.lo)
        scale = net.dtype.type(1.0 / self.world.size)
        for pos in range(len(self.chain) - 1, -1, -1):
            i = self.chain[pos]
            if i not in self.fcs:
                layer, dst = net.layers[i], self.slices[i]
                src = self._input_of(pos)
                dst.diff[...] = grad
                layer.backward([dst], [True], [src])
                grad = src.diff.copy()
                continue
            fc = self.fcs[i]
            fc.out.diff[...] = grad
            for blob in fc.part.blobs:
                blob.diff[...] = 0
            fc.part.backward([fc.out], [True], [fc.inp])
            for full, part in zip(fc.layer.blobs, fc.part.blobs):
                contrib = part.diff * scale
                if self.slice_comm is not None:  # the other sample groups' gradients of this slice
                    self.slice_comm.allreduce(contrib, out=contrib)
                    self.bytes_moved += int(2 * (self.slice_comm.size - 1) / self.slice_comm.size * contrib.nbytes)
                full.diff[fc.lo:fc.hi] += contrib
            if pos == 0:
                bottom = net.blobs[net.bottom_names[i][0]]
                if net.bottom_need_backward[i][0]:
                    blocks = [fc.inp.diff[q * b:(q + 1) * b] for q in range(n)]  # rank q's samples, summed
                    bottom.diff.reshape(b, self.in_features)[...] = self._exchange(blocks, self.in_features,
                                                                                   "reduce_scatter")
            else:
                below = self._fc_below(pos)
                blocks = [fc.inp.diff[:, lo:hi] for lo, hi in below.bounds]  # rank q's channels, summed
                grad = self._exchange(blocks, below.widest, "reduce_scatter")[:, :below.hi - below.lo]

    def _fc_below(self, pos: int) -> ChannelSlice:
        """The InnerProduct layer nearest below tail position ``pos``."""
        return next(self.fcs[i] for i in reversed(self.chain[:pos]) if i in self.fcs)

    def _input_of(self, pos: int) -> Blob:
        """The slice blob feeding the tail layer at ``pos`` (an element-wise layer's bottom)."""
        prev = self.chain[pos - 1]
        return self.fcs[prev].out if prev in self.fcs else self.slices[prev]

    # -- the single-process copy -------------------------------------------------------------------
    def release(self) -> None:
        """Free the sub-communicators of the sample groups (collective; the executor is not used again)."""
        if self.sample_groups > 1:
            self.comm.free()
            self.slice_comm.free()

    def gather_owned(self, history: Sequence[np.ndarray] = ()) -> None:
        """All-gather the owned rows of the tail's weights (and of the solver ``history`` arrays of the
        same parameters) so that every rank holds the single-process values (a collective)."""
        self.gather_bytes += gather_rows(self.comm, self.net, self.fcs, history)


def layer_copy(layer: Layer, edit: Callable[[caffe_pb2.LayerParameter], None], inp: Blob | list[Blob],
               out: Blob) -> Layer:
    """A copy of ``layer`` whose parameter ``edit`` changed (in place), set up on ``inp`` (a blob or the
    list of its bottoms) -> ``out``."""
    param = caffe_pb2.LayerParameter()
    param.CopyFrom(layer.param)
    edit(param)
    part = create_layer(param)
    part.setup(inp if isinstance(inp, list) else [inp], [out])
    part.param_propagate_down = list(layer.param_propagate_down)
    return part


def sliced_layer(layer: Layer, field: str, outputs: int, inp: Blob, out: Blob) -> Layer:
    """A copy of ``layer`` with ``outputs`` outputs (``field``'s ``num_output``), set up on ``inp`` -> ``out``;
    its fillers cleared (it takes its weights from the layer's slice and draws no random numbers)."""
    def edit(param: caffe_pb2.LayerParameter) -> None:
        sub = getattr(param, field)
        sub.num_output = outputs
        for filler in (sub.weight_filler, sub.bias_filler):
            filler.Clear()

    return layer_copy(layer, edit, inp, out)


def exchange(comm, blocks: list[np.ndarray], widest: int, how: str) -> tuple[np.ndarray, int]:
    """``blocks[q]`` (each ``(rows, <= widest, ...)``) padded to ``widest`` along axis 1 and exchanged over
    ``comm``: ``allgather`` (``blocks`` is one block: every rank's comes back), ``alltoall`` (block q goes to
    rank q) or ``reduce_scatter`` (block q summed over ranks lands on rank q). Returns the padded result
    and the bytes this rank received."""
    rows, rest = blocks[0].shape[0], blocks[0].shape[2:]
    send = np.zeros((len(blocks), rows, widest) + rest, blocks[0].dtype)
    for q, blk in enumerate(blocks):
        send[q, :, :blk.shape[1]] = blk
    if how == "allgather":
        got = np.empty((comm.size, rows, widest) + rest, send.dtype)
        comm.allgather(send[0], got)
        return got, got.nbytes - send.nbytes
    if how == "alltoall":
        got = np.empty_like(send)
        comm.alltoall(send, got)
        return got, got.nbytes - got[comm.rank].nbytes
    got = np.empty((rows, widest) + rest, send.dtype)
    comm.reduce_scatter(send, got)
    return got, send.nbytes - send[comm.rank].nbytes


def gather_rows(comm, net, splits: dict[int, ChannelSlice], history: Sequence[np.ndarray] = ()) -> int:
    """All-gather over ``comm`` the owned output-channel rows of the weights of the split layers
    ``splits`` (layer index -> its split) and of the solver ``history`` arrays of the same parameters;
    returns the bytes this rank received (a collective)."""
    per = len(net.learnable_params)
    received = 0
    for nid, (lid, _pid) in enumerate(net.param_layer_indices):
        if lid not in splits:
            continue
        fc, k = splits[lid], net.learnable_param_ids[nid]
        for a in [net.learnable_params[k].data] + [h for j, h in enumerate(history) if j % per == k]:
            flat = a.reshape(a.shape[0], -1)  # rows: output channels (uneven slices padded as columns)
            got, n = exchange(comm, [flat[fc.lo:fc.hi].T], fc.widest, "allgather")
            received += n
            for r, (lo, hi) in enumerate(fc.bounds):
                flat[lo:hi] = got[r, :, :hi - lo].T
    return received


def splittable(solver, what: str):
    """``solver``'s data parallelism if a split executor may be attached to its train net, else a
    :class:`PlanError` starting with ``what``."""
    par = solver.parallel
    if par is None:
        raise PlanError(f"{what} needs a distributed solver (built under mpiexec with more than one rank)")
    if par.shares is not None:
        raise PlanError(f"{what}: unequal batch shares are not supported")
    if solver.net.executor is not None:
        raise PlanError(f"{what}: the train net already has an executor (OWT, a channel split or --devices); "
                        "not combined yet")
    return par


def attach(solver, ex):
    """Make ``ex`` (a split executor) run ``solver``'s train net: its slices' gradients left out of the
    all-reduce, its slices gathered before every snapshot and test. Returns ``ex``."""
    par = solver.parallel
    solver.net.executor = ex
    par.whole_batch = dict(getattr(ex, "whole_batch", {}))  # its data layers read whole, if any
    par.keep_local(ex.owned_param_ids(), ex.diffs_final_per_layer)
    par.share_slices.append(lambda: ex.gather_owned(solver.history))
    return ex


def enable_owt(solver, sample_groups: int = 1) -> ChannelSplitExecutor:
    """Run ``solver``'s train net under OWT on its data-parallel ranks (see module docstring). With
    ``sample_groups = a > 1`` the tail's configuration is ``n=a, c=N/a``: the ranks form a groups of N/a
    consecutive ranks, each group splits the channels of its own samples, and the a ranks holding the
    same slice all-reduce its gradient."""
    par = splittable(solver, "OWT")
    ex = attach(solver, ChannelSplitExecutor(solver.net, par.comm, sample_groups))
    if par.is_root:
        names = ", ".join(f"{solver.net.layer_names[i]} ({fc.hi - fc.lo} of {fc.layer.blobs[0].shape[0]} outputs "
                          f"per rank)" for i, fc in ex.fcs.items())
        log.info("%s on %d %s: layers below %s by sample, %s by output channel%s",
                 "OWT" if sample_groups == 1 else f"Tail split n={sample_groups} c={par.size // sample_groups}",
                 par.size, ranks_word(par.comm), solver.net.layer_names[ex.chain[0]], names,
                 f" within {sample_groups} groups of samples" if sample_groups > 1 else "")
    return ex
