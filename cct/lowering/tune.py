"""Measured refinement of the optimizer's close calls (``cct train``/``cct time``; ``EngineConfig.tune``).

The cost model prices every strategy from calibrated rates; where alternatives come out within
:data:`MARGIN` of its plan for a layer, their difference is within the model's error on small and
odd-shaped layers (thin channels, 1x1, large kernels). :func:`refine` then runs the plan and its close
alternatives (:func:`layer_candidates`) on the layer itself -- its geometry and batch, random data,
whole iterations of the passes it runs, in the partitions and chunks the cost model gives each, as
:class:`~cct.lowering.partition.BatchedLowering` executes them -- round-robin, best of a few rounds,
and keeps the fastest: cuDNN's "find" for the cases a model cannot settle.

A layer's measurements are bounded by :data:`LAYER_SECONDS` (predicted; a layer whose candidates
would take longer keeps the model's plan: the model is accurate on large layers), and the outcome is
cached per machine, thread count and calibration (``tuned-<key>-t<threads>.json`` in the cct cache
dir), so a net measures once per machine.

A layer whose blobs live in a GPU's memory has no cost model to consult: :func:`pick_on_device` runs
every strategy that supports it there (whole batch, the device synchronized around each call) and
keeps the fastest where it beats type 1 by :data:`MIN_GAIN`; cached per GPU model and CuPy version
(:func:`device_cache`).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import blas
from ..config import current
from .base import get_strategy, strategy_names, supports
from .chunking import partition_candidates
from .cost_model import PASSES, Machine
from .geometry import ConvGeometry
from .partition import BatchedLowering

log = logging.getLogger("cct")

#: candidates predicted within this fraction of the cheapest are measured
MARGIN = 0.3
#: at most this many candidates per layer, the model's plan included (the cheapest predicted first)
MAX_CANDIDATES = 3
#: the predicted seconds one layer's measurements may take (every call of every candidate)
LAYER_SECONDS = 3.0
#: timed calls per candidate (each after an untimed one): as many as :data:`LAYER_SECONDS` allows, at
#: least one, at most this many. (A first version gave the rounds 0.5 s: a 40-80 ms pass got one, whose
#: timings on a shared 2-core machine scatter by 15-60%, and picked a candidate 29% slower than the model's.)
MAX_REPEATS = 7
#: a measured pick replaces the model's only when it is this much faster: the timings of a busy
#: machine scatter by 5-10%, and within that the model's pick is as good a bet
MIN_GAIN = 0.05
#: bumped when the measurement changes so that cached outcomes are measured again
TUNE_VERSION = 3


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


def rounds_for(calls: float) -> int:
    """Rounds of :func:`measure` that fit :data:`LAYER_SECONDS` when one round's timed calls take
    ``calls`` seconds (each after an untimed one): at least one, at most :data:`MAX_REPEATS`."""
    return max(1, min(MAX_REPEATS, int(LAYER_SECONDS / (2 * calls))))


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
        self._load(_cache_name(machine), _stamp(machine), persist and not getattr(machine, "nominal", False))

    @classmethod
    def named(cls, name: str, stamp: str, persist: bool = True) -> TuneCache:
        """The cache file ``name`` of outcomes measured under ``stamp`` (not a CPU calibration's)."""
        cache = cls.__new__(cls)
        cache._load(name, stamp, persist)
        return cache

    def _load(self, name: str, stamp: str, persist: bool) -> None:
        self.persist, self.name, self.stamp = persist, name, stamp
        data = blas.read_cache(self.name) if self.persist else None
        self.entries: dict[str, dict] = data["entries"] if data and data.get("stamp") == self.stamp else {}

    def get(self, key: str) -> dict | None:
        return self.entries.get(key)

    def put(self, key: str, entry: dict) -> None:
        self.entries[key] = entry
        if self.persist:
            data = blas.read_cache(self.name)  # another process may have added entries since
            if data and data.get("stamp") == self.stamp:
                self.entries = {**data["entries"], **self.entries}
            try:
                blas.write_cache(self.name, {"stamp": self.stamp, "entries": self.entries})
            except OSError as e:  # a read-only cache dir: the outcome is kept for this process only
                log.warning("could not save the measured lowering picks: %s", e)




def cache_for(machine: Machine) -> TuneCache:
    """The :class:`TuneCache` of ``machine``'s calibration, kept in the current configuration's caches."""
    k = (machine.key, machine.threads, _stamp(machine))
    caches = current().caches.tunings  # (machine key or gpu-<model>, threads, stamp) -> TuneCache
    if k not in caches:
        caches[k] = TuneCache(machine)
    return caches[k]


def device_cache(xp: Any) -> TuneCache:
    """The :class:`TuneCache` of the current device of array module ``xp`` (a GPU: ``tuned-gpu-<model>.json``,
    invalidated by another CuPy version), kept in the current configuration's caches."""
    name, version = device_name(xp), getattr(xp, "__version__", "")
    slug = "".join(ch if ch.isalnum() else "-" for ch in name).strip("-").lower() or "device"
    k = (f"gpu-{slug}", 0, version)
    caches = current().caches.tunings
    if k not in caches:
        caches[k] = TuneCache.named(f"tuned-gpu-{slug}.json", f"{xp.__name__} {version}|{TUNE_VERSION}")
    return caches[k]


def device_name(xp: Any) -> str:
    """The model name of ``xp``'s current device (a CuPy GPU), else the array module's name."""
    cuda = getattr(xp, "cuda", None)
    if cuda is None:
        return xp.__name__
    name = cuda.runtime.getDeviceProperties(cuda.Device().id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def _synchronize(xp: Any) -> Callable[[], None]:
    cuda = getattr(xp, "cuda", None)
    return cuda.get_current_stream().synchronize if cuda is not None else (lambda: None)


def pick_on_device(geom: ConvGeometry, batch: int, passes: tuple[str, ...], xp: Any,
                   names: list[str] | None = None, cache: TuneCache | None = None,
                   default: str = "type1") -> tuple[str, dict[str, float]]:
    """``(pick, {name: seconds})`` for a conv layer whose blobs live in ``xp``'s memory (a GPU): every
    strategy of ``names`` (default: every registered one) that supports ``geom`` runs whole iterations
    of ``passes`` (:func:`run_layer`) on the whole batch of random data there, round-robin; the fastest
    is the pick where it beats ``default`` by more than :data:`MIN_GAIN`. A candidate that runs out of
    device memory is dropped; one more than 3x slower than the fastest on its first timed call is not
    timed again. The rounds are bounded by :data:`LAYER_SECONDS`."""
    pool = [n for n in (names if names is not None else strategy_names()) if supports(get_strategy(n), geom)]
    if default not in pool or batch < 1 or len(pool) < 2:
        return default, {}
    key = _key(geom, batch, "device:" + "+".join(passes), pool)
    hit = cache.get(key) if cache is not None else None
    if hit is None:
        x, w, b, dy = (xp.asarray(a) for a in layer_inputs(geom, batch))
        out, dw, dx = xp.empty_like(dy), xp.zeros_like(w), xp.empty_like(x)
        sync = _synchronize(xp)

        def runner(name: str) -> Callable[[], None]:
            lowering = BatchedLowering(get_strategy(name), batch_partition=batch, partitions=1)  # as the net runs it

            def run() -> None:
                run_layer(lowering, passes, x, w, b, dy, geom, out, dw, dx)
                sync()
            return run

        runners: dict[str, Callable[[], None]] = {}
        for n in pool:
            run = runner(n)
            try:
                run()  # first call: kernels compiled, FFT plans made, buffers allocated
            except MemoryError as e:  # cupy's OutOfMemoryError is one
                log.info("%s does not fit in device memory for this layer: %s", n, e)
                continue
            runners[n] = run
        if len(runners) < 2:
            return default, {}
        first = measure(runners, 1)
        fastest = min(first.values())
        runners = {n: r for n, r in runners.items() if first[n] <= 3.0 * fastest}
        repeats = rounds_for(sum(first[n] for n in runners))
        seconds = dict(first, **measure(runners, repeats)) if repeats > 1 else first
        best = min(seconds, key=seconds.get)
        pick = best if default not in seconds or seconds[best] < (1.0 - MIN_GAIN) * seconds[default] else default
        hit = {"seconds": seconds, "pick": pick}
        if cache is not None:
            cache.put(key, hit)
    return hit["pick"], dict(hit["seconds"])


def _label(names: dict[str, str], passes: tuple[str, ...]) -> str:
    used = [names[p] for p in passes]
    return used[0] if len(set(used)) == 1 else "per-pass(" + ",".join(used) + ")"


def layer_candidates(plan: Any, fitting: set[str], margin: float = MARGIN,
                     limit: int = MAX_CANDIDATES) -> list[dict[str, str]]:
    """The model's ``{pass: name}`` first, then the alternatives predicted within ``margin`` of its
    total, cheapest first: one strategy for every pass, or the model's plan with one pass swapped to
    one of that pass's :func:`close_candidates` (at most ``limit`` in all; on equal predictions one
    strategy for all passes first)."""
    run, preds = plan.passes, plan.predictions
    model = {p: getattr(plan, p) for p in run}

    def total(names: dict[str, str]) -> float:
        return sum(preds[p][names[p]] for p in run)

    alts = [{p: n for p in run} for n in sorted(fitting) if all(n in preds.get(p, {}) for p in run)]
    for p in run:
        for n in close_candidates({k: t for k, t in preds.get(p, {}).items() if k in fitting}, margin):
            alts.append(dict(model, **{p: n}))
    out = [model]
    for a in sorted(alts, key=lambda a: (total(a), len(set(a.values())), _label(a, run))):  # ties: one strategy
        if a not in out and total(a) <= total(model) * (1.0 + margin):
            out.append(a)
    return out[:limit]


def run_layer(strategy: Any, passes: tuple[str, ...], x: Any, w: Any, b: Any, dy: Any, geom: ConvGeometry,
              out: Any, dw: Any, dx: Any) -> None:
    """One iteration of a layer running ``passes``, as a net calls its lowering: the forward on new
    weights (an update between iterations), then one backward computing the gradients asked (a
    strategy that serves both shares its work between them). Without a forward the weights stay, as
    after a forward of the same iteration (:func:`run_pass`)."""
    if "fwd" in passes:
        w.reshape(-1)[:1] *= -1  # (a view on numpy and cupy alike)
        strategy.forward_into(x, w, b, geom, out)
    if "bwd_data" in passes or "bwd_weights" in passes:
        strategy.backward_into(dy, x, w, geom, dw=dw if "bwd_weights" in passes else None,
                               dx=dx if "bwd_data" in passes else None)


def refine(plan: Any, geom: ConvGeometry, batch: int, chunking: Callable[[dict[str, str]], tuple[int, int]],
           budget: int | str | None = None, cache: TuneCache | None = None) -> Any:
    """``plan`` with its strategies replaced by the measured fastest of :func:`layer_candidates` (whole
    iterations of the layer's passes, :func:`run_layer`) where that is more than :data:`MIN_GAIN`
    faster than the model's plan (twice that when the bound allows fewer than three rounds);
    ``plan.measured`` records ``{label: seconds}``. ``chunking({pass: name}) -> (partitions, b_p)`` is
    how the engine would run a candidate. A layer whose measurements would exceed :data:`LAYER_SECONDS`
    keeps the model's plan; an overridden plan is returned as is."""
    if plan.overridden or batch < 1:
        return plan
    run = plan.passes
    fitting = {n for n, ws in plan.workspace.items() if not plan.budget or ws <= plan.budget} or set(plan.workspace)
    cands = layer_candidates(plan, fitting)
    if len(cands) < 2:
        return plan
    labels = {_label(c, run): c for c in cands}
    key = _key(geom, batch, "+".join(run), list(labels))
    hit = cache.get(key) if cache is not None else None
    if hit is None:
        calls = sum(plan.predictions[p][c[p]] for c in cands for p in run)  # one iteration of each candidate
        repeats = rounds_for(calls)
        if 2 * repeats * calls > LAYER_SECONDS:
            return plan
        x, w, b, dy = layer_inputs(geom, batch)
        out, dw, dx = np.empty_like(dy), np.zeros_like(w), np.empty_like(x)
        lowerings = {}
        for label, c in labels.items():
            parts, bp = chunking(c)
            names = dict(dict.fromkeys(PASSES, c.get("bwd_weights", c[run[0]])), **c)
            strategy = dataclasses.replace(plan, **names).strategy()
            lowerings[label] = BatchedLowering(strategy, batch_partition=bp, partitions=parts, budget=budget)
        try:
            seconds = measure({lb: functools.partial(run_layer, s, run, x, w, b, dy, geom, out, dw, dx)
                               for lb, s in lowerings.items()}, repeats)
        finally:
            for s in lowerings.values():
                s.close()
        model, fastest = _label(cands[0], run), min(seconds, key=seconds.get)
        gain = MIN_GAIN if repeats >= 3 else 2 * MIN_GAIN  # a long layer's one or two rounds: a clear gain only
        hit = {"seconds": seconds, "pick": model if seconds[fastest] > (1.0 - gain) * seconds[model] else fastest}
        if cache is not None:
            cache.put(key, hit)
    plan.measured = dict(hit["seconds"])
    pick = labels[hit["pick"]]
    for p in run:
        setattr(plan, p, pick[p])
    if "bwd_data" not in run:  # not run: follows the weight gradient (one fused backward)
        plan.bwd_data = plan.bwd_weights
    return plan


def measure_partitions(strategy: Callable[[], Any], geom: ConvGeometry, batch: int, passes: tuple[str, ...],
                       threads: int, machine_for: Callable[[int], Machine], budget: int | str | None = None,
                       candidates: tuple[int, ...] | None = None, cache: TuneCache | None = None,
                       repeats: int = 3) -> tuple[int, dict[int, float]]:
    """``(p, {p: seconds})``: the batch-partition count (of ``candidates``, default
    :func:`~cct.lowering.chunking.partition_candidates`) whose whole iterations of ``passes`` on random data run
    fastest, each with the chunk size the cost model gives it (``strategy()`` makes the lowering to wrap);
    the engine's ``partitions="auto"``, measured when the layer is planned, never in its forward. Cached in
    ``cache`` (then the seconds are those measured when it was filled)."""
    pool = tuple(candidates or partition_candidates(threads, batch))
    if batch < 1 or len(pool) < 2:
        return pool[0] if pool else 1, {}
    key = _key(geom, batch, "partitions:" + "+".join(passes), [f"{strategy().name}", f"t{threads}"]
               + [str(p) for p in pool])
    hit = cache.get(key) if cache is not None else None
    if hit is None:
        x, w, b, dy = layer_inputs(geom, batch)
        out, dw, dx = np.empty_like(dy), np.zeros_like(w), np.empty_like(x)
        lowerings = {p: BatchedLowering(strategy(), batch_partition="auto", partitions=p, threads=threads,
                                        budget=budget, machine_for=machine_for) for p in pool}
        try:
            seconds = measure({str(p): functools.partial(run_layer, s, passes, x, w, b, dy, geom, out, dw, dx)
                               for p, s in lowerings.items()}, repeats)
        finally:
            for s in lowerings.values():
                s.close()
        hit = {"seconds": seconds, "pick": min(seconds, key=seconds.get)}
        if cache is not None:
            cache.put(key, hit)
    return int(hit["pick"]), {int(p): t for p, t in hit["seconds"].items()}
