"""``cct train --groups auto|N|sync|async``: Omnivore training on the ranks of ``mpiexec -n N``.

Every rank runs the same command. Rank 0 builds the solver (its net is the model the servers keep,
its test nets test it, it writes the snapshots); the other ranks are conv compute ranks.

- ``--groups N``: N compute groups for the whole run, explicit momentum compensated for the
  implicit momentum of N groups (``1 - N (1 - momentum)``, at least 0), the solver's lr policy;
- ``--groups sync`` = 1 group (synchronous SGD), ``--groups async`` = one group per conv rank;
- ``--groups auto``: the optimizer of Algorithm 1 (:mod:`cct.omnivore.optimizer`), with epochs of
  ``--omnivore_epoch`` iterations, its trials run on the ranks from in-memory checkpoints.
"""
from __future__ import annotations

import logging
import math
import os
import socket

import numpy as np

from ..distributed import Comm, LocalComm
from ..errors import CctError
from ..solver import get_solver
from .he_model import HEModel
from .momentum import compensate_momentum
from .mpi_exec import ConvWorker, OmnivoreServer, PhaseResult, check_finite, groups_of, omnivore_comm
from .optimizer import OmnivoreOptimizer

log = logging.getLogger("cct")


def parse_groups(value: str, n_conv: int) -> int | str:
    """``auto`` or a group count in 1..n_conv from ``sync``, ``async`` or a number."""
    v = value.strip().lower()
    if v == "auto":
        return "auto"
    if v == "sync":
        return 1
    if v == "async":
        return n_conv
    try:
        g = int(v)
    except ValueError:
        raise CctError(f"--groups must be auto, sync, async or a number, not '{value}'") from None
    if not 1 <= g <= n_conv:
        raise CctError(f"--groups {g}: with {n_conv} conv ranks (mpiexec -n {n_conv + 1}) g must be in 1..{n_conv}")
    return g


