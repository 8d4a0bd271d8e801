"""Batching and batch partitions for the lowerings (CcT section 2.2, Omnivore section 3.2).

Two knobs, both provided by the wrapper strategy :class:`BatchedLowering`:

* ``b_p`` (``batch_partition``): how many images one lowering + GEMM covers. CcT lowers the
  whole batch at once (``b_p = N``) as long as the lowered matrices fit a memory budget
  (:func:`memory_budget`: ``$CCT_LOWERING_MEMORY`` or a quarter of the available RAM), else
  the largest ``b_p`` that fits (:func:`max_batch_partition`). ``b_p = 1`` is Caffe's mode
  (lower and multiply one image at a time), kept for the benchmarks that compare against it.
* ``p`` (``partitions``): split the batch into ``p`` partitions processed concurrently by ``p``
  Python threads (numpy releases the GIL in the copies and in BLAS), each partition's GEMMs
  using ``threads // p`` BLAS threads (and ``threads // p`` threads for cct's compiled
  lowering kernels, whose count numba keeps per calling thread). ``partitions="auto"`` times each candidate ``p`` on the
  first real call and keeps the fastest (cached on disk per machine and layer shape).

Thread limits, as measured (see benchmarks/README.md): numpy's OpenBLAS is a pthreads build
whose thread count is *process-wide* (threadpoolctl, ``openblas_set_num_threads``; its
``openblas_set_num_threads_local`` is global too), so the wrapper sets ``threads // p`` once
around the parallel section and every partition uses it. MKL's ``mkl_set_num_threads_local``
is per thread, so with the MKL backend each worker sets its own limit.

Use from a conv layer (same interface as any lowering)::

    layer.lowering = BatchedLowering(get_strategy("type1"))            # b_p auto, p = 1
    layer.lowering = BatchedLowering(strategy, batch_partition=1)      # Caffe mode
    layer.lowering = BatchedLowering(strategy, partitions=4)           # 4 parallel partitions
"""
from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import blas
from ..backend import get_array_module
from .base import LoweringStrategy
from .geometry import ConvGeometry

DEFAULT_FRACTION = 0.25
MIN_BUDGET = 64 << 20


