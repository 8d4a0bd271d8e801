"""Omnivore on MPI ranks: the merged FC server, the conv model server, conv compute groups.

Physical map (5.1, E.2). Rank 0 holds the merged FC server (the FC tail's compute and model) and the
conv model server; ranks 1..N-1 are conv compute ranks, split into g groups of k = (N-1)/g
(sizes differ by one when g does not divide N-1). The conv model server sits with the FC server on
rank 0, a placement D.4.2 allows ("can also be mapped to the same machine as the FC compute/model
server"): one polled event loop serves both, so no rank runs a second thread, and on a machine with
fewer cores than ranks no compute rank is slowed by serving. A net without an FC tail runs plain
data parallelism: each group runs the whole net and rank 0 only keeps the model.

Execution (one *phase* = a number of iterations at a fixed (g, mu, lr)):

- Inside a group, synchronous: the leader (the group's first rank) reads the group's batch from the
  data layers and splits it along axis 0 over the group's ranks; conv gradients are summed within
  the group's communicator (in a fixed order) by the leader.
- Across groups, asynchronous, no barrier: before each iteration the leader asks rank 0 for an
  iteration number (rank 0 hands out exactly the phase's iterations); during its forward the group
  pulls the current conv model lazily, layer by layer, just before it runs each layer; it sends its
  conv output (and the labels) to the FC server, which runs FC forward+backward for one group at a
  time (the FC model is never stale), replies with the gradient w.r.t. the conv output and then
  updates the FC model; the group finishes backward and pushes its conv gradient, which rank 0
  applies at once (SGD, explicit momentum mu, rate lr, the solver's weight decay and lr_mult).
- g = 1 is synchronous SGD: the same weights as one process training the whole batch, to float
  rounding. g = N-1 is fully asynchronous.

Iterations are counted in batches: every group request is one iteration of the solver, so a phase of
n iterations processes n batches whatever g is. Each group's data layers skip the batches the other
groups take (group j reads batches j, j+g, j+2g, ...).

Faults: any exception on any rank is logged as ``Omnivore: rank R (role) failed: ...`` and the whole
job is aborted (MPI_Abort): MPI-3 has no way for the others to go on after a rank is lost, so the job
stops with an error naming the rank rather than hanging. Only rank 0 writes files (snapshots are
written atomically), so nothing is left half-written; the last snapshot stays valid.
"""
from __future__ import annotations

import logging
import math
import os
import signal
import time
from dataclasses import dataclass, field

import numpy as np

from ..distributed import Comm, LocalComm, MPIComm, world
from ..errors import CctError, SolverError
from ..solver import updates
from .he_model import group_sizes
from .mapping import NetSplit, split_of

log = logging.getLogger("cct")

TAG_PHASE, TAG_START, TAG_GRANT, TAG_PULL, TAG_MODEL, TAG_FC, TAG_FC_REPLY, TAG_PUSH, TAG_DONE, TAG_GROUP = range(1, 11)
POLL_S = 2e-5  # first sleep of a polled wait (see MPIComm)


def omnivore_comm(poll_s: float = POLL_S) -> Comm:
    """Omnivore's communicator: a duplicate of the job's world (its messages never meet other traffic)
    whose object messages wait by polling; the one-process group when not under mpiexec."""
    w = world()
    if isinstance(w, LocalComm) or not isinstance(w, MPIComm):
        return w
    return MPIComm(w.handle.Dup(), poll_s=poll_s)



class OmnivoreError(CctError):
    """A failure of Omnivore's distributed run; the message names the rank."""


@dataclass(frozen=True)
class Phase:
    """What every rank runs next: ``iters`` iterations with g groups at momentum mu and rate lr (``lr``
    None: the solver's lr policy), starting at solver iteration ``first_iter``; ``stop`` ends the workers."""

    g: int = 1
    mu: float = 0.0
    lr: float | None = None
    iters: int = 0
    first_iter: int = 0
    stop: bool = False
    fail_rank: int = -1  # tests: this rank raises during the phase
    fail_kill: bool = False  # tests: ... or kills itself (SIGKILL)