class MPITrialRunner:
    """The optimizer's :class:`~cct.omnivore.optimizer.TrialRunner` on MPI ranks (rank 0's side).

    ``train`` runs in chunks that stop at the solver's test and snapshot intervals; ``results`` keeps
    every phase's :class:`PhaseResult` (with ``kind`` trial/train) for the HE measurements and the log.
    """

    def __init__(self, server: OmnivoreServer, fail_rank: int = -1, fail_kill: bool = False):
        self.server = server
        self.fail_rank = fail_rank
        self.fail_kill = fail_kill
        self.results: list[tuple[str, float, PhaseResult]] = []

    def trial(self, g: int, mu: float, lr: float, iters: int) -> float:
        state = self.server.checkpoint()
        try:
            res = self.server.run_phase(g, mu, lr, iters, fail_rank=self.fail_rank, fail_kill=self.fail_kill)
        finally:
            self.server.restore(state)
        self.results.append(("trial", mu, res))
        loss = res.final_loss(max(1, iters // 2))
        return loss if all(math.isfinite(x) for x in res.losses) else math.nan

    def train(self, g: int, mu: float, lr: float | None, iters: int) -> float:
        s = self.server.solver
        p = s.param
        stop = s.iter + iters
        res = None
        state = self.server.checkpoint()
        while s.iter < stop:
            if p.test_interval and s.iter % p.test_interval == 0 and (s.iter > 0 or p.test_initialization):
                s.test_all()
            nxt = stop
            for every in (p.test_interval, p.snapshot):
                if every:
                    nxt = min(nxt, (s.iter // every + 1) * every)
            res = self.server.run_phase(g, mu, lr, nxt - s.iter, fail_rank=self.fail_rank, fail_kill=self.fail_kill)
            self.results.append(("train", mu, res))
            if lr is not None and not all(math.isfinite(x) for x in res.losses):
                self.server.restore(state)  # the optimizer retries at a lower rate
                return math.nan
            check_finite(res, f"g={g} mu={mu:g} lr={lr if lr is not None else 'policy'}")
            if p.snapshot and s.iter % p.snapshot == 0:
                s.snapshot()
        return res.final_loss() if res is not None else math.nan


def measure_he(runner: MPITrialRunner, iters: int = 6) -> HEModel:
    """t_fc and t_conv(1) from a short fully asynchronous trial (k = 1; medians), T_nc = 0 on loopback."""
    srv = runner.server
    state = srv.checkpoint()
    try:
        res = srv.run_phase(srv.n_conv, 0.0, 0.0, max(iters, srv.n_conv * 2))
    finally:
        srv.restore(state)

    t_fc = float(np.median(res.t_fc)) if res.t_fc else 0.0
    t_conv = float(np.median(res.t_conv)) if res.t_conv else 0.0
    he = HEModel(t_fc=t_fc, t_conv1=t_conv)
    log.info("Omnivore: measured t_fc = %.3g ms, t_conv(1) = %.3g ms; FC saturates at g = %d of %d conv ranks",
             1e3 * t_fc, 1e3 * t_conv, he.saturating_groups(srv.n_conv), srv.n_conv)
    return he


def omnivore_train(param, source: str, config, groups: str, epoch_iters: int | None = None,
                   resume: str | None = None, fail_rank: int = -1, comm: Comm | None = None,
                   fail_kill: bool = False) -> int:
    """Run Omnivore training on every rank (rank 0 returns after the run, the others when told to stop)."""
    comm = comm if comm is not None else omnivore_comm()
    role = "FC server + conv model server" if comm.rank == 0 else "conv compute"
    pids = comm.gather_obj((os.getpid(), socket.gethostname()), root=0)
    if comm.rank == 0:  # mpiexec names a killed process by its PID: this line maps PIDs to ranks
        log.info("Omnivore: ranks: %s", ", ".join(f"{r}=pid {p}@{h}" for r, (p, h) in enumerate(pids)))
    try:
        if comm.rank == 0:
            _rank0(param, source, config, groups, epoch_iters, resume, fail_rank, comm, fail_kill)
        else:
            logging.getLogger("cct").setLevel(logging.WARNING)
            _worker(param, source, config, comm)
    except BaseException as e:
        what = f"{type(e).__name__}: {e}" if not isinstance(e, CctError) else str(e)
        log.error("Omnivore: rank %d (%s) failed: %s; aborting the job (ranks 0..%d)", comm.rank, role, what,
                  comm.size - 1)
        if comm.size > 1:
            logging.shutdown()
            comm.abort("", 1)
        raise
    return 0


def _worker(param, source: str, config, comm: Comm) -> None:
    p = type(param)()
    p.CopyFrom(param)
    p.ClearField("test_net")
    p.ClearField("test_net_param")
    p.ClearField("test_iter")
    p.test_interval = 0
    p.ClearField("snapshot_prefix")
    p.snapshot = 0
    net = get_solver(p, _source=source, config=config, comm=LocalComm()).net  # not cct's data parallelism
    ConvWorker(net, comm).serve()


def _rank0(param, source: str, config, groups: str, epoch_iters: int | None, resume: str | None, fail_rank: int,
           comm: Comm, fail_kill: bool = False) -> None:
    solver = get_solver(param, _source=source, config=config, comm=LocalComm())  # not cct's data parallelism
    server = OmnivoreServer(solver, comm)
    try:
        if resume:
            log.info("Resuming from %s", resume)
            solver.restore(resume)
        choice = parse_groups(groups, server.n_conv)
        runner = MPITrialRunner(server, fail_rank, fail_kill)
        p = solver.param
        left = p.max_iter - solver.iter
        solver.validate_update_params()
        log.info("Solving %s", solver.net.name)
        if choice == "auto":
            epoch = epoch_iters or max(1, left // 4)
            he = measure_he(runner)
            opt = OmnivoreOptimizer(runner, server.n_conv, epoch_iters=epoch, he=he,
                                    cold_start_iters=min(epoch, left))
            opt.run(left)
            log.info("Omnivore: search took %.1f%% of the iterations (%d trial iterations)",
                     100 * opt.search_fraction(), sum(d.search_iters for d in opt.decisions))
        else:
            mu = compensate_momentum(p.momentum, choice)
            log.info("Omnivore: g=%d groups of %s conv ranks, explicit momentum %g (solver momentum %g "
                     "compensated for implicit momentum %g)", choice,
                     "/".join(str(len(x)) for x in groups_of(comm.size, choice)), mu, p.momentum, 1 - 1 / choice)
            if left > 0:
                runner.train(choice, mu, None, left)
        if p.snapshot_after_train and (not p.snapshot or solver.iter % p.snapshot != 0):
            solver.snapshot()
        if p.test_interval and solver.iter % p.test_interval == 0:
            solver.test_all()
        log.info("Optimization Done.")
    finally:
        server.stop()
