"""Omnivore's automatic optimizer: Algorithm 1 with the cold start of E.4 and the pruned grid of E.3.

Cold start: synchronous (g = 1), momentum 0.9, learning rates 1e-5 ... 0.1 tried low to high, stopping
when one is worse than the best so far by more than the 5% noise threshold, or diverges; the best is
trained for the cold-start iterations.
Then every epoch: g starts at the smallest number of groups that saturates the FC server (the HE
model; all conv ranks without one); (mu, eta) is grid-searched over {0, .3, .6, .9} x {eta_last,
eta_last/10}, skipping mu > mu_last at eta_last; if the best mu is 0, mu = 0.1 and 0.2 are tried too,
and if 0 still wins g is halved and the search repeats. The chosen (g, mu, eta) trains for the epoch.
Each trial is a short run from the same checkpoint (the runner restores it); diverged trials are
dropped; when the best trials are within 5% of each other the (at most 3) closest run again twice
as long (E.3's "clear winner"). Every decision is one log line, ``Omnivore: epoch 3: g=4 mu=0.6 lr=0.01 (trials: ...)``.

The runner (:class:`TrialRunner`) does the work: on MPI ranks (:mod:`cct.omnivore.mpi_exec`) or any
scripted oracle, so the decisions are unit-testable without timing noise.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .he_model import HEModel

log = logging.getLogger("cct")

LR_GRID = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1)
MU_GRID = (0.0, 0.3, 0.6, 0.9)
MU_EXTRA = (0.1, 0.2)


class TrialRunner(Protocol):
    """Runs training for the optimizer."""

    def trial(self, g: int, mu: float, lr: float, iters: int) -> float:
        """Run ``iters`` iterations from the current checkpoint, return the final (smoothed) loss
        (non-finite when it diverged), and put the model back to the checkpoint."""

    def train(self, g: int, mu: float, lr: float, iters: int) -> float:
        """Train ``iters`` iterations from the current model and checkpoint the result; returns the final
        loss. If the loss becomes non-finite, put the model back as it was before and return NaN."""


@dataclass(frozen=True)
class Trial:
    """One trial of the search."""

    g: int
    mu: float
    lr: float
    loss: float
    iters: int = 0

    @property
    def diverged(self) -> bool:
        return not math.isfinite(self.loss)

    def __str__(self) -> str:
        res = "diverged" if self.diverged else f"{self.loss:.4g}"
        return f"g={self.g} mu={self.mu:g} lr={self.lr:g}: {res}"


@dataclass
class Decision:
    """What the optimizer chose for one epoch (epoch 0 is the cold start)."""

    epoch: int
    g: int
    mu: float
    lr: float
    trials: list[Trial] = field(default_factory=list)
    train_iters: int = 0

    @property
    def search_iters(self) -> int:
        return sum(t.iters for t in self.trials)

    def line(self) -> str:
        what = "cold start" if self.epoch == 0 else f"epoch {self.epoch}"
        share = self.search_iters / max(1, self.search_iters + self.train_iters)
        return (f"Omnivore: {what}: g={self.g} mu={self.mu:g} lr={self.lr:g} "
                f"(trials: {'; '.join(str(t) for t in self.trials)}; search {self.search_iters} of "
                f"{self.search_iters + self.train_iters} iterations, {100 * share:.1f}%)")


class OmnivoreOptimizer:
    """Algorithm 1 over ``runner`` for ``n_conv`` conv ranks.

    ``epoch_iters``: iterations trained per epoch after the search; ``trial_iters``: iterations of one
    trial (default: ``epoch_iters // 120``, at least 2, so a full search of ~10 trials stays under 10%);
    ``cold_start_iters``: the synchronous cold start's training (default one epoch); ``he``: the HE
    model that picks the starting g (none: all conv ranks); ``group_choices``: the g values allowed.
    """

    def __init__(self, runner: TrialRunner, n_conv: int, *, epoch_iters: int, trial_iters: int | None = None,
                 cold_start_iters: int | None = None, he: HEModel | None = None,
                 group_choices: Sequence[int] | None = None, lr_grid: Sequence[float] = LR_GRID,
                 mu_grid: Sequence[float] = MU_GRID, tie: float = 0.05,
                 on_decision: Callable[[Decision], None] | None = None):
        if n_conv < 1:
            raise ValueError(f"need at least one conv rank, not {n_conv}")
        if epoch_iters < 1:
            raise ValueError(f"epoch_iters must be >= 1, not {epoch_iters}")
        self.runner = runner
        self.n_conv = n_conv
        self.epoch_iters = int(epoch_iters)
        self.trial_iters = int(trial_iters) if trial_iters else max(2, self.epoch_iters // 120)
        self.cold_start_iters = self.epoch_iters if cold_start_iters is None else int(cold_start_iters)
        self.he = he
        self.group_choices = sorted(set(group_choices)) if group_choices else None
        self.lr_grid = tuple(sorted(lr_grid))
        self.mu_grid = tuple(mu_grid)
        self.tie = tie
        self.on_decision = on_decision
        self.decisions: list[Decision] = []
        self.mu_last = 0.9
        self.lr_last: float | None = None

    # -- pieces ----------------------------------------------------------------------------------
    def start_groups(self) -> int:
        """The g each epoch's search starts at: the smallest g saturating the FC server (E.3)."""
        if self.he is None:
            return self.n_conv if self.group_choices is None else self.group_choices[-1]
        return self.he.saturating_groups(self.n_conv, self.group_choices)

    def _smaller(self, g: int) -> int:
        """g halved (to the largest allowed choice at most g/2)."""
        half = max(1, g // 2)
        if self.group_choices is None:
            return half
        below = [c for c in self.group_choices if c <= half]
        return below[-1] if below else 1

    def _run(self, g: int, mu: float, lr: float, iters: int) -> Trial:
        loss = float(self.runner.trial(g, mu, lr, iters))
        return Trial(g, mu, lr, loss, iters)

    def _best(self, trials: list[Trial], pool: list[Trial]) -> Trial | None:
        """The lowest-loss finite trial of ``pool``; near ties (within ``tie``) run again twice as long."""
        ok = sorted((t for t in pool if not t.diverged), key=lambda t: t.loss)
        if not ok:
            return None
        close = [t for t in ok if t.loss <= ok[0].loss * (1 + self.tie) + 1e-12][:3]
        if len(close) > 1:
            rerun = [self._run(t.g, t.mu, t.lr, 2 * t.iters) for t in close]
            trials.extend(rerun)
            ok2 = sorted((t for t in rerun if not t.diverged), key=lambda t: t.loss)
            if ok2:
                return ok2[0]
        return ok[0]

    def grid_search(self, g: int, trials: list[Trial]) -> Trial | None:
        """E.3's pruned (mu, eta) grid at g; the mu = 0.1, 0.2 extension when mu* = 0."""
        lr_last = self.lr_last if self.lr_last is not None else self.lr_grid[-1]
        pool = []
        for lr in (lr_last, lr_last / 10):
            for mu in self.mu_grid:
                if lr == lr_last and mu > self.mu_last + 1e-12:
                    continue
                pool.append(self._run(g, mu, lr, self.trial_iters))
        trials.extend(pool)
        best = self._best(trials, pool)
        if best is not None and best.mu == 0.0:
            extra = [self._run(g, mu, best.lr, self.trial_iters) for mu in MU_EXTRA]
            trials.extend(extra)
            pool = [t for t in pool if t.lr == best.lr] + extra
            best = self._best(trials, pool)
        return best

    # -- phases ----------------------------------------------------------------------------------
    def cold_start(self) -> Decision:
        """E.4: synchronous, momentum 0.9, learning rates low to high with early stop; then train."""
        trials: list[Trial] = []
        best: Trial | None = None
        for lr in self.lr_grid:
            t = self._run(1, 0.9, lr, self.trial_iters)
            trials.append(t)
            if t.diverged or (best is not None and t.loss > best.loss * (1 + self.tie)):
                break
            if best is None or t.loss < best.loss:
                best = t
        if best is None:
            raise RuntimeError("Omnivore: every cold-start learning rate diverged "
                               f"(trials: {'; '.join(str(t) for t in trials)})")
        self.mu_last, self.lr_last = 0.9, best.lr
        d = Decision(0, 1, 0.9, best.lr, trials, self.cold_start_iters)
        self._decide(d)
        if self.cold_start_iters:
            self._train(d)
        return d

    def epoch(self, number: int) -> Decision:
        """One epoch of Algorithm 1: search from the saturating g, halve while mu* = 0, train."""
        trials: list[Trial] = []
        g = self.start_groups()
        best = self.grid_search(g, trials)
        while (best is None or best.mu == 0.0) and g > 1:
            g = self._smaller(g)
            best = self.grid_search(g, trials)
        if best is None:  # every trial diverged even synchronously: keep the last setting, a tenth the rate
            best = Trial(1, self.mu_last, (self.lr_last or self.lr_grid[-1]) / 10, math.nan)
        self.mu_last, self.lr_last = best.mu, best.lr
        d = Decision(number, best.g, best.mu, best.lr, trials, self.epoch_iters)
        self._decide(d)
        self._train(d)
        return d

    def _train(self, d: Decision, retries: int = 3) -> None:
        """Train the decision; a run that diverges (the runner restores the model) retries at a tenth the rate."""
        for _ in range(retries + 1):
            loss = self.runner.train(d.g, d.mu, d.lr, d.train_iters)
            if math.isfinite(loss):
                return
            log.warning("Omnivore: %s diverged while training g=%d mu=%g lr=%g; back to the checkpoint, lr=%g",
                        "cold start" if d.epoch == 0 else f"epoch {d.epoch}", d.g, d.mu, d.lr, d.lr / 10)
            d.lr /= 10
            self.lr_last = d.lr
        raise RuntimeError(f"Omnivore: training diverged {retries + 1} times (last lr {d.lr * 10:g})")

    def run(self, total_iters: int) -> list[Decision]:
        """Cold start, then epochs until ``total_iters`` training iterations (trials not counted) are done."""
        done = 0
        if self.lr_last is None:
            done += self.cold_start().train_iters
        number = len(self.decisions)
        while done < total_iters:
            left = total_iters - done
            keep = self.epoch_iters
            self.epoch_iters = min(self.epoch_iters, left)
            try:
                done += self.epoch(number).train_iters
            finally:
                self.epoch_iters = keep
            number += 1
        return self.decisions

    def search_fraction(self) -> float:
        """Trial iterations over all iterations (trials + training) so far."""
        search = sum(d.search_iters for d in self.decisions)
        train = sum(d.train_iters for d in self.decisions)
        return search / max(1, search + train)

    def _decide(self, d: Decision) -> None:
        self.decisions.append(d)
        log.info("%s", d.line())
        if self.on_decision is not None:
            self.on_decision(d)