@dataclass
class PhaseResult:
    """What rank 0 saw during a phase."""

    g: int
    losses: list[float] = field(default_factory=list)
    finish_times: list[float] = field(default_factory=list)
    t_fc: list[float] = field(default_factory=list)
    t_conv: list[float] = field(default_factory=list)
    wall: float = 0.0
    weights: list[np.ndarray] = field(default_factory=list)

    @property
    def time_per_iter(self) -> float:
        """Mean time between completed iterations (after the first), in seconds."""
        f = self.finish_times
        return (f[-1] - f[0]) / (len(f) - 1) if len(f) > 1 else self.wall

    def final_loss(self, last: int = 10) -> float:
        """Mean of the last ``last`` iterations' losses (non-finite if any of them is)."""
        tail = self.losses[-last:]
        return float(np.mean(tail)) if tail else math.nan


def param_ids(net, split: NetSplit) -> tuple[list[int], list[int], dict[int, list[int]]]:
    """(conv learnable ids, FC learnable ids, layer index -> its learnable ids). A parameter shared
    between the conv phase and the FC tail cannot be split and is an error."""
    conv: list[int] = []
    fc: list[int] = []
    by_layer: dict[int, list[int]] = {}
    fc_start = split.fc_start if split.fc_start is not None else split.n_layers
    for net_id, (layer_id, _) in enumerate(net.param_layer_indices):
        lid = net.learnable_param_ids[net_id]
        by_layer.setdefault(layer_id, []).append(lid)
        side = fc if layer_id >= fc_start else conv
        other = conv if side is fc else fc
        if lid in other:
            raise OmnivoreError(f"Omnivore: layer '{net.layer_names[layer_id]}' shares a parameter across the "
                                "conv phase and the FC tail; such a net cannot be split")
        if lid not in side:
            side.append(lid)
    return conv, fc, by_layer


def _set_blob(blob, arr: np.ndarray) -> None:
    blob.reshape(arr.shape)
    blob.data[...] = arr


def conv_ranks(size: int) -> list[int]:
    """The conv compute ranks of a world of ``size`` ranks."""
    return list(range(1, size))


def groups_of(size: int, g: int) -> list[list[int]]:
    """The ranks of each of g groups over the conv ranks of a world of ``size``."""
    ranks = conv_ranks(size)
    out, at = [], 0
    for n in group_sizes(len(ranks), g):
        out.append(ranks[at:at + n])
        at += n
    return out


