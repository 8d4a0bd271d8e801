"""Synchronous data parallelism with BVLC Caffe's multi-solver semantics, over a :class:`Comm`.

A :class:`cct.solver.Solver` built with a communicator of N > 1 ranks (``get_solver(path,
comm=world())``, automatic under ``mpiexec``) gets a :class:`DataParallel`:

* start-up: every rank checks that all ranks read the same solver and net definitions (a hash
  compare), the root's weights are broadcast (so fillers without a ``random_seed`` agree), the
  train net's data layers are sharded (rank r keeps records r, r+N, ... of the root's stream, as
  Caffe's ``Skip()``), and ranks > 0 get random streams of their own (dropout, crops, mirrors);
* each iteration: the gradients of the last ``iter_size`` pass are summed over ranks while backward
  runs (:class:`~cct.distributed.gradsync.GradientSync`) and scaled by 1/N before the update, so N
  ranks at batch b update exactly as one process at batch N*b; the loss shown is the mean over
  ranks (the loss of the global batch);
* unequal shares (``shares=[b_0, ..., b_{N-1}]`` summing to N x batch_size, or ``"auto"``: set
  from each rank's measured speed): rank r reads b_r records of every global batch (a contiguous
  block of the record stream), and its gradient and loss are weighted by b_r / (N x batch_size)
  instead of 1/N, so the update is still exactly the single-process one at the global batch;
* the SIGINT/SIGHUP requests of all ranks are combined once per iteration (every rank stops or
  snapshots together); snapshots gather every rank's data read position to the root, which alone
  writes the files; only the root runs the test nets.
"""
from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..device.driver import to_host
from ..device.random import key_from_host
from ..io.prototxt import to_text
from ..solver import signals
from .comm import Comm
from .errors import DistributedError
from .gradsync import GradientSync
from .threadcomm import ThreadComm, ranks_word

log = logging.getLogger("cct")

_ACTIONS = (signals.NONE, signals.SNAPSHOT, signals.STOP)  # combined by taking the strongest


def definition_hash(solver) -> str:
    """A hash of what every rank must agree on: the solver parameters and the train net it built."""
    h = hashlib.sha256()
    h.update(to_text(solver.param).encode("utf-8"))
    h.update(to_text(solver.net.param).encode("utf-8"))
    return h.hexdigest()[:16]


def data_layers(net) -> list[tuple[str, Any]]:
    """(name, layer) of the net's layers that read a record stream (those with ``set_shard``)."""
    return [(n, layer) for n, layer in zip(net.layer_names, net.layers) if hasattr(layer, "set_shard")]


def shared_counter_states(rank_states: list[dict]) -> dict:
    """From the per-rank read states of a snapshot: for each data layer, the state of the rank that
    read furthest (its ``offset`` is the stream position the next record comes from: the shared
    record counter every rank continues from when the rank count changed)."""
    out: dict = {}
    for states in rank_states:
        for name, s in states.items():
            if name not in out or int(s.get("offset", 0)) > int(out[name].get("offset", 0)):
                out[name] = s
    return out


