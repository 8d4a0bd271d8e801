"""How a conv layer's batch is cut: parallel partitions and the images each lowering + GEMM covers.

CcT section 2.2 and Omnivore section 3.2: ``p`` partitions run concurrently (``threads // p`` BLAS threads
each), each in chunks of ``b_p`` images. :func:`choose_chunking` is the one place both are decided from
the cost model; :class:`~cct.lowering.partition.BatchedLowering` executes the result.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

from .base import LoweringStrategy, get_strategy
from .budget import max_batch_partition, memory_budget
from .cost_model import Machine, best_batch_partition, detect_cache_bytes, price
from .geometry import ConvGeometry


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous near-equal ``[start, stop)`` ranges covering ``range(n)`` (no empties)."""
    parts = max(1, min(parts, n)) if n else 1
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def chunks(start: int, stop: int, size: int) -> list[tuple[int, int]]:
    """``[start, stop)`` in pieces of at most ``size``."""
    size = max(1, size)
    return [(s, min(s + size, stop)) for s in range(start, stop, size)]


def reduction_ops(strategy: LoweringStrategy, geom: ConvGeometry, partitions: int) -> list[tuple]:
    """The sweeps :meth:`BatchedLowering.backward_into` adds to a weight-gradient pass over its chunks,
    once per call: each partition's private gradient zeroed and summed into ``dw`` -- for a strategy
    that accumulates the transposed gradient (``transposed_weight_grad``) one transposing add at the
    end, even with one partition."""
    w = math.prod(geom.weight_shape)
    if getattr(strategy, "transposed_weight_grad", False) and getattr(strategy, "backward_into", None):
        return [("zero", partitions * w), ("add", (partitions - 1) * w), ("add", w)]
    return [("zero", partitions * w), ("add", partitions * w)] if partitions > 1 else []


def partition_candidates(threads: int, batch: int) -> tuple[int, ...]:
    """The partition counts worth pricing or measuring for ``threads`` BLAS threads and ``batch`` images."""
    return tuple(sorted({p for p in (1, 2, 4, 8, 16, threads) if 1 <= p <= max(1, min(threads, batch))}))


def choose_chunking(names: Mapping[str, str], geom: ConvGeometry, batch: int, threads: int,
                    budget: int | str | None, partitions: int | None,
                    machine_for: Callable[[int], Machine]) -> tuple[int, int, float]:
    """``(partitions, b_p, predicted seconds)`` for running the passes ``names`` on ``batch`` images:
    each candidate partition count ``p`` (or the given one) priced with the constants ``machine_for``
    gives for ``threads // p`` BLAS threads (counts with only nominal constants are skipped), its chunk
    size by :func:`cost_model.best_batch_partition` within ``budget / p``."""
    cap = memory_budget(budget)
    handoff = getattr(machine_for(threads), "partition_overhead_s", Machine.partition_overhead_s)  # whole machine
    pool = [partitions] if partitions else partition_candidates(threads, batch)
    best: tuple[int, int, float] | None = None
    for p in pool:
        per = max(1, threads // p)
        mach = machine_for(per)
        if p > 1 and partitions is None and getattr(mach, "nominal", False):
            continue  # no measured constants for this thread count: do not guess
        if p > 1 and hasattr(mach, "cache_bytes"):  # concurrent partitions share the last-level cache
            mach = dataclasses.replace(mach, cache_bytes=max(1, (mach.cache_bytes or detect_cache_bytes()) // p))
        per_part = max((e - s for s, e in split(batch, p)), default=0) if batch else 0
        if per_part < 1:
            bp, t = 1, 0.0
        else:
            bp_cap = min(max_batch_partition(get_strategy(n), geom, per_part, 4, cap // p,
                                             tuple(q for q in names if names[q] == n)) for n in set(names.values()))
            bp, t = best_batch_partition(names, geom, per_part, mach, "total", max_bp=bp_cap)
        t += handoff * p if p > 1 else 0.0
        if "bwd_weights" in names and per_part >= 1:  # the partitions' weight gradients summed, once a call
            t += price(reduction_ops(get_strategy(names["bwd_weights"]), geom, p), mach)["total"]
        if best is None or t < best[2]:
            best = (p, bp, t)
    return best if best is not None else (1, max(1, batch), 0.0)


__all__ = ["choose_chunking", "chunks", "partition_candidates", "reduction_ops", "split"]