# -- rank 0 --------------------------------------------------------------------------------------------
class OmnivoreServer:
    """Rank 0: the merged FC server and the conv model server, over a built solver (its net is the model).

    :meth:`run_phase` runs one phase on all ranks; :meth:`checkpoint`/:meth:`restore` keep the model in
    memory for the optimizer's trials; :meth:`stop` ends the workers.
    """

    def __init__(self, solver, comm: Comm):
        self.solver = solver
        self.net = solver.net
        self.comm = comm
        if comm.size < 2:
            raise OmnivoreError("Omnivore needs at least 2 MPI ranks (1 server + conv ranks); run under "
                                "mpiexec -n N with N >= 2")
        if solver.param.iter_size != 1:
            raise OmnivoreError(f"Omnivore: iter_size {solver.param.iter_size} is not supported (use 1)")
        self.split = split_of(self.net)
        self.conv_pids, self.fc_pids, self.layer_pids = param_ids(self.net, self.split)
        self.n_conv = comm.size - 1
        self.stopped = False
        self._losses: list[float] = []
        log.info("Omnivore: %d ranks: rank 0 = FC server + conv model server, ranks 1..%d = conv compute; %s",
                 comm.size, comm.size - 1, self.split.describe(self.net.layer_names))

    # -- updates ---------------------------------------------------------------------------------------
    def _rate(self, it: int, lr: float | None) -> float:
        if lr is not None:
            return lr
        s = self.solver
        saved = s.iter
        s.iter = it
        try:
            return s.get_learning_rate()
        finally:
            s.iter = saved

    def _update(self, pids: list[int], rate: float, mu: float) -> None:
        """Caffe's ApplyUpdate for the parameters ``pids`` only, with momentum ``mu``."""
        s = self.solver
        params = self.net.learnable_params
        saved = s.param.momentum
        s.param.momentum = mu
        try:
            if s.param.clip_gradients > 0:
                updates.clip_gradients([params[i].diff for i in pids], s.param.clip_gradients)
            for pid in pids:
                s.normalize(pid)
                if not s.fused_update(pid, rate):
                    s.regularize(pid)
                    s.compute_update_value(pid, rate)
            for pid in pids:
                params[pid].data -= params[pid].diff
        finally:
            s.param.momentum = saved

    # -- the phase -------------------------------------------------------------------------------------
    def run_phase(self, g: int, mu: float, lr: float | None, iters: int, *, record: bool = False,
                  fail_rank: int = -1, fail_kill: bool = False) -> PhaseResult:
        """Run ``iters`` iterations with g groups; returns the losses and timings rank 0 saw."""
        if not 1 <= g <= self.n_conv:
            raise OmnivoreError(f"Omnivore: g = {g} groups is not possible with {self.n_conv} conv ranks "
                                f"(use 1..{self.n_conv})")
        s, net, sp = self.solver, self.net, self.split
        phase = Phase(g, mu, lr, iters, s.iter, fail_rank=fail_rank, fail_kill=fail_kill)
        for r in conv_ranks(self.comm.size):
            self.comm.send_obj(phase, r, TAG_PHASE)
        self.comm.split(None)  # the group communicators (rank 0 is in none)
        leaders = {grp[0]: i for i, grp in enumerate(groups_of(self.comm.size, g))}
        res = PhaseResult(g)
        granted = 0
        fc_iter = conv_iter = s.iter
        done = 0
        start = time.perf_counter()
        p = s.param
        average = max(1, p.average_loss)
        while done < len(leaders):
            msg, src, tag = self.comm.recv_any()
            if tag == TAG_START:
                it = s.iter + granted if granted < iters else -1
                granted += it >= 0
                self.comm.send_obj(it, src, TAG_GRANT)
            elif tag == TAG_PULL:
                self.comm.send_obj([b.data for b in net.layers[msg].blobs], src, TAG_MODEL)
            elif tag == TAG_FC:
                t0 = time.perf_counter()
                for name, arr in msg.items():
                    _set_blob(net.blobs[name], arr)
                for pid in self.fc_pids:
                    net.learnable_params[pid].diff[...] = 0
                loss = net.forward_from_to(sp.fc_start, sp.n_layers - 1)
                net.backward_from_to(sp.n_layers - 1, sp.fc_start)
                self.comm.send_obj((loss, {b: net.blobs[b].diff for b in sp.fc_grads}), src, TAG_FC_REPLY)
                self._update(self.fc_pids, self._rate(fc_iter, lr), mu)
                res.t_fc.append(time.perf_counter() - t0)
                self._record_loss(res, fc_iter, loss, average)
                fc_iter += 1
            elif tag == TAG_PUSH:
                grads, loss, t_conv = msg
                for pid, gr in zip(self.conv_pids, grads):
                    net.learnable_params[pid].diff[...] = gr
                self._update(self.conv_pids, self._rate(conv_iter, lr), mu)
                conv_iter += 1
                res.t_conv.append(t_conv)
                if not sp.has_fc_tail:
                    self._record_loss(res, conv_iter - 1, loss, average)
                if record:
                    res.weights.append(np.concatenate([net.learnable_params[i].data.ravel() for i in self.conv_pids]))
            elif tag == TAG_DONE:
                done += 1
            else:
                raise OmnivoreError(f"Omnivore: unexpected message tag {tag} from rank {src}")
        res.wall = time.perf_counter() - start
        s.iter += iters
        bad = next((x for x in res.losses if not math.isfinite(x)), None)
        if bad is not None:
            log.error("Omnivore: the loss became %s (g=%d mu=%g lr=%s)", bad, g, mu, lr)
        return res

    def _record_loss(self, res: PhaseResult, it: int, loss: float, average: int) -> None:
        res.losses.append(float(loss))
        res.finish_times.append(time.perf_counter())
        self._losses = (self._losses + [float(loss)])[-average:]
        p = self.solver.param
        if p.display and it % p.display == 0:
            log.info("Iteration %d, loss = %.6g", it, float(np.mean(self._losses)))

    # -- state ---------------------------------------------------------------------------------------------
    def checkpoint(self) -> dict:
        """The model, the update history and the iteration, copied (for trials from the same point)."""
        s = self.solver
        return {"params": [p.data.copy() for p in self.net.learnable_params],
                "history": [h.copy() for h in s.history], "iter": s.iter, "current_step": s.current_step}

    def restore(self, state: dict) -> None:
        s = self.solver
        for p, a in zip(self.net.learnable_params, state["params"]):
            p.data[...] = a
        for h, a in zip(s.history, state["history"]):
            h[...] = a
        s.iter, s.current_step = state["iter"], state["current_step"]

    def stop(self) -> None:
        """End the workers' loops (once)."""
        if not self.stopped:
            self.stopped = True
            self.stop_all(self.comm)

    @staticmethod
    def stop_all(comm: Comm) -> None:
        """Tell every conv rank to leave :meth:`ConvWorker.serve`."""
        for r in conv_ranks(comm.size):
            comm.send_obj(Phase(stop=True), r, TAG_PHASE)