def parse_bytes(text: str) -> int:
    """``"512M"``, ``"2G"``, ``"1.5GiB"``, ``"1000000"`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", str(text))
    if not m:
        raise ValueError(f"cannot parse a memory size from {text!r}")
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * mult)


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


def memory_budget(budget: int | str | None = None) -> int:
    """Bytes the lowered matrices of one conv pass may use.

    ``budget`` (bytes or a size string) wins; then ``$CCT_LOWERING_MEMORY``; else a quarter of
    the available RAM (at least 64 MiB).
    """
    if budget is not None:
        return parse_bytes(budget) if isinstance(budget, str) else int(budget)
    env = os.environ.get("CCT_LOWERING_MEMORY")
    if env:
        return parse_bytes(env)
    return max(MIN_BUDGET, int(available_memory() * DEFAULT_FRACTION))


def workspace_bytes(strategy: LoweringStrategy, geom: ConvGeometry, batch: int, itemsize: int = 4) -> int:
    """Temporary memory of one pass of ``strategy`` on ``batch`` images."""
    fn = getattr(strategy, "workspace_bytes", None)
    if fn is not None:
        return int(fn(geom, batch, itemsize))
    from .cost_model import KNOWN_TYPES
    from .cost_model import workspace_bytes as model_ws

    name = strategy.name if strategy.name in KNOWN_TYPES else "type1"
    return model_ws(name, geom, batch, itemsize)


def max_batch_partition(strategy: LoweringStrategy, geom: ConvGeometry, batch: int, itemsize: int = 4,
                        budget: int | str | None = None) -> int:
    """Largest ``b_p`` in ``[1, batch]`` whose workspace fits the budget (1 if none does)."""
    cap = memory_budget(budget)
    if batch <= 1 or workspace_bytes(strategy, geom, batch, itemsize) <= cap:
        return max(1, batch)
    lo, hi = 1, batch  # invariant: answer in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if workspace_bytes(strategy, geom, mid, itemsize) <= cap:
            lo = mid
        else:
            hi = mid - 1
    return lo


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


class BatchedLowering(LoweringStrategy):
    """Run ``inner`` on batch chunks of ``b_p`` images, optionally in ``p`` parallel partitions.

    ``batch_partition``: ``"auto"`` (largest that fits :func:`memory_budget`), an int, or
    ``"caffe"`` (= 1). ``partitions``: an int or ``"auto"`` (measured on the first call).
    ``threads``: total BLAS threads (default: the current BLAS setting); each partition's
    GEMMs get ``threads // p``. Results equal ``inner``'s up to float rounding.
    """

    def __init__(self, inner: LoweringStrategy, batch_partition: int | str = "auto",
                 partitions: int | str = 1, threads: int | None = None, budget: int | str | None = None,
                 candidates: tuple[int, ...] | None = None):
        self.inner = inner
        self.name = inner.name
        if batch_partition == "caffe":
            batch_partition = 1
        if not (batch_partition == "auto" or (isinstance(batch_partition, int) and batch_partition >= 1)):
            raise ValueError(f"batch_partition must be 'auto', 'caffe' or a positive int, got {batch_partition!r}")
        if not (partitions == "auto" or (isinstance(partitions, int) and partitions >= 1)):
            raise ValueError(f"partitions must be 'auto' or a positive int, got {partitions!r}")
        self.batch_partition = batch_partition
        self.partitions = partitions
        self.threads = threads
        self.budget = budget
        self.candidates = candidates
        self._pool: ThreadPoolExecutor | None = None
        self._chosen: dict[tuple, int] = {}
        self.last_timings: dict[int, float] = {}
        self._lock = threading.Lock()

    # -- planning ---------------------------------------------------------------------------
    def supports(self, geom: ConvGeometry) -> bool:
        """Whatever the inner lowering supports."""
        fn = getattr(self.inner, "supports", None)
        return True if fn is None else bool(fn(geom))

    def total_threads(self) -> int:
        """Total BLAS threads shared by the partitions."""
        return int(self.threads) if self.threads else max(1, blas.get_num_threads())

    def plan(self, geom: ConvGeometry, batch: int, itemsize: int = 4, partitions: int | None = None) -> dict:
        """``{"p": partitions, "b_p": images per GEMM, "ranges": [[(start, stop), ...] per partition]}``."""
        p = partitions if partitions is not None else (self.partitions if isinstance(self.partitions, int) else 1)
        p = max(1, min(p, batch)) if batch else 1
        parts = split(batch, p)
        per_part = max((e - s for s, e in parts), default=0)
        if self.batch_partition == "auto":
            cap = memory_budget(self.budget) // p
            bp = max_batch_partition(self.inner, geom, max(per_part, 1), itemsize, cap)
        else:
            bp = min(int(self.batch_partition), max(per_part, 1))
        return {"p": p, "b_p": bp, "ranges": [chunks(s, e, bp) for s, e in parts]}

    def _executor(self, p: int) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._pool._max_workers < p:
                if self._pool is not None:
                    self._pool.shutdown(wait=True)
                self._pool = ThreadPoolExecutor(max_workers=p, thread_name_prefix="cct-partition")
            return self._pool

    def _run(self, geom: ConvGeometry, batch: int, itemsize: int, work: Callable[[int, int], Any],
             partitions: int | None = None) -> list[list[Any]]:
        """Run ``work(start, stop)`` over the plan's chunks; results per partition, in order."""
        plan = self.plan(geom, batch, itemsize, partitions)
        p = plan["p"]
        if p == 1:
            return [[work(s, e) for s, e in plan["ranges"][0]]]
        per = max(1, self.total_threads() // p)
        backend = blas.get_backend()
        local = blas.supports_thread_local_limits(backend)

        def part(ranges):
            with contextlib.ExitStack() as stack:
                if local:
                    stack.enter_context(blas.blas_threads(per, backend))
                stack.enter_context(_kernel_threads(per))  # numba kernels (im2col...): per calling thread
                return [work(s, e) for s, e in ranges]

        pool = self._executor(p)
        if local:
            futures = [pool.submit(part, r) for r in plan["ranges"]]
            return [f.result() for f in futures]
        with blas.blas_threads(per, backend):  # process-wide (OpenBLAS): same limit for all partitions
            futures = [pool.submit(part, r) for r in plan["ranges"]]
            return [f.result() for f in futures]

    def _partitions_for(self, geom: ConvGeometry, batch: int, itemsize: int,
                        measure: Callable[[int], float]) -> tuple[int, bool]:
        """``(p, measured)``: ``measured`` means the candidates just ran (outputs are filled)."""
        if self.partitions != "auto":
            return int(self.partitions), False
        key = (geom, batch, itemsize)
        if key in self._chosen:
            return self._chosen[key], False
        cache_name = _partition_cache_name()
        disk = blas.read_cache(cache_name) or {}
        dkey = f"{self.inner.name}|{geom}|{batch}|{itemsize}|{self.total_threads()}"
        if dkey in disk:
            self._chosen[key] = int(disk[dkey])
            return self._chosen[key], False
        cands = self.candidates or _default_candidates(self.total_threads(), batch)
        timings = {c: measure(c) for c in cands}
        best = min(timings, key=timings.get)
        self.last_timings = timings
        self._chosen[key] = best
        disk[dkey] = best
        try:
            blas.write_cache(cache_name, disk)
        except OSError:
            pass
        return best, True

    # -- the three passes -----------------------------------------------------------------------
    def forward(self, x: Any, w: Any, b: Any, geom: ConvGeometry) -> Any:
        xp = get_array_module(x)
        n = x.shape[0]
        y = xp.empty((n, geom.channels_out) + tuple(geom.out_shape), dtype=x.dtype)

        def work(s, e):
            y[s:e] = self.inner.forward(x[s:e], w, b, geom)

        def measure(p):
            t0 = time.perf_counter()
            self._run(geom, n, x.itemsize, work, p)
            return time.perf_counter() - t0

        p, measured = self._partitions_for(geom, n, x.itemsize, measure)
        if not measured:
            self._run(geom, n, x.itemsize, work, p)
        return y

    def backward_data(self, dy: Any, w: Any, geom: ConvGeometry) -> Any:
        xp = get_array_module(dy)
        n = dy.shape[0]
        dx = xp.empty((n, geom.channels_in) + tuple(geom.in_shape), dtype=dy.dtype)

        def work(s, e):
            dx[s:e] = self.inner.backward_data(dy[s:e], w, geom)

        p = self._chosen.get((geom, n, dy.itemsize), self.partitions if isinstance(self.partitions, int) else 1)
        self._run(geom, n, dy.itemsize, work, p)
        return dx

    def backward_weights(self, dy: Any, x: Any, geom: ConvGeometry) -> tuple[Any, Any]:
        n = dy.shape[0]

        def work(s, e):
            return self.inner.backward_weights(dy[s:e], x[s:e], geom)

        p = self._chosen.get((geom, n, dy.itemsize), self.partitions if isinstance(self.partitions, int) else 1)
        results = [r for part in self._run(geom, n, dy.itemsize, work, p) for r in part]
        if not results:
            xp = get_array_module(dy)
            dw = xp.zeros(geom.weight_shape, dtype=dy.dtype)
            return dw, (xp.zeros(geom.channels_out, dtype=dy.dtype) if geom.bias_term else None)
        dw, db = results[0]
        dw = dw.copy()
        db = None if db is None else db.copy()
        for dwi, dbi in results[1:]:
            dw += dwi
            if db is not None:
                db += dbi
        return dw, db

    def cost(self, geom: ConvGeometry, batch: int, machine: Any = None) -> float:
        """Inner cost summed over the chunks of one partition (partitions run concurrently)."""
        plan = self.plan(geom, batch)
        return sum(self.inner.cost(geom, e - s, machine) for s, e in plan["ranges"][0])

    def __repr__(self) -> str:
        return f"<lowering {self.name} b_p={self.batch_partition} p={self.partitions}>"


def _kernel_threads(n: int):
    """Limit cct's compiled (numba) kernels to ``n`` threads in the calling thread, if they are on."""
    try:
        from .. import kernels
    except ImportError:  # pragma: no cover
        return contextlib.nullcontext()
    if not kernels.enabled():
        return contextlib.nullcontext()
    return kernels.num_threads(n)


def caffe_mode(inner: LoweringStrategy) -> BatchedLowering:
    """Caffe's convolution batching: lower + GEMM one image at a time (``b_p = 1``)."""
    return BatchedLowering(inner, batch_partition=1, partitions=1)


def _default_candidates(threads: int, batch: int) -> tuple[int, ...]:
    c = sorted({p for p in (1, 2, 4, 8, 16, threads) if 1 <= p <= max(1, min(threads, batch))})
    return tuple(c)


def _partition_cache_name() -> str:
    return f"partitions-{blas.machine_key()}.json"


def describe(strategy: LoweringStrategy, geom: ConvGeometry, batch: int, itemsize: int = 4) -> str:
    """``"b_p=256 p=1 workspace 1.2 GiB"`` for a (possibly wrapped) strategy."""
    if isinstance(strategy, BatchedLowering):
        plan = strategy.plan(geom, batch, itemsize)
        ws = workspace_bytes(strategy.inner, geom, plan["b_p"], itemsize) * plan["p"]
        return f"b_p={plan['b_p']} p={plan['p']} workspace {ws / 2**30:.2f} GiB"
    ws = workspace_bytes(strategy, geom, batch, itemsize)
    return f"b_p={batch} p=1 workspace {ws / 2**30:.2f} GiB"


__all__ = ["BatchedLowering", "available_memory", "caffe_mode", "chunks", "describe", "max_batch_partition",
           "memory_budget", "parse_bytes", "split", "workspace_bytes"]
