"""``--parallel auto``'s safety net: the executable plans measured on the real ranks before training.

The cost model ranks the candidates (:mod:`.execute`: the fully-connected tail split ``n=a c=N/a`` for every
divisor ``a`` of the N ranks; ``a = N`` is data parallelism, ``a = 1`` OWT; DeePa's optimum among the
configurations cct train runs, layer by layer, and its convolution channel splits and height/width splits alone,
every other layer by sample) from per-layer measurements and calibrated links; on a small net its errors can be
larger than the differences it ranks (LeNet on 2 loopback ranks: OWT predicted cheaper, measured 1.2x slower).
So at setup every rank runs a few training passes (forward, backward, the gradient exchange; no update) of each
candidate on the train net itself, the step time of a pass is the slowest rank's, and data parallelism is kept
unless another candidate is measured faster by more than :data:`MARGIN`. The net's weights, the data layers'
read positions and the random stream are restored afterwards, so training is exactly what it would have been
without the measurement. The times are cached per machine, net definition, rank count and batch
(``deepa-pick-<machine>.json`` in the cct cache dir); the root's cache decides for every rank.
"""
from __future__ import annotations

import hashlib
import logging
import statistics
import time
from collections.abc import Callable, Hashable
from typing import Any

from .. import blas
from ..distributed.parallel import data_layers
from ..io.prototxt import to_text
from ..lowering import tune
from .split import PlanError

log = logging.getLogger("cct")

#: data parallelism is kept unless another candidate's measured step is at least this fraction faster
MARGIN = 0.10
#: timed passes per candidate (after one untimed pass)
PASSES = 5
#: the longest the timed passes of one candidate may take (seconds, predicted from the untimed pass)
CANDIDATE_SECONDS = 3.0
#: bumped when the measurement changes so that cached times are measured again
PICK_VERSION = 2

#: a candidate: makes the split executor it runs the train net with (None: data parallelism)
Candidate = Callable[[], Any]


def pick_measured(seconds: dict[Hashable, float], data: Hashable, margin: float = MARGIN) -> Hashable:
    """The candidate to run given each candidate's measured step ``seconds`` (``data`` is data
    parallelism's key): the fastest candidate if it beats data parallelism by more than ``margin`` (a
    fraction), else data parallelism."""
    if data not in seconds:
        raise ValueError(f"data parallelism ({data!r}) was not measured")
    best = min(seconds, key=lambda a: (seconds[a], a != data))
    return best if seconds[best] < (1.0 - margin) * seconds[data] else data


def pick_cache() -> tune.TuneCache:
    """The cache of measured candidate step times of this machine."""
    return tune.TuneCache.named(f"deepa-pick-{blas.machine_key()}.json", f"deepa-pick|{PICK_VERSION}")


def cache_key(solver, names: list[str], batch: int) -> str:
    """What a cached measurement is valid for: the train net's definition, the rank count, each rank's
    ``batch`` and the candidates' names (not the solver's settings: they do not change a pass)."""
    net_hash = hashlib.sha256(to_text(solver.net.param).encode("utf-8")).hexdigest()[:16]
    return f"{net_hash}|ranks={solver.parallel.size}|batch={batch}|" + ",".join(names)


class _SavedState:
    """The train net's weights (every layer blob), data read positions and the random streams (host and device)."""

    def __init__(self, net):
        self.net = net
        self.blobs = [blob.data.copy() for layer in net.layers for blob in layer.blobs]
        self.reads = {name: layer.get_read_state() for name, layer in data_layers(net)}
        self.host_random = net.random_source.state()
        self.random = net.random.state()

    def restore(self) -> None:
        net = self.net
        arrays = iter(self.blobs)
        for layer in net.layers:
            for blob in layer.blobs:
                blob.data[...] = next(arrays)
        net.clear_param_diffs()
        for name, layer in data_layers(net):
            layer.set_read_state(self.reads[name])
        net.random_source.restore(self.host_random)
        net.random.set_state(self.random)


def _pass(net, par) -> float:
    """One synchronised training pass without the update; the slowest rank's seconds."""
    net.clear_param_diffs()
    par.comm.barrier()
    t = time.perf_counter()
    par.arm()
    loss = net.forward_backward()
    par.finish(loss)
    return par.comm.allreduce_scalar(time.perf_counter() - t, op="max")


def measure_candidates(solver, candidates: dict[str, Candidate], passes: int = PASSES,
                       budget: float = CANDIDATE_SECONDS) -> dict[str, float]:
    """Each candidate's median step seconds, measured collectively on the ranks of ``solver`` (every rank
    calls it with the same candidates, in the same order). The solver's net and data parallelism are left
    as they were."""
    net, par = solver.net, solver.parallel
    if net.executor is not None:
        raise PlanError("measuring the split candidates needs a train net without an executor (--devices)")
    saved = _SavedState(net)
    out: dict[str, float] = {}
    try:
        for name, make in candidates.items():
            ex = make()
            net.executor = ex
            par.keep_local(ex.owned_param_ids() if ex is not None else [], ex is not None and ex.diffs_final_per_layer)
            first = _pass(net, par)  # untimed: buffers, lowering plans
            count = max(1, min(passes, int(budget / max(first, 1e-9))))
            out[name] = statistics.median(_pass(net, par) for _ in range(count))
            net.executor = None
            if ex is not None:
                ex.release()
    finally:
        net.executor = None
        par.keep_local([])
        saved.restore()
    return out


def measured_choice(solver, candidates: dict[str, Candidate], batch: int,
                    cache: tune.TuneCache | None = None) -> str:
    """The candidate every rank runs (its name; ``"data"`` is data parallelism): measured (or the root's
    ``cache``d times, default :func:`pick_cache`) and logged by the root; data parallelism unless another
    is faster by :data:`MARGIN`. ``batch``: each rank's samples (part of the cache key)."""
    par = solver.parallel
    names = list(candidates)
    key = cache_key(solver, names, batch)
    cached = None
    if par.is_root:
        cache = cache if cache is not None else pick_cache()
        entry = cache.get(key)
        cached = {str(a): float(s) for a, s in entry["seconds"].items()} if entry else None
    cached = par.comm.bcast_obj(cached)
    seconds = cached if cached is not None else measure_candidates(solver, candidates)
    if par.is_root and cached is None:
        cache.put(key, {"seconds": seconds})
    choice = str(pick_measured(seconds, "data"))
    if par.is_root:
        times = ", ".join(f"{a} {1e3 * seconds[a]:.3g}" for a in names)
        log.info("--parallel auto: measured step ms (forward, backward, exchanges; slowest rank, median%s): %s; "
                 "running %s (data parallelism unless another is > %d%% faster)",
                 ", cached" if cached is not None else "", times, choice, round(100 * MARGIN))
    return choice
