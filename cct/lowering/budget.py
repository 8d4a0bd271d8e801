"""The memory a convolution's lowering may use: the workspace budget and the largest batch chunk that fits.

The budget of one conv pass's temporary buffers (lowered matrices, spectra, padded copies) is, in order:
a budget given to the planner (bytes or a size string such as ``512M``), ``$CCT_LOWERING_MEMORY``, else a
quarter of the RAM available now (at least 64 MiB) and at most a quarter of the run's memory budget
(:attr:`cct.config.Config.memory_budget`, the bytes its blobs may take) when one is set. Sizes are read by
:func:`cct.membudget.parse_size`, the one size parser.
"""
from __future__ import annotations

import os

from .. import env
from ..errors import MemoryBudgetError
from ..membudget import parse_size
from .base import LoweringStrategy
from .geometry import ConvGeometry

DEFAULT_FRACTION = 0.25
MIN_BUDGET = 64 << 20


def available_memory() -> int:
    """Bytes of RAM available now (MemAvailable, else free pages via os.sysconf)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return 4 << 30


def _size(text: str, what: str) -> int:
    size = parse_size(text, what)
    if size is None:
        raise MemoryBudgetError(f"{what}: a lowering needs some workspace ('{text}' allows none)")
    return size


def memory_budget(budget: int | str | None = None, run_budget: int | None = None) -> int:
    """Bytes the temporary buffers of one conv pass may use (see module docstring); ``run_budget``: the
    run's :attr:`~cct.config.Config.memory_budget`."""
    if budget is not None:
        return _size(budget, "lowering memory budget") if isinstance(budget, str) else int(budget)
    if env.is_set("CCT_LOWERING_MEMORY"):
        return _size(env.text("CCT_LOWERING_MEMORY"), "CCT_LOWERING_MEMORY")
    avail = available_memory()
    if run_budget:
        avail = min(avail, int(run_budget))
    return max(MIN_BUDGET, int(avail * DEFAULT_FRACTION))


def workspace_bytes(strategy: LoweringStrategy, geom: ConvGeometry, batch: int, itemsize: int = 4,
                    passes: tuple[str, ...] | None = None) -> int:
    """Temporary memory of one pass of ``strategy`` on ``batch`` images (0 when it does not declare it:
    a hand-set strategy without a cost model is not held to the budget); ``passes``: of a layer that runs only
    those (:meth:`~cct.lowering.base.LoweringStrategy.pass_workspace_bytes`)."""
    try:
        if passes is not None:
            return int(strategy.pass_workspace_bytes(geom, batch, tuple(passes), itemsize))
        return int(strategy.workspace_bytes(geom, batch, itemsize))
    except NotImplementedError:
        return 0


def max_batch_partition(strategy: LoweringStrategy, geom: ConvGeometry, batch: int, itemsize: int = 4,
                        budget: int | str | None = None, passes: tuple[str, ...] | None = None) -> int:
    """Largest ``b_p`` in ``[1, batch]`` whose workspace (of a layer running ``passes``, default all) fits the
    budget (1 if none does)."""
    cap = memory_budget(budget)
    if batch <= 1 or workspace_bytes(strategy, geom, batch, itemsize, passes) <= cap:
        return max(1, batch)
    lo, hi = 1, batch  # invariant: answer in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if workspace_bytes(strategy, geom, mid, itemsize, passes) <= cap:
            lo = mid
        else:
            hi = mid - 1
    return lo


__all__ = ["available_memory", "max_batch_partition", "memory_budget", "workspace_bytes"]
