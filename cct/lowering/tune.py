"""Measured refinement of the optimizer's close calls (``cct train``/``cct time``; ``EngineConfig.tune``).

The cost model prices every strategy from calibrated rates; where two or more come out within
:data:`MARGIN` of the cheapest for a pass, their difference is within the model's error on small and
odd-shaped layers (thin channels, 1x1, large kernels). :func:`refine` then runs each of those
candidates on the layer itself -- its geometry and batch, random data, in the partitions and chunks
the cost model gives it, as :class:`~cct.lowering.partition.BatchedLowering` executes it -- round-robin,
best of a few calls, and keeps the fastest: cuDNN's "find" for the cases a model cannot settle.

A layer's measurements are bounded by :data:`LAYER_SECONDS` (predicted; passes whose candidates
would take longer keep the model's pick: the model is accurate on large layers), and the outcome is
cached per machine, thread count and calibration (``tuned-<key>-t<threads>.json`` in the cct cache
dir), so a net measures once per machine.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .base import get_strategy
from .cost_model import PASSES, Machine
from .geometry import ConvGeometry

log = logging.getLogger("cct")

#: candidates predicted within this fraction of the cheapest are measured
MARGIN = 0.3
#: at most this many candidates per pass (the cheapest predicted first)
MAX_CANDIDATES = 3
#: the predicted seconds one layer's measurements may take (every call of every candidate)
LAYER_SECONDS = 1.5
#: the predicted seconds one pass's rounds should take: fast passes get up to MAX_REPEATS rounds
PASS_SECONDS = 0.3
#: timed calls per candidate (each after an untimed one), at least one, at most this many
MAX_REPEATS = 7
#: a measured pick replaces the model's only when it is this much faster: the timings of a busy
#: machine scatter by 5-10%, and within that the model's pick is as good a bet
MIN_GAIN = 0.05
#: bumped when the measurement changes so that cached outcomes are measured again
TUNE_VERSION = 1


def run_pass(strategy: Any, pass_: str, x: Any, w: Any, b: Any, dy: Any, geom: ConvGeometry) -> Any:
    """One pass of ``strategy`` on fixed inputs. The forward pass sees new weights on every call, as
    in training (an update between iterations): nothing derived from the weights (FFT's kernel
    transform) carries over from the previous call; the gradients follow a forward pass with the same
    weights, as in an iteration."""
    if pass_ == "fwd":
        w.flat[0] = -w.flat[0]
        return strategy.forward(x, w, b, geom)
    if pass_ == "bwd_data":
        return strategy.backward_data(dy, w, geom)
    if pass_ == "bwd_weights":
        return strategy.backward_weights(dy, x, geom)
    raise ValueError(f"unknown pass {pass_!r}: expected one of {PASSES}")


def close_candidates(predictions: dict[str, float], margin: float = MARGIN,
                     limit: int = MAX_CANDIDATES) -> list[str]:
    """The strategies predicted within ``margin`` of the cheapest, cheapest first (at most ``limit``)."""
    if not predictions:
        return []
    best = min(predictions.values())
    close = sorted((t, n) for n, t in predictions.items() if t <= best * (1.0 + margin))
    return [n for _, n in close[:limit]]


def layer_inputs(geom: ConvGeometry, batch: int, seed: int = 0) -> tuple[Any, Any, Any, Any]:
    """``(x, w, b, dy)``: random float32 data of the layer's shapes (what the passes are timed on)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, geom.channels_in) + tuple(geom.in_shape), dtype=np.float32)
    w = rng.standard_normal(geom.weight_shape, dtype=np.float32) * np.float32(0.01)
    b = np.zeros(geom.channels_out, np.float32)
    dy = rng.standard_normal((batch, geom.channels_out) + tuple(geom.out_shape), dtype=np.float32)
    return x, w, b, dy


def measure(runners: dict[str, Callable[[], Any]], repeats: int = 3) -> dict[str, float]:
    """Best seconds of each runner over ``repeats`` rounds, each starting one runner later (round-robin:
    a load burst from elsewhere hits them alike); each timed call follows an untimed one of the same
    runner, so that it runs on the caches that runner leaves (and after its first-call setup)."""
    names = list(runners)
    best = dict.fromkeys(names, float("inf"))
    for r in range(repeats):
        for n in names[r % len(names):] + names[:r % len(names)]:
            runners[n]()
            t0 = time.perf_counter()
            runners[n]()
            best[n] = min(best[n], time.perf_counter() - t0)
    return best


def _cache_name(machine: Machine) -> str:
    return f"tuned-{machine.key}-t{machine.threads}.json"