class DataParallel:
    """Attach synchronous data parallelism over ``comm`` to ``solver`` (see module docstring).

    ``bucket_bytes`` sizes the all-reduce buckets; ``overlap=False`` reduces only after backward
    (for measuring what the overlap hides); ``shares``: None (every rank the prototxt's batch, as
    Caffe), a list of per-rank batch sizes summing to N x batch_size, or ``"auto"`` (measured).
    """

    def __init__(self, solver, comm: Comm, bucket_bytes: int = 1 << 20, overlap: bool = True,
                 shares: Sequence[int] | str | None = None):
        self.solver = solver
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size
        self.shares: list[int] | None = None
        self.block: tuple[int, int] | None = None  # this rank's (start, count) of every global batch
        #: data layers every rank reads whole (split other than by sample): name -> global batch; resharding
        #: (a resume under another rank count) leaves them reading the whole global batch
        self.whole_batch: dict[str, int] = {}
        comm.agree(definition_hash(solver), "the solver and net definitions (solver prototxt, net prototxt, "
                   "level/stage)")
        self.broadcast_weights()
        self._seed_rank_streams()
        self._bucket_bytes, self._overlap = bucket_bytes, overlap
        #: collectives every rank runs before the root uses the whole net (a snapshot, a test): split layers
        #: gathering their slices
        self.share_slices: list = []
        self.sync = GradientSync(solver.net, comm, bucket_bytes=bucket_bytes, overlap=overlap)
        if shares is not None and shares != "equal":
            self.set_shares(self.measure_shares() if shares == "auto" else list(shares))
        else:
            self.shard_data()
        solver.net.backward_hooks.append(self.sync.hook)
        # mpiexec names a rank that dies by its pid: say which pid is which rank
        import os
        import socket

        where = comm.gather_obj((os.getpid(), socket.gethostname()), root=0)
        if comm.is_root:
            if not isinstance(comm, ThreadComm):  # the workers of a ThreadComm are threads of this process
                log.info("MPI ranks: %s", ", ".join(f"{r}=pid {p}@{h}" for r, (p, h) in enumerate(where)))
            b = _train_batch(solver.net)
            each = f"batch {b}" if b else "its batch"
            if self.shares is not None:
                each = "batch " + "/".join(map(str, self.shares)) + " (by rank)"
            unit = "worker" if isinstance(comm, ThreadComm) else "rank"
            log.info("Data parallel on %d %s: each %s %s, global batch %s; gradients summed in %d "
                     "bucket(s) of %d bytes in all", self.size, ranks_word(comm), unit, each,
                     f"{b * self.size}" if b else f"{self.size} x batch", len(self.sync.buckets),
                     self.sync.stats.bytes)

    @property
    def is_root(self) -> bool:
        return self.comm.is_root

    # -- start-up --------------------------------------------------------------------------------
    def broadcast_weights(self) -> None:
        """Give every rank the root's parameters (all layer blobs, learnable or not)."""
        net = self.solver.net
        for nid, (lid, pid) in enumerate(net.param_layer_indices):
            if net.param_owners[nid] >= 0:
                continue
            blob = net.layers[lid].blobs[pid]
            host = np.ascontiguousarray(to_host(blob.data))
            self.comm.bcast(host, root=0)
            if not self.is_root:
                blob.device.upload(host, out=blob.data)

    def _seed_rank_streams(self) -> None:
        """Ranks > 0 draw dropout masks etc. from streams of their own (rank 0 keeps the shared ones): the host
        generator and the train net's device random streams (a key of the rank's own)."""
        if self.rank > 0:
            source = self.solver.random_source
            seed = int(source.generator.integers(0, 2**63 - 1))
            own = np.random.default_rng([seed, self.rank])
            source.restore(own.bit_generator.state)
            self.solver.net.random.rekey(key_from_host(own))

    def shard_data(self, states: dict | None = None) -> None:
        """Shard the train net's data layers, every rank continuing from the same read state
        (``states``: layer name -> state; default the root's current ones)."""
        layers = data_layers(self.solver.net)
        if states is None:
            states = self.comm.bcast_obj({n: layer.get_read_state() for n, layer in layers} if self.is_root
                                         else None)
        for name, layer in layers:
            if name in self.whole_batch:
                g = self.whole_batch[name]
                layer.set_shard(0, g, state=states.get(name), block=(0, g))
            elif self.shares is None:
                layer.set_shard(self.rank, self.size, state=states.get(name))
            else:
                layer.set_shard(self.rank, sum(self.shares), state=states.get(name), block=self.block)

    def set_shares(self, shares: Sequence[int], states: dict | None = None) -> None:
        """Give rank r ``shares[r]`` records of every global batch (the shares sum to N x batch_size)
        and weight its gradient and loss by its share (see module docstring)."""
        shares = [int(x) for x in shares]
        total = self.size * _train_batch(self.solver.net)
        if len(shares) != self.size or min(shares) < 1 or (total and sum(shares) != total):
            raise DistributedError(f"batch shares {shares} must give each of the {self.size} ranks at least 1 "
                                   f"record and sum to the global batch {total}")
        self.shares = shares
        self.block = (sum(shares[:self.rank]), shares[self.rank])
        self.sync.weight = shares[self.rank] / sum(shares)
        self.shard_data(states)
        if self.is_root:
            log.info("Batch shares of the global batch %d: %s", sum(shares),
                     ", ".join(f"rank {r} {b}" for r, b in enumerate(shares)))

    def measure_shares(self, passes: int = 3) -> list[int]:
        """Per-rank batch sizes proportional to each rank's measured speed (``passes`` forward/backward
        passes at the prototxt batch; the data read positions and diffs are restored afterwards)."""
        net = self.solver.net
        layers = data_layers(net)
        states = {n: layer.get_read_state() for n, layer in layers}
        net.forward_backward()  # warm-up (lowering plans, buffers)
        t = time.perf_counter()
        for _ in range(passes):
            net.forward_backward()
        rate = passes / (time.perf_counter() - t)
        net.clear_param_diffs()
        for name, layer in layers:
            layer.set_read_state(states[name])
        rates = self.comm.allgather_obj(rate)
        shares = proportional_shares(rates, self.size * _train_batch(net))
        if self.is_root:
            log.info("Measured speeds (passes/s at batch %d): %s", _train_batch(net),
                     ", ".join(f"rank {r} {x:.3g}" for r, x in enumerate(rates)))
        return shares

    def keep_local(self, param_ids: Sequence[int], layer_diffs_final: bool = False) -> None:
        """Leave the learnable parameters ``param_ids`` out of the gradient all-reduce (slices this rank
        owns alone: their gradients are reduced, if at all, by whoever split them); ``layer_diffs_final``:
        the net's executor leaves each layer's diffs final when its backward returns (buckets start from
        the backward hooks)."""
        net = self.solver.net
        if self.sync.hook in net.backward_hooks:
            net.backward_hooks.remove(self.sync.hook)
        weight = self.sync.weight
        self.sync = GradientSync(net, self.comm, bucket_bytes=self._bucket_bytes, overlap=self._overlap,
                                 exclude=param_ids, layer_diffs_final=layer_diffs_final)
        self.sync.weight = weight
        net.backward_hooks.append(self.sync.hook)

    # -- each iteration --------------------------------------------------------------------------
    def arm(self) -> None:
        """Before the iteration's last forward/backward pass."""
        self.sync.arm()

    def finish(self, loss: float) -> np.float32:
        """Wait for the summed gradients (scaled by 1/N, or weighted by the shares); returns the loss of
        the global batch (the mean over ranks, or the share-weighted sum)."""
        w = self.sync.weight
        req = self.comm.iallreduce(np.array([loss if w is None else loss * w], np.float64))
        self.sync.finish()
        total = req.wait()[0]
        return np.float32(total / self.size if w is None else total)

    def combine_action(self, local: str) -> str:
        """The solver action all ranks take this iteration: the strongest any rank requested."""
        code = self.comm.allreduce_scalar(_ACTIONS.index(local), op="max")
        return _ACTIONS[int(code)]

    # -- snapshots ---------------------------------------------------------------------------------
    def gather_read_states(self, states: dict) -> list[dict] | None:
        """Every rank's train-net read states on the root (None elsewhere), each with the shared counter state
        of its layer (``shared``: where the next global batch starts; a rank resuming under another sharding
        of that layer continues from it, :func:`cct.data.stream.continued_state`)."""
        ranks = self.comm.gather_obj(states, root=0)
        if ranks is None:
            return None
        shared = shared_counter_states(ranks)
        return [{name: {**s, "shared": shared[name]} for name, s in r.items()} for r in ranks]

    def gather_rng_states(self) -> list[dict] | None:
        return self.comm.gather_obj(self.solver.random_source.state(), root=0)


def proportional_shares(rates: Sequence[float], total: int) -> list[int]:
    """``total`` records split in proportion to ``rates`` (largest remainders; at least 1 each)."""
    n = len(rates)
    if total < n:
        raise ValueError(f"cannot give {n} ranks at least one of {total} records")
    exact = [total * r / sum(rates) for r in rates]
    out = [max(1, int(x)) for x in exact]
    while sum(out) > total:
        i = max(range(n), key=lambda k: (out[k] - exact[k], out[k]))
        out[i] -= 1
    while sum(out) < total:
        i = max(range(n), key=lambda k: exact[k] - out[k])
        out[i] += 1
    return out


def _train_batch(net) -> int:
    for _name, layer in data_layers(net):
        p = layer.param
        for f in ("data_param", "hdf5_data_param", "image_data_param"):
            if p.HasField(f) and getattr(p, f).batch_size:
                return int(getattr(p, f).batch_size)
    return 0
