"""A solver's training iterations replayed as CUDA graphs (issue 30): what the solver hands to
:class:`cct.device.graph.StepGraphs` and when.

An iteration on a GPU-resident net is, per forward/backward pass, the data layers (eager: they copy the next
batch from the host into their tops, whose device buffers stay put) and one captured piece -- the rest of the
forward pass, the backward pass, and the pass's share of the iteration's loss (on the last pass also the loss
log entry and the checks' iteration counter) -- then, after the host half of the update (the rate and the other
scalars written into the fused update's small device arrays), the captured update. ``iter_size`` passes use up
to three pieces (first, middle, last pass). Nothing in between reads device memory; the solver reads the loss
log, the deferred checks and the clipping report at its boundaries.

An iteration runs eagerly instead when the solver logs ``debug_info`` (it reads every blob between layers);
a new shape or a replaced array of the data tops or the parameters drops the graphs, which are captured again.
"""
from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from ..device.driver import array_address, device_of
from ..device.graph import DirectPieces, StepGraphs, capture_blockers, first_compute_layer, graph_nodes

if TYPE_CHECKING:
    from .solver import Solver

log = logging.getLogger("cct")


def why_not_graphs(solver: Solver) -> str | None:
    """None when ``solver``'s iterations can replay as CUDA graphs, else the reason (for the log)."""
    net = solver.net
    if not net.learnable_params or not device_of(net.learnable_params[0].data).is_gpu:
        return "the net is not resident on a GPU"
    if not solver.config.gpu.graphs:
        return "turned off (--nograph)"
    if solver.parallel is not None:
        return "a distributed run (its gradients are all-reduced through the host)"
    if net.executor is not None:
        return "the batch is split over several devices"
    if solver.phase_timer is not None:
        return "phase times are measured (they time each phase on the host)"
    fu = solver.flat_update
    if fu is None or not fu.on_device:
        return "the update is not one fused pass over flat parameter buffers"
    reason = StepGraphs.available()
    if reason:
        return reason
    blockers = capture_blockers(net.layers)
    if blockers:
        return "layers that cannot be captured: " + "; ".join(blockers)
    return None


class GraphedIterations:
    """Runs a solver's iterations through CUDA graphs (see module docstring). ``pieces``: the runner of the
    pieces (default :class:`StepGraphs`; :class:`DirectPieces` runs them as called, on any array module)."""

    def __init__(self, solver: Solver, pieces: StepGraphs | DirectPieces | None = None):
        self.solver = solver
        self.graphs = pieces if pieces is not None else StepGraphs("train net")
        self.first = first_compute_layer(solver.net.layers)
        #: the iteration's loss, written by the captured passes (one device scalar at a fixed address)
        self.loss = solver.net.xp.zeros((), dtype=np.float32)
        self._signature: tuple | None = None

    # -- what the tests and benchmarks read --------------------------------------------------------------
    @property
    def captured(self) -> dict[str, Any]:
        """The captured pieces by name."""
        return self.graphs.graphs

    @property
    def eager(self) -> dict[str, str]:
        """Pieces whose capture failed (they run eagerly), with the reason."""
        return self.graphs.eager

    def nodes(self) -> int:
        """Kernel and copy nodes of one iteration's graphs (each piece counted once)."""
        return sum(max(graph_nodes(g), 0) for g in self.graphs.graphs.values())

    # -- per iteration ---------------------------------------------------------------------------------
    def usable(self) -> bool:
        """Whether this iteration replays graphs; drops them when the buffers they recorded changed."""
        net = self.solver.net
        if net.debug_info or not net.flat_params.intact():
            return False
        # the data tops' buffers, and the loss log a pass writes into (a new step() may size a new one)
        signature = (tuple((array_address(t.data), t.data.shape) for i in range(self.first) for t in net.top_vecs[i]),
                     id(self.solver._loss_log))
        if signature != self._signature:
            if self._signature is not None:
                log.info("the train net's input buffers or loss log changed: its CUDA graphs are captured again")
                self.graphs.forget()
            self._signature = signature
        return True

    def run_passes(self) -> None:
        """The iteration's ``iter_size`` forward/backward passes (data layers eager, the rest captured)."""
        solver = self.solver
        net = solver.net
        n = solver.param.iter_size
        for k in range(n):
            if self.first > 0:
                net.forward_from_to(0, self.first - 1, device_loss=True)
            name = "pass" if n == 1 else ("first pass" if k == 0 else "last pass" if k == n - 1 else "middle pass")
            self.graphs.run(name, functools.partial(self._pass, k == 0, k == n - 1))
        solver._loss_log.note(solver.iter)

    def _pass(self, first: bool, last: bool) -> None:
        """One captured pass: forward after the data layers, backward, the pass's loss into the iteration's."""
        solver = self.solver
        net = solver.net
        pass_loss = net.forward_from_to(self.first, len(net.layers) - 1, device_loss=True)
        net.backward()
        loss = self.loss
        if pass_loss is None:
            if first:
                loss.fill(0)
        elif first:
            loss[...] = pass_loss  # float64 -> float32, as the eager path's astype
        else:
            loss += pass_loss.astype(np.float32)
        if last:
            loss /= np.float32(solver.param.iter_size)
            solver._loss_log.record(loss)
            net.checks.advance()

    def run_update(self) -> None:
        """The device half of the update, captured (the host half, :meth:`Solver.prepare_update`, ran before)."""
        self.graphs.run("update", self.solver.device_update)