# -- conv ranks ---------------------------------------------------------------------------------------------
class ConvWorker:
    """A conv compute rank: runs phases sent by rank 0 until told to stop."""

    def __init__(self, net, comm: Comm):
        self.net = net
        self.comm = comm
        self.split = split_of(net)
        self.conv_pids, _, self.layer_pids = param_ids(net, self.split)

    def serve(self) -> None:
        while True:
            phase = self.comm.recv_obj(0, TAG_PHASE)
            if phase.stop:
                return
            self.run_phase(phase)

    def run_phase(self, phase: Phase) -> None:
        rank = self.comm.rank
        groups = groups_of(self.comm.size, phase.g)
        gi = next(i for i, grp in enumerate(groups) if rank in grp)
        gc = self.comm.split(gi, rank)
        try:
            self._run_group(phase, gc, gi)
        finally:
            gc.free()

    def _run_group(self, phase: Phase, gc: Comm, gi: int) -> None:
        net, sp, comm = self.net, self.split, self.comm
        leader = gc.rank == 0
        k = gc.size
        members = range(1, k)
        if leader:
            for _ in range(gi):  # group gi takes batches gi, gi + g, ...
                net.forward_from_to(0, sp.data_end - 1)
        first = True
        while True:
            it = _from_leader(gc, lambda: _ask(comm, None, TAG_START, TAG_GRANT))
            if it < 0:
                break
            if phase.fail_rank == comm.rank:
                if phase.fail_kill:
                    os.kill(os.getpid(), signal.SIGKILL)
                raise OmnivoreError(f"injected failure at iteration {it}")
            t0 = time.perf_counter()
            if leader:
                if not first:
                    for _ in range(phase.g - 1):  # the batches the other groups take
                        net.forward_from_to(0, sp.data_end - 1)
                net.forward_from_to(0, sp.data_end - 1)
                parts = {n: np.array_split(net.blobs[n].data, k) for n in sp.data_tops}
                for m in members:
                    gc.send_obj({n: v[m] for n, v in parts.items()}, m, TAG_GROUP)
                mine = {n: v[0] for n, v in parts.items()}
                batch = net.blobs[sp.data_tops[0]].data.shape[0]
            else:
                mine = gc.recv_obj(0, TAG_GROUP)
                batch = 0
            first = False
            for n, arr in mine.items():
                _set_blob(net.blobs[n], np.array(arr))
            share = mine[sp.data_tops[0]].shape[0]
            loss = 0.0
            for li in range(sp.data_end, sp.conv_end):
                if self.layer_pids.get(li):
                    arrays = _from_leader(gc, lambda li=li: _ask(comm, li, TAG_PULL, TAG_MODEL))
                    for b, a in zip(net.layers[li].blobs, arrays):
                        b.data[...] = a
                loss += net.forward_from_to(li, li)
            wait = 0.0
            if sp.has_fc_tail:
                outs = {b: net.blobs[b].data for b in sp.fc_inputs}
                if leader:
                    pieces = [outs] + [gc.recv_obj(m, TAG_GROUP) for m in members]
                    sizes = [pc[sp.fc_inputs[0]].shape[0] for pc in pieces]
                    full = {b: np.concatenate([pc[b] for pc in pieces]) for b in sp.fc_inputs}
                    tw = time.perf_counter()
                    comm.send_obj(full, 0, TAG_FC)
                    loss, grads = comm.recv_obj(0, TAG_FC_REPLY)
                    wait = time.perf_counter() - tw
                    cuts = np.cumsum(sizes)[:-1]
                    split_grads = {b: np.split(gr, cuts) for b, gr in grads.items()}
                    for m in members:
                        gc.send_obj({b: v[m] for b, v in split_grads.items()}, m, TAG_GROUP)
                    mine_g = {b: v[0] for b, v in split_grads.items()}
                else:
                    gc.send_obj(outs, 0, TAG_GROUP)
                    mine_g = gc.recv_obj(0, TAG_GROUP)
                for b, gr in mine_g.items():
                    net.blobs[b].diff[...] = gr
            for pid in self.conv_pids:
                net.learnable_params[pid].diff[...] = 0
            net.backward_from_to(sp.conv_end - 1, sp.data_end)
            grads = [net.learnable_params[pid].diff for pid in self.conv_pids]
            if not sp.has_fc_tail:  # each rank's loss layer averaged over its share: weight by share / batch
                scale = np.float32(share)
                grads = [gr * scale for gr in grads]
                loss = float(loss) * share
            if leader:
                total = [gr.copy() for gr in grads]
                for m in members:
                    theirs, their_loss = gc.recv_obj(m, TAG_GROUP)
                    for t, x in zip(total, theirs):
                        t += x
                    loss += their_loss if not sp.has_fc_tail else 0.0
                if not sp.has_fc_tail:
                    inv = np.float32(1.0 / batch)
                    total = [t * inv for t in total]
                    loss /= batch
                comm.send_obj((total, loss, time.perf_counter() - t0 - wait), 0, TAG_PUSH)
            else:
                gc.send_obj((grads, loss), 0, TAG_GROUP)
        if leader:
            comm.send_obj(None, 0, TAG_DONE)


def _ask(comm: Comm, request, tag: int, reply_tag: int):
    """Send ``request`` to rank 0 and wait for its reply."""
    comm.send_obj(request, 0, tag)
    return comm.recv_obj(0, reply_tag)


def _from_leader(gc: Comm, fetch):
    """On the group's leader (group rank 0): ``fetch()`` and send the value to the group's other ranks;
    on those: receive it."""
    if gc.rank != 0:
        return gc.recv_obj(0, TAG_GROUP)
    value = fetch()
    for m in range(1, gc.size):
        gc.send_obj(value, m, TAG_GROUP)
    return value


def check_finite(res: PhaseResult, what: str) -> None:
    """A :class:`SolverError` when a phase's loss became NaN/inf."""
    bad = [i for i, x in enumerate(res.losses) if not math.isfinite(x)]
    if bad:
        raise SolverError(f"Omnivore: {what}: the loss became {res.losses[bad[0]]} at the phase's iteration "
                          f"{bad[0]}; lower the learning rate or the momentum")
