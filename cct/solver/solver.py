"""Caffe's Solver: construction and the training loop (the update is :mod:`.update_step`, the test passes
:mod:`.evaluation`, snapshots and resume :mod:`.state`, CUDA graphs of an iteration :mod:`.graphed`; the six
update rules are :mod:`.rules`, their arithmetic :mod:`.updates`).

``get_solver("solver.prototxt")`` builds the solver the file's ``type`` (or deprecated
``solver_type``) names: the train net, the test nets (sharing the train net's weights), the update
history. ``step(n)`` runs n iterations exactly as Caffe's ``Solver::Step``:

1. clear the param diffs; every ``test_interval`` iterations run the test nets first;
2. ``iter_size`` forward/backward passes accumulate the gradient; their mean loss is the
   iteration's loss (smoothed over ``average_loss`` iterations for the display);
3. ``apply_update``: the lr policy gives the rate, gradients are clipped (``clip_gradients``,
   global L2 norm), divided by ``iter_size``, regularised (``weight_decay * decay_mult``, L2/L1)
   and turned into the update by the solver's rule (rate * ``lr_mult``); ``Net.update`` applies it
   (the parameters, diffs and history live in flat buffers; on a GPU all of this is one fused kernel
   per solver type reading the rate from device memory, :mod:`.flat_update`);
4. ``iter += 1``; snapshot every ``snapshot`` iterations, and on a SIGHUP/SIGINT request.

Under MPI (``mpiexec -n N``, or ``comm=`` given) the solver runs as one of N data-parallel ranks
(:mod:`cct.distributed.parallel`): gradients are summed over ranks and scaled by 1/N before the
update, the root alone tests and writes snapshots.

A non-finite loss stops training with a :class:`SolverError` naming the iteration (after writing a
snapshot when the solver has snapshots configured); Caffe itself would go on with NaN weights.

On a device (GPU) net an iteration does not stop for the host: its loss goes to a device buffer
(:class:`cct.device.losses.LossLog`) and the layers' checks (label ranges) are recorded on the
device (:mod:`cct.device.deferred`). Both are read at the boundaries -- a display iteration, before
a test, before a snapshot, the end of ``step`` -- where the smoothed loss is replayed iteration by
iteration as Caffe computes it, and a failure raises naming the iteration it happened in. A numpy
net reads both after every iteration, as it always has.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable
from typing import ClassVar

import numpy as np

from ..config import Config, current
from ..device.driver import device_of
from ..device.losses import LossLog
from ..distributed import world
from ..distributed.launch import under_mpi
from ..distributed.parallel import DataParallel
from ..errors import CctError, LayerError, SolverError
from ..io.prototxt import read_net_prototxt, read_solver_prototxt, to_text
from ..io.upgrade import upgrade_solver
from ..log import ostream_float as _fmt
from ..net import Net
from ..proto import caffe_pb2
from ..random_source import RandomSource
from ..scheduler.config import devices_for_solver_mode
from . import lr_policy, signals
from .evaluation import Evaluation
from .flat_update import FlatUpdate
from .graphed import GraphedIterations, why_not_graphs
from .state import SolverState
from .tensorboard import TensorBoardWriter
from .timing import PhaseTimer, data_seconds
from .update_step import UpdateStep

log = logging.getLogger("cct")

# most losses a device net keeps between two reads: a step without display, tests or snapshots reads
# them every _LOSS_LOG_LIMIT iterations
_LOSS_LOG_LIMIT = 1024

_SOLVERS: dict[str, type[Solver]] = {}

Callback = Callable[[], None]


def register_solver(cls: type[Solver]) -> type[Solver]:
    """Class decorator: make a Solver subclass available under its ``type`` name."""
    _SOLVERS[cls.type] = cls
    return cls


def solver_type_list() -> list[str]:
    """The registered solver type names (sorted)."""
    return sorted(_SOLVERS)


def read_solver_param(source: str | os.PathLike | caffe_pb2.SolverParameter) -> caffe_pb2.SolverParameter:
    """A SolverParameter from a prototxt path (upgraded as Caffe's ReadSolverParamsFromTextFile) or a
    copy of the given message (with the deprecated ``solver_type`` mapped to ``type``)."""
    if isinstance(source, caffe_pb2.SolverParameter):
        param = caffe_pb2.SolverParameter()
        param.CopyFrom(source)
        return upgrade_solver(param, source="<SolverParameter>")
    return read_solver_prototxt(os.fspath(source))


def get_solver(source: str | os.PathLike | caffe_pb2.SolverParameter, solver_type: str | None = None,
               **kwargs) -> Solver:
    """Build the solver a solver prototxt (path) or SolverParameter describes.

    ``solver_type`` overrides the file's ``type`` (pycaffe's ``caffe.SGDSolver(path)`` et al.).
    """
    param = read_solver_param(source)
    name = solver_type or param.type or "SGD"
    src = kwargs.pop("_source", None)
    if src is None and not isinstance(source, caffe_pb2.SolverParameter):
        src = os.fspath(source)
    if name not in _SOLVERS:
        where = f"{src}: " if src else ""
        raise SolverError(f"{where}Unknown solver type: {name} (known types: {', '.join(solver_type_list())})")
    return _SOLVERS[name](param, _source=src, **kwargs)


class Solver(UpdateStep, Evaluation, SolverState):
    """Caffe's Solver: owns the train net, the test nets and the iteration loop.

    Attributes: ``param`` (SolverParameter), ``net``, ``test_nets``, ``iter``, ``current_step``,
    ``lr`` (the rate used by the last update), ``history`` (the update-history arrays Caffe
    snapshots), ``config`` (the :class:`cct.config.Config` it gives its nets; default
    :func:`cct.config.current`), ``random_source`` (the :class:`cct.random_source.RandomSource` its nets
    draw from and its snapshots save: its own, seeded with ``random_seed`` when that is >= 0, else its
    config's), ``comm`` (the :class:`cct.distributed.Comm` of a data-parallel run;
    default: every rank of the job under ``mpiexec``, else none; ``shares=``: per-rank batch sizes or
    ``"auto"``, see :class:`~cct.distributed.parallel.DataParallel`) and ``parallel`` (its
    :class:`cct.distributed.parallel.DataParallel`, None in a single process). Subclasses implement
    :meth:`compute_update_value`. ``phase_timer``: a :class:`cct.solver.timing.PhaseTimer` when built
    with ``phase_times=True`` (where each iteration's time went, logged after ``solve``).
    ``tensorboard=DIR`` (``tensorboard_histograms=N``): a :class:`cct.solver.tensorboard.TensorBoardWriter`
    in ``solver.tensorboard`` (root rank only) writes the displayed losses and outputs, the test outputs
    and the learning rate (and every N iterations the weight and gradient histograms) as TensorBoard events.
    """

    type: ClassVar[str] = ""
    #: the rule of :mod:`.flat_update` that fuses this solver's update (None: per-parameter only)
    flat_rule: ClassVar[str | None] = None
    #: number of history arrays per learnable parameter (AdaDelta and Adam keep two)
    history_sets: ClassVar[int] = 1

    def __init__(self, param: str | os.PathLike | caffe_pb2.SolverParameter, *,
                 action_function: Callable[[], str] | None = None, _source: str | None = None,
                 config: Config | None = None, comm=None, shares=None,
                 phase_times: bool | PhaseTimer = False, tensorboard: str | os.PathLike | None = None,
                 tensorboard_histograms: int = 0):
        if not isinstance(param, caffe_pb2.SolverParameter):
            _source = os.fspath(param)
            param = read_solver_param(param)
        self.param = param
        self.source = _source or "<SolverParameter>"
        self.config = config if config is not None else current()  # handed to every net it builds
        self.comm = _resolve_comm(comm)
        self.parallel = None
        self.is_root = self.comm is None or self.comm.is_root
        # TensorBoard event files (root rank only): scalars at each display and test, histograms every N
        self.tensorboard = TensorBoardWriter(tensorboard, tensorboard_histograms) \
            if tensorboard is not None and self.is_root else None
        log.info("Initializing solver from parameters: \n%s", to_text(param))
        if param.average_loss < 1:
            raise SolverError(f"{self.source}: average_loss should be non-negative "
                              f"(average_loss: {param.average_loss}; use 1 or more)")
        if param.iter_size < 1:
            raise SolverError(f"{self.source}: iter_size must be at least 1 (iter_size: {param.iter_size})")
        if param.snapshot_format not in (caffe_pb2.SolverParameter.BINARYPROTO, caffe_pb2.SolverParameter.HDF5):
            raise SolverError(f"{self.source}: Unsupported snapshot format {param.snapshot_format}")
        self.check_params()
        self.iter = 0
        self.current_step = 0
        self._check_snapshot_write_permissions()
        # The host random source of its nets and snapshots: with random_seed >= 0 the solver's own, seeded
        # before the nets are built (Caffe seeds its process RNG there; two seeded solvers in one process
        # do not disturb each other), else its config's (Caffe's process RNG, cct.set_random_seed's).
        self.random_source = RandomSource(param.random_seed) if param.random_seed >= 0 else self.config.random
        self._log_mode()
        self.net = self._init_train_net()
        self.test_nets = self._init_test_nets()
        log.info("Solver scaffolding done.")
        self.iter = 0
        self.current_step = 0
        self.lr = 0.0
        self.requested_early_exit = False
        self.smoothed_loss = 0.0
        self._losses: list[float] = []
        self._loss_log = LossLog(self.net.xp, 1)  # this step's pending losses (see step)
        self._zero_loss = self.net.xp.zeros((), dtype=np.float32)  # never written
        self._mean_loss = self.net.xp.zeros((), dtype=np.float32)  # a distributed run's global mean loss
        self._display_clock = (time.perf_counter(), 0)  # when and at which iteration the last display was
        self._callbacks: list[tuple[Callback | None, Callback | None]] = []
        self._action_function = action_function
        self._last_snapshot_iter: int | None = None
        self.history: list = []
        self.history_buffers: list = []
        self.flat_update: FlatUpdate | None = None
        #: set by a captured-graph runner: the update reads nothing back (call flush_update_log at boundaries)
        self.defer_host_reads = False
        self.phase_timer: PhaseTimer | None = (phase_times if isinstance(phase_times, PhaseTimer)
                                               else PhaseTimer() if phase_times else None)
        self.pre_solve()
        if self.comm is not None and self.comm.size > 1:
            self.parallel = DataParallel(self, self.comm, shares=shares)
        self.step_graphs = self._setup_graphs()
        self._graphed_iteration = False

    # -- construction ----------------------------------------------------------------------
    def _setup_graphs(self) -> GraphedIterations | None:
        """CUDA graphs for the iterations of a GPU-resident net (:mod:`.graphed`), or None; logged either way."""
        reason = why_not_graphs(self)
        if reason is None:
            self.defer_host_reads = True  # the clipping line is read at boundaries
            log.info("Training iterations replay as CUDA graphs after one eager warm-up iteration (--nograph: off)")
            return GraphedIterations(self)
        if self.net.learnable_params and device_of(self.net.learnable_params[0].data).is_gpu:
            log.info("CUDA graphs not used: %s", reason)
        return None

    def graph_nodes(self) -> int | None:
        """Nodes in the CUDA graphs of one iteration (None without graphs)."""
        return self.step_graphs.nodes() if self.step_graphs is not None else None

    def check_params(self) -> None:
        """Solver-type specific checks of the parameters (Caffe's constructor CHECKs)."""

    def pre_solve(self) -> None:
        """Allocate the zeroed history: ``history_sets`` flat buffers like the train net's parameters (laid out
        flat when the net was built, :meth:`cct.net.Net.flatten_params`; again here, the test nets then sharing
        the new views, if a parameter was rebound since), of which ``history`` holds the per-parameter views
        (Caffe's per-parameter history, as snapshots store it). Builds the fused update (:attr:`flat_update`)
        where it runs (:meth:`use_flat_update`)."""
        before = self.net.flat_params
        flat = self.net.flatten_params()
        if flat is not before:  # a new layout: the test nets share the new views
            for net in self.test_nets:
                net.share_weights_with(self.net)
        self.history_buffers, self.history = flat.histories(self.history_sets)
        self.flat_update = None
        on_device = any(device_of(g.data).is_gpu for g in flat.groups)
        self.use_flat_update(on_device)

    def _log_mode(self) -> None:
        """Caffe's solver_mode/device_id, unless the config names devices already (--devices, set_devices)."""
        if self.config.devices is None:
            cfg = devices_for_solver_mode(self.param)
            if cfg is not None:
                self.config = self.config.replace(devices=cfg)

    def _read_net_file(self, path: str) -> caffe_pb2.NetParameter:
        try:
            return read_net_prototxt(path)
        except CctError as e:
            msg = str(e)
            if not os.path.exists(path):
                msg = f"cannot read net '{path}': no such file"
                if not os.path.isabs(path):
                    msg += f" (relative paths are resolved from the working directory {os.getcwd()})"
            raise type(e)(f"{self.source}: {msg}") from None

    def _load_weights(self, net: Net) -> None:
        for entry in self.param.weights:
            for name in entry.split(","):
                name = name.strip()
                if name:
                    log.info("Finetuning from %s", name)
                    net.copy_from(name)

    def _init_train_net(self) -> Net:
        p = self.param
        fields = "net, net_param, train_net, train_net_param"
        n = p.HasField("net") + p.HasField("net_param") + p.HasField("train_net") + p.HasField("train_net_param")
        if n < 1:
            raise SolverError(f"{self.source}: SolverParameter must specify a train net using one of these "
                              f"fields: {fields}")
        if n > 1:
            raise SolverError(f"{self.source}: SolverParameter must not contain more than one of these fields "
                              f"specifying a train_net: {fields}")
        net_param = caffe_pb2.NetParameter()
        if p.HasField("train_net_param"):
            log.info("Creating training net specified in train_net_param.")
            net_param.CopyFrom(p.train_net_param)
        elif p.HasField("train_net"):
            log.info("Creating training net from train_net file: %s", p.train_net)
            net_param = self._read_net_file(p.train_net)
        if p.HasField("net_param"):
            log.info("Creating training net specified in net_param.")
            net_param.CopyFrom(p.net_param)
        if p.HasField("net"):
            log.info("Creating training net from net file: %s", p.net)
            net_param = self._read_net_file(p.net)
        state = caffe_pb2.NetState()
        state.phase = caffe_pb2.TRAIN
        state.MergeFrom(net_param.state)
        state.MergeFrom(p.train_state)
        net_param.state.CopyFrom(state)
        net = Net(net_param, config=self.config, random=self.random_source)
        self._load_weights(net)
        net.flatten_params()  # before the test nets share its weights (pre_solve builds the update on it)
        return net

    def _init_test_nets(self) -> list[Net]:
        p = self.param
        has_net_param, has_net_file = p.HasField("net_param"), p.HasField("net")
        if has_net_param and has_net_file:
            raise SolverError(f"{self.source}: Both net_param and net_file may not be specified.")
        num_test_nets = len(p.test_net_param) + len(p.test_net)
        if has_net_param or has_net_file:
            if len(p.test_iter) < num_test_nets:
                raise SolverError(f"{self.source}: test_iter must be specified for each test network "
                                  f"({num_test_nets} test nets, {len(p.test_iter)} test_iter).")
        elif len(p.test_iter) != num_test_nets:
            raise SolverError(f"{self.source}: test_iter must be specified for each test network "
                              f"({num_test_nets} test nets, {len(p.test_iter)} test_iter).")
        num_instances = num_test_nets + (len(p.test_iter) - num_test_nets)
        if len(p.test_state) and len(p.test_state) != num_instances:
            raise SolverError(f"{self.source}: test_state must be unspecified or specified once per test net "
                              f"({num_instances} test nets, {len(p.test_state)} test_state).")
        if num_instances and p.test_interval <= 0:
            raise SolverError(f"{self.source}: test_interval must be > 0 when test nets are given "
                              f"(test_interval: {p.test_interval})")
        sources: list[str] = []
        params: list[caffe_pb2.NetParameter] = []
        for tp in p.test_net_param:
            sources.append("test_net_param")
            q = caffe_pb2.NetParameter()
            q.CopyFrom(tp)
            params.append(q)
        for path in p.test_net:
            sources.append(f"test_net file: {path}")
            params.append(self._read_net_file(path))
        remaining = len(p.test_iter) - len(params)
        for _ in range(remaining):
            if has_net_param:
                sources.append("net_param")
                q = caffe_pb2.NetParameter()
                q.CopyFrom(p.net_param)
                params.append(q)
            elif has_net_file:
                sources.append(f"net file: {p.net}")
                params.append(self._read_net_file(p.net))
        nets = []
        if not self.is_root:
            return nets  # only the root rank of a distributed run tests
        for i, (src, q) in enumerate(zip(sources, params)):
            state = caffe_pb2.NetState()
            state.phase = caffe_pb2.TEST
            state.MergeFrom(q.state)
            if len(p.test_state):
                state.MergeFrom(p.test_state[i])
            q.state.CopyFrom(state)
            log.info("Creating test net (#%d) specified by %s", i, src)
            net = Net(q, config=self.config, random=self.random_source)
            net.debug_info = p.debug_info
            self._load_weights(net)
            net.share_weights_with(self.net)
            nets.append(net)
        return nets



    # -- public API ----------------------------------------------------------------------------
    def add_callback(self, on_start: Callback | None = None, on_gradients_ready: Callback | None = None) -> None:
        """Call ``on_start()`` before each iteration's forward passes and ``on_gradients_ready()``
        before its update (pycaffe's ``solver.add_callback``)."""
        self._callbacks.append((on_start, on_gradients_ready))

    def set_action_function(self, fn: Callable[[], str] | None) -> None:
        """A function returning 'none' / 'stop' / 'snapshot', polled between iterations (signals)."""
        self._action_function = fn

    def get_requested_action(self) -> str:
        """The action requested by the action function (Caffe's GetRequestedAction); in a distributed
        run the strongest any rank requested (a collective: every rank calls it once per iteration)."""
        local = self._action_function() if self._action_function is not None else signals.NONE
        return local if self.parallel is None else self.parallel.combine_action(local)

    @property
    def learnable_params(self):
        """The train net's learnable parameter blobs (the order of ``history``)."""
        return self.net.learnable_params

    def solve(self, resume_file: str | os.PathLike | None = None) -> None:
        """Train up to ``max_iter`` (Caffe's Solver::Solve), optionally resuming from a solverstate."""
        log.info("Solving %s", self.net.name)
        log.info("Learning Rate Policy: %s", self.param.lr_policy)
        self.requested_early_exit = False
        if resume_file is not None:
            log.info("Restoring previous solver status from %s", os.fspath(resume_file))
            self.restore(resume_file)
        try:
            self._solve()
        finally:
            if self.tensorboard is not None:
                self.tensorboard.close()  # every event on disk, also when training stops on an error

    def _solve(self) -> None:
        start_iter = self.iter
        self.step(self.param.max_iter - self.iter)
        p = self.param
        if p.snapshot_after_train and (not p.snapshot or self.iter % p.snapshot != 0):
            with self._phase("snapshot"):
                self.snapshot()
        if self.requested_early_exit:
            log.info("Optimization stopped early.")
            return
        if p.display and self.iter % p.display == 0:
            loss = np.float32(self.net.forward())
            if self.parallel is not None:
                loss = np.float32(self.parallel.comm.allreduce_scalar(float(loss)) / self.parallel.size)
            self._update_smoothed_loss(loss, start_iter, p.average_loss)
            log.info("Iteration %d, loss = %s", self.iter, _fmt(self.smoothed_loss))
            if self.tensorboard is not None:
                self.tensorboard.train_display(self.iter, self.smoothed_loss, [])
        if p.test_interval and self.iter % p.test_interval == 0:
            with self._phase("test"):
                self.test_all()
        log.info("Optimization Done.")
        if self.phase_timer is not None:
            self.phase_timer.log_summary()

    def validate_update_params(self) -> None:
        """Check the lr policy and regularization settings (Caffe finds them bad only at the first
        update; cct checks before the first iteration so that a run fails before any work)."""
        p = self.param
        if p.regularization_type not in ("L2", "L1"):
            raise SolverError(f"{self.source}: Unknown regularization type: \"{p.regularization_type}\" "
                              "(use L2 or L1)")
        try:
            lr_policy.validate(p)
        except SolverError as e:
            raise SolverError(f"{self.source}: {str(e).removeprefix('solver: ')}") from None

    def step(self, iters: int) -> None:
        """Run ``iters`` training iterations (Caffe's Solver::Step).

        Each iteration's compute (:meth:`_run_iteration`) leaves its loss and its checks' failures on
        the device; :meth:`_settle` reads them at the boundaries (a display iteration, before a test,
        before a snapshot, the end of the step) and, on a numpy net, after every iteration.
        """
        p = self.param
        if iters > 0:
            self.validate_update_params()
        start_iter = self.iter
        stop_iter = self.iter + int(iters)
        self._losses = []
        self.smoothed_loss = 0.0
        self._start_loss_log(int(iters))
        self._display_clock = (time.perf_counter(), self.iter)
        settle_every_iteration = not self.net.checks.deferred
        phases = self.phase_timer
        while self.iter < stop_iter:
            if phases is not None:
                phases.start_iteration()
            self.net.clear_param_diffs()
            if p.test_interval and self.iter % p.test_interval == 0 and (self.iter > 0 or p.test_initialization):
                self._settle(start_iter)
                with self._phase("test"):
                    self.test_all()
                if self.requested_early_exit:
                    break
            for on_start, _ in self._callbacks:
                if on_start is not None:
                    on_start()
            display = bool(p.display) and self.iter % p.display == 0
            self.net.debug_info = display and p.debug_info
            if self._loss_log.full:
                self._settle(start_iter)  # more iterations between two boundaries than the log holds
            self._run_iteration()
            if display or settle_every_iteration:
                self._settle(start_iter, display=display)
            for _, on_grad in self._callbacks:
                if on_grad is not None:
                    on_grad()
            if self.tensorboard is not None and self.tensorboard.wants_histograms(self.iter):
                self.tensorboard.histograms(self.iter, self.net.layers)  # gradients final, before the update
            with self._phase("update"):
                self.apply_update()
            self.iter += 1
            request = self.get_requested_action()
            if (p.snapshot and self.iter % p.snapshot == 0) or request == signals.SNAPSHOT:
                self._settle(start_iter)
                with self._phase("snapshot"):
                    self.snapshot()
            if phases is not None:
                phases.end_iteration()
            if request == signals.STOP:
                self.requested_early_exit = True
                break
        self._settle(start_iter)

    def _start_loss_log(self, iters: int) -> None:
        """A loss log that holds every loss between two boundaries of this step (a numpy net settles
        after every iteration: one slot); the iteration counter of the net's checks set to ``iter``."""
        p = self.param
        capacity = 1
        if self.net.checks.deferred:
            intervals = [n for n in (p.display, p.test_interval if self.test_nets else 0, p.snapshot) if n > 0]
            capacity = min([max(iters, 1), _LOSS_LOG_LIMIT, *intervals])
        if self._loss_log.capacity != capacity or self._loss_log.xp is not self.net.xp:
            self._loss_log = LossLog(self.net.xp, capacity)
        self._loss_log.take()  # nothing pending from an earlier step
        self.net.checks.set_iteration(self.iter)

    def _run_iteration(self) -> None:
        """One iteration's compute: ``iter_size`` forward/backward passes accumulate the gradient, their
        mean loss goes to the loss log without a read of device memory (distributed: the global mean,
        read on the host for MPI's all-reduce), the checks' iteration counter advances."""
        p = self.param
        self._graphed_iteration = self.step_graphs is not None and self.step_graphs.usable()
        if self._graphed_iteration:
            try:
                self.step_graphs.run_passes()
            except LayerError as e:
                raise e.in_context(f"train net, iteration {self.iter}") from e
            return
        loss = self._zero_loss  # float32 sums from zero, as Caffe's
        try:
            for k in range(p.iter_size):
                if self.parallel is not None and k == p.iter_size - 1:
                    self.parallel.arm()  # reduce this pass's (accumulated) gradients while backward runs
                loss = loss + self._forward_backward().astype(np.float32)
        except LayerError as e:
            raise e.in_context(f"train net, iteration {self.iter}") from e
        loss = loss / np.float32(p.iter_size)
        if self.parallel is not None:  # gradients summed over ranks / N; the global mean loss
            self._mean_loss.fill(self.parallel.finish(np.float32(float(loss))))
            loss = self._mean_loss
        self._loss_log.append(self.iter, loss)
        self.net.checks.advance()

    def _settle(self, start_iter: int, display: bool = False) -> None:
        """Boundary bookkeeping: raise the first failed check of the train net, replay the pending losses
        in order (the smoothed loss; a non-finite loss stops training), log the display."""
        self.net.raise_deferred_errors("train net, iteration {iteration}")
        if self.defer_host_reads:
            self.flush_update_log()
        for iteration, loss in self._loss_log.take():
            self._update_smoothed_loss(loss, start_iter, self.param.average_loss, iteration)
            if not math.isfinite(float(loss)):
                if display and iteration == self.iter:
                    self._display()
                self._stop_on_bad_loss(float(loss), iteration)
        if display:
            self._display()

    def _display(self) -> None:
        """The display line (speed since the last one, smoothed loss), the train net's outputs, TensorBoard."""
        p = self.param
        since, iterations_last = self._display_clock
        lapse = time.perf_counter() - since
        per_s = (self.iter - iterations_last) / (lapse if lapse else 1.0)
        log.info("Iteration %d (%s iter/s, %ss/%d iters), loss = %s", self.iter, _fmt(per_s), _fmt(lapse),
                 p.display, _fmt(self.smoothed_loss))
        self._display_clock = (time.perf_counter(), self.iter)
        outputs = self._log_outputs(self.net, "Train")
        if self.tensorboard is not None:
            self.tensorboard.train_display(self.iter, self.smoothed_loss, outputs)

    def _phase(self, name: str):
        """Book the block to phase ``name`` of the phase timer (a no-op context without one)."""
        return self.phase_timer.phase(name) if self.phase_timer is not None else contextlib.nullcontext()

    def _forward_backward(self):
        """One forward + backward of the train net, its loss a device scalar; with a phase timer, timed as
        data/forward/backward."""
        phases = self.phase_timer
        if phases is None:
            return self.net.forward_backward(device_loss=True)
        clock = phases.clock
        data_before = data_seconds(self.net.layers)
        t0 = clock()
        loss = self.net.forward(device_loss=True)
        t1 = clock()
        phases.split_forward(t1 - t0, data_seconds(self.net.layers) - data_before)
        self.net.backward()
        phases.add("backward", clock() - t1)
        return loss

    def _update_smoothed_loss(self, loss, start_iter: int, average_loss: int, iteration: int | None = None) -> None:
        """Caffe's UpdateSmoothedLoss with the loss of ``iteration`` (default: the current one)."""
        loss = np.float32(loss)
        if len(self._losses) < average_loss:
            self._losses.append(loss)
            size = len(self._losses)
            self.smoothed_loss = float((np.float32(self.smoothed_loss) * np.float32(size - 1) + loss)
                                       / np.float32(size))
        else:
            idx = ((self.iter if iteration is None else iteration) - start_iter) % average_loss
            self.smoothed_loss = float(np.float32(self.smoothed_loss)
                                       + (loss - self._losses[idx]) / np.float32(average_loss))
            self._losses[idx] = loss

    def _stop_on_bad_loss(self, loss: float, iteration: int | None = None) -> None:
        """Stop training on the non-finite loss of ``iteration`` (default: the current one), found now.

        A device net's losses are read at boundaries: an earlier iteration's loss is named as such, and
        the snapshot holds the weights of now (before iteration ``iter``), not those before ``iteration``."""
        p = self.param
        iteration = self.iter if iteration is None else iteration
        what = "NaN" if math.isnan(loss) else "infinite"
        found = "" if iteration == self.iter else (
            f" (found at iteration {self.iter}: a device net's losses are read at display, test and snapshot "
            "boundaries)")
        before = "this iteration" if iteration == self.iter else f"iteration {self.iter}"
        log.error("Iteration %d, loss = %s: the loss is %s%s; stopping training.", iteration, _fmt(loss), what,
                  found)
        wrote = ""
        if (p.snapshot or p.snapshot_after_train) and p.snapshot_prefix and self._last_snapshot_iter != self.iter:
            model = self.snapshot()
            wrote = f"; the weights before {before} were saved to {model}"
        elif self._last_snapshot_iter == self.iter:
            wrote = f"; the last snapshot holds the weights before {before}"
        raise SolverError(f"Iteration {iteration}: loss is {_fmt(loss)} ({what}); training stopped{found}{wrote}. "
                          "Lower base_lr, add clip_gradients, or check the input data.")

    def __repr__(self) -> str:
        return f"<cct {self.type}Solver iter={self.iter} net='{self.net.name}'>"


def _resolve_comm(comm):
    """The communicator a solver runs on: the one given, else every rank of the job under mpiexec,
    else None (a single process; mpi4py is not imported)."""
    if comm is not None:
        return comm

    if not under_mpi():
        return None

    return world()
