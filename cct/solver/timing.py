"""Where a training loop's time goes: wall-clock per solver phase, per iteration and in total.

A :class:`PhaseTimer` is handed to the solver (``get_solver(..., phase_times=True)`` or
``cct train --phase_times``). The solver brackets each part of an iteration with
:meth:`PhaseTimer.phase` and the timer books the elapsed wall-clock time to it:

* ``data``: the data layers' forward (waiting for the prefetch thread and copying the batch in);
* ``forward``: the rest of the forward pass; ``backward``: the backward pass;
* ``update``: gradient normalisation, regularisation, the update rule and ``Net.update``;
* ``test``: the test passes; ``snapshot``: writing snapshots;
* ``other``: the rest of the loop (clearing diffs, loss bookkeeping, display, callbacks).

Data time is measured by the data layers themselves (``forward_seconds``), because the net runs them
inside its forward pass; the forward phase is the net's forward minus that. ``summary()`` gives totals,
per-iteration means and medians, and shares; :meth:`log_summary` writes it at the end of training.
"""
from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections.abc import Iterable, Iterator
from typing import Any

log = logging.getLogger("cct")

PHASES = ("data", "forward", "backward", "update", "test", "snapshot", "other")


def data_seconds(layers: Iterable[Any]) -> float:
    """Total ``forward_seconds`` of the layers that keep one (the prefetching data layers)."""
    return float(sum(getattr(layer, "forward_seconds", 0.0) for layer in layers))


class PhaseTimer:
    """Books wall-clock seconds to the phases of :data:`PHASES`, iteration by iteration.

    ``clock`` (default ``time.perf_counter``) can be replaced for tests. The loop calls
    :meth:`start_iteration` and :meth:`end_iteration` around each iteration and
    :meth:`phase` around its parts; time between phases inside an iteration counts as ``other``.
    """

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.totals: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.per_iteration: list[dict[str, float]] = []
        self._current: dict[str, float] | None = None
        self._iter_start = 0.0
        self._started: float | None = None
        self._stopped: float | None = None

    # -- recording --------------------------------------------------------------------------------
    def start_iteration(self) -> None:
        """Begin one training iteration."""
        now = self.clock()
        if self._started is None:
            self._started = now
        self._current = dict.fromkeys(PHASES, 0.0)
        self._iter_start = now

    def add(self, name: str, seconds: float) -> None:
        """Book ``seconds`` to phase ``name`` (in the current iteration, if one is open)."""
        if name not in self.totals:
            raise KeyError(f"unknown phase '{name}' (phases: {', '.join(PHASES)})")
        self.totals[name] += seconds
        if self._current is not None:
            self._current[name] += seconds

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Book the block's wall-clock time to phase ``name``."""
        t = self.clock()
        try:
            yield
        finally:
            self.add(name, self.clock() - t)

    def split_forward(self, forward_seconds: float, data_seconds: float) -> None:
        """Book a forward pass that took ``forward_seconds`` of which the data layers took ``data_seconds``."""
        data_seconds = min(max(0.0, data_seconds), forward_seconds)
        self.add("data", data_seconds)
        self.add("forward", forward_seconds - data_seconds)

    def end_iteration(self) -> None:
        """Close the iteration: the part of it no phase claimed is ``other``."""
        if self._current is None:
            return
        now = self.clock()
        claimed = sum(self._current.values())
        self.add("other", max(0.0, (now - self._iter_start) - claimed))
        self.per_iteration.append(self._current)
        self._current = None
        self._stopped = now

    # -- reporting --------------------------------------------------------------------------------
    @property
    def iterations(self) -> int:
        """Number of completed iterations."""
        return len(self.per_iteration)

    def summary(self) -> dict[str, Any]:
        """Totals, per-iteration mean/median (ms) and share of each phase, plus the loop's wall time."""
        n = self.iterations
        total = sum(self.totals.values())
        wall = (self._stopped - self._started) if (self._started is not None and self._stopped is not None) else 0.0
        phases = {}
        for name in PHASES:
            values = [it[name] for it in self.per_iteration]
            phases[name] = {
                "total_s": self.totals[name],
                "mean_ms": (self.totals[name] / n * 1e3) if n else 0.0,
                "median_ms": (statistics.median(values) * 1e3) if values else 0.0,
                "share": (self.totals[name] / total) if total else 0.0,
            }
        return {"iterations": n, "total_s": total, "wall_s": wall,
                "iter_per_s": (n / wall) if wall else 0.0, "phases": phases}

    def table(self) -> list[str]:
        """The summary as text lines (one per phase)."""
        s = self.summary()
        lines = [f"Phase times over {s['iterations']} iterations ({s['total_s']:.3f} s; "
                 f"{s['iter_per_s']:.4g} iter/s):"]
        for name, p in s["phases"].items():
            lines.append(f"  {name:>9s}: {p['total_s']:9.3f} s  {p['mean_ms']:9.3f} ms/iter "
                         f"(median {p['median_ms']:.3f})  {100 * p['share']:5.1f}%")
        return lines

    def log_summary(self) -> None:
        """Write :meth:`table` to the cct log."""
        for line in self.table():
            log.info("%s", line)