def _stamp(machine: Machine) -> str:
    """What the cached outcomes were measured under: the calibration (its versions and time)."""
    info = machine.info or {}
    keys = ("rates_version", "curves_version", "measured_at", "kernels_measured_at")
    return "|".join(str(info.get(k, "")) for k in keys) + f"|{TUNE_VERSION}"


def _key(geom: ConvGeometry, batch: int, pass_: str, names: list[str]) -> str:
    g = dataclasses.astuple(geom)
    return f"{g}|{batch}|{pass_}|{','.join(sorted(names))}"


class TuneCache:
    """The measured picks of one machine calibration, read once and written back atomically."""

    def __init__(self, machine: Machine, persist: bool = True):
        from ..blas import read_cache

        self.machine, self.persist = machine, persist and not getattr(machine, "nominal", False)
        self.name, self.stamp = _cache_name(machine), _stamp(machine)
        data = read_cache(self.name) if self.persist else None
        self.entries: dict[str, dict] = data["entries"] if data and data.get("stamp") == self.stamp else {}

    def get(self, key: str) -> dict | None:
        return self.entries.get(key)

    def put(self, key: str, entry: dict) -> None:
        from ..blas import read_cache, write_cache

        self.entries[key] = entry
        if self.persist:
            data = read_cache(self.name)  # another process may have added entries since
            if data and data.get("stamp") == self.stamp:
                self.entries = {**data["entries"], **self.entries}
            try:
                write_cache(self.name, {"stamp": self.stamp, "entries": self.entries})
            except OSError as e:  # a read-only cache dir: the outcome is kept for this process only
                log.warning("could not save the measured lowering picks: %s", e)


_CACHES: dict[tuple[str, int, str], TuneCache] = {}


def cache_for(machine: Machine) -> TuneCache:
    """The (process-shared) :class:`TuneCache` of ``machine``'s calibration."""
    k = (machine.key, machine.threads, _stamp(machine))
    if k not in _CACHES:
        _CACHES[k] = TuneCache(machine)
    return _CACHES[k]


def refine(plan: Any, geom: ConvGeometry, batch: int, chunking: Callable[[dict[str, str]], tuple[int, int]],
           budget: int | str | None = None, cache: TuneCache | None = None) -> Any:
    """``plan`` with each run pass's strategy replaced by the measured fastest of its close candidates
    (:func:`close_candidates` of ``plan.predictions``, fitting ``plan.budget``) where that is more than
    :data:`MIN_GAIN` faster than the model's pick; ``plan.measured`` records the timings.
    ``chunking({pass: name}) -> (partitions, b_p)`` is how the engine would run a candidate. Passes
    whose measurements would exceed the layer's :data:`LAYER_SECONDS` keep the model's pick; an
    overridden plan is returned as is."""
    from .partition import BatchedLowering

    if plan.overridden or batch < 1:
        return plan
    fitting = {n for n, ws in plan.workspace.items() if not plan.budget or ws <= plan.budget} or set(plan.workspace)
    todo = {}
    for p in plan.passes:
        preds = {n: t for n, t in plan.predictions.get(p, {}).items() if n in fitting}
        names = close_candidates(preds)
        if len(names) > 1:
            todo[p] = names
    if not todo:
        return plan
    spent = 0.0
    data = None
    for p, names in todo.items():
        key = _key(geom, batch, p, names)
        hit = cache.get(key) if cache is not None else None
        if hit is None:
            calls = sum(plan.predictions[p][n] for n in names)  # one call of each candidate
            repeats = max(1, min(MAX_REPEATS, int(PASS_SECONDS / (2 * calls))))
            cost = 2 * repeats * calls
            if spent + cost > LAYER_SECONDS:
                continue
            spent += cost
            if data is None:
                data = layer_inputs(geom, batch)
            lowerings = {}
            for n in names:
                parts, bp = chunking({p: n})
                lowerings[n] = BatchedLowering(get_strategy(n), batch_partition=bp, partitions=parts, budget=budget)
            try:
                seconds = measure({n: functools.partial(run_pass, s, p, *data, geom) for n, s in lowerings.items()},
                                  repeats)
            finally:
                for s in lowerings.values():
                    s.close()
            model, fastest = getattr(plan, p), min(seconds, key=seconds.get)
            keep = seconds[fastest] > (1.0 - MIN_GAIN) * seconds[model]
            hit = {"seconds": seconds, "pick": model if keep else fastest}
            if cache is not None:
                cache.put(key, hit)
        plan.measured[p] = dict(hit["seconds"])
        setattr(plan, p, hit["pick"])
    for p in PASSES:  # passes the layer does not run follow the weight gradient (one fused backward)
        if p not in plan.passes and p == "bwd_data":
            plan.bwd_data = plan.bwd_weights
    return plan
