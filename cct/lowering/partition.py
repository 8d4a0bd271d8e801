"""Batching and batch partitions for the lowerings (CcT section 2.2, Omnivore section 3.2).

Two knobs, both provided by the wrapper strategy :class:`BatchedLowering`:

* ``b_p`` (``batch_partition``): how many images one lowering + GEMM covers. CcT lowers the
  whole batch at once (``b_p = N``) as long as the lowered matrices fit a memory budget
  (:func:`cct.lowering.budget.memory_budget`), else the largest ``b_p`` that fits
  (:func:`cct.lowering.budget.max_batch_partition`). ``b_p = 1`` is Caffe's mode
  (lower and multiply one image at a time), kept for the benchmarks that compare against it.
  With ``batch_partition="auto"`` the cost model picks ``b_p`` among the sizes that fit the
  budget (:func:`cct.lowering.cost_model.best_batch_partition`): per-chunk sweeps are priced by
  their size, so a chunk whose lowered matrix stays in cache beats one huge lowering for small
  layers, while big layers (CaffeNet) keep large chunks for GEMM efficiency.
* ``p`` (``partitions``): split the batch into ``p`` partitions processed concurrently by ``p``
  Python threads (numpy releases the GIL in the copies and in BLAS), each partition's GEMMs
  using ``threads // p`` BLAS threads (and ``threads // p`` threads for cct's compiled
  lowering kernels, whose count numba keeps per calling thread). ``partitions="model"`` lets the cost
  model decide, pricing each ``p`` with the constants calibrated for ``threads // p`` BLAS threads (the
  calling thread runs partition 0 itself). The wrapper never measures: the engine's ``partitions="auto"``
  measures the candidates when the layer is planned (:func:`cct.lowering.tune.measure_partitions`), and the
  layer calls :meth:`BatchedLowering.prepare_for` at setup, so even a wrapper built by hand with ``"auto"``
  prices its chunking there, not in the first pass.

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
import dataclasses
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import blas, kernels
from ..config import submit_in_context
from ..device.driver import array_module, device_of
from .base import IntoLowering, LoweringStrategy
from .budget import max_batch_partition, memory_budget, workspace_bytes
from .chunking import choose_chunking, chunks, split
from .cost_model import PASSES, Machine, nominal_machine
from .geometry import ConvGeometry


class PartitionWorkers:
    """The threads that run partitions ``1..p-1`` of a batch (the caller runs partition 0). A lowering has its own;
    lowerings that never run at the same time (dense inference's layers) may share one, so that buffers kept per
    thread (:class:`cct.lowering.direct_layout.SharedScratch`) are one set per partition, not per layer."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def executor(self, workers: int) -> ThreadPoolExecutor:
        """An executor of at least ``workers`` threads (started now if fewer run)."""
        with self._lock:
            if self._pool is None or self._pool._max_workers < workers:
                if self._pool is not None:
                    self._pool.shutdown(wait=True)
                self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cct-partition")
            return self._pool

    def close(self) -> None:
        """End the threads (a later call starts them again)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


class BatchedLowering(IntoLowering):
    """Run ``inner`` on batch chunks of ``b_p`` images, optionally in ``p`` parallel partitions.

    ``batch_partition``: ``"auto"`` (the cost model's best size that fits :func:`memory_budget`),
    ``"budget"`` (the largest size that fits, CcT's whole-batch lowering), an int, or ``"caffe"``
    (= 1). ``partitions``: an int or ``"model"`` (the cost model's count). ``threads``: total BLAS threads
    (default: the current BLAS setting); each partition's GEMMs get ``threads // p``. Results equal
    ``inner``'s up to float rounding.

    Besides the three products, :meth:`forward_into` and :meth:`backward_into` write into given
    arrays (the layer's top / parameter diffs / bottom diff) and, when ``inner`` has them too,
    hand each chunk to the inner lowering's own ``forward_into``/``backward_into`` (type 1:
    buffers reused across calls, weight and data gradients from one im2col per chunk).
    """

    def __init__(self, inner: LoweringStrategy, batch_partition: int | str = "auto",
                 partitions: int | str = 1, threads: int | None = None, budget: int | str | None = None,
                 machine: Any = None,
                 machine_for: Callable[[int], Machine] | None = None, chosen_plan: Any = None,
                 plan_report: str = ""):
        self.inner = inner
        self.name = inner.name
        if batch_partition == "caffe":
            batch_partition = 1
        if not (batch_partition in ("auto", "budget") or (isinstance(batch_partition, int) and batch_partition >= 1)):
            raise ValueError(f"batch_partition must be 'auto', 'budget', 'caffe' or a positive int, "
                             f"got {batch_partition!r}")
        if not (partitions == "model" or (isinstance(partitions, int) and partitions >= 1)):
            raise ValueError(f"partitions must be 'model' or a positive int, got {partitions!r} (measuring them is "
                             f"the planner's job: cct.lowering.tune.measure_partitions)")
        self.batch_partition = batch_partition
        self.partitions = partitions
        self.threads = threads
        self.budget = budget
        # cost-model constants for "auto"/"model": one machine, or one per BLAS thread count (the engine gives
        # the calibrated ones); neither: the nominal model
        self.machine = machine
        self.machine_for = machine_for
        self.chosen_plan = chosen_plan  # the optimizer's Plan this wrapper executes (None: built by hand)
        self.plan_report = plan_report  # its log line
        self._workers = PartitionWorkers()
        self._chosen: dict[tuple, int] = {}
        self._plans: dict[tuple, dict] = {}
        self._total_threads: int | None = None

    # -- planning ---------------------------------------------------------------------------
    def supports(self, geom: ConvGeometry) -> bool:
        """Whatever the inner lowering supports."""
        fn = getattr(self.inner, "supports", None)
        return True if fn is None else bool(fn(geom))

    def total_threads(self) -> int:
        """Total BLAS threads shared by the partitions (read once: the BLAS setting at first use)."""
        if self.threads:
            return int(self.threads)
        if self._total_threads is None:
            self._total_threads = max(1, blas.get_num_threads())
        return self._total_threads

    def _pass_names(self) -> dict[str, str] | None:
        """The strategy run by each pass (a per-pass plan mixes them), or None if one has no cost model."""
        names = {}
        for q in PASSES:
            s = getattr(self.inner, q, None)
            s = s if isinstance(s, LoweringStrategy) else self.inner
            if not s.priced():
                return None
            names[q] = s.name
        return names

    def _model_chunking(self, geom: ConvGeometry, batch: int, partitions: int | None) -> tuple[int, int, float]:
        """``(p, b_p, predicted s)`` by the one chooser (:func:`cct.lowering.chunking.choose_chunking`)."""
        names = self._pass_names()
        if self.machine_for is not None:
            machine_for = self.machine_for
        else:
            fixed = self.machine if self.machine is not None else nominal_machine()
            machine_for = lambda t: fixed  # noqa: E731
        if names is None:  # no cost model: CcT's default, the largest chunk that fits
            p = partitions or 1
            per_part = max((e - s for s, e in split(batch, p)), default=1)
            return p, max_batch_partition(self.inner, geom, max(per_part, 1), 4, memory_budget(self.budget) // p), 0.0
        return choose_chunking(names, geom, batch, self.total_threads(), self.budget, partitions, machine_for)

    def plan(self, geom: ConvGeometry, batch: int, itemsize: int = 4, partitions: int | None = None) -> dict:
        """``{"p": partitions, "b_p": images per GEMM, "ranges": [[(start, stop), ...] per partition]}``
        (plus ``predicted_s`` when the cost model chose ``b_p``)."""
        if partitions is None:
            if isinstance(self.partitions, int):
                partitions = self.partitions
            elif self.partitions == "model":
                key = ("p", geom, batch, itemsize)
                if key not in self._chosen:
                    model = batch > 1 and self.batch_partition == "auto" and self.total_threads() > 1
                    self._chosen[key] = self._model_chunking(geom, batch, None)[0] if model else 1
                partitions = self._chosen[key]
        key = (geom, batch, itemsize, partitions)
        cached = self._plans.get(key)
        if cached is not None:
            return cached
        p = max(1, min(partitions, batch)) if batch else 1
        parts = split(batch, p)
        per_part = max((e - s for s, e in parts), default=0)
        predicted = 0.0
        if self.batch_partition == "budget":
            bp = max_batch_partition(self.inner, geom, max(per_part, 1), itemsize, memory_budget(self.budget) // p)
        elif self.batch_partition == "auto":
            _, bp, predicted = self._model_chunking(geom, batch, p)
        else:
            bp = min(int(self.batch_partition), max(per_part, 1))
        out = {"p": p, "b_p": max(1, bp), "ranges": [chunks(s, e, max(1, bp)) for s, e in parts],
               "predicted_s": predicted}
        self._plans[key] = out
        return out

    def prepare_for(self, geom: ConvGeometry, batch: int, itemsize: int = 4) -> None:
        """Resolve the chunking for ``geom`` at ``batch`` (``"auto"``/``"budget"``/``"model"`` priced now, not in
        the first pass) and start the partition threads it needs; the passes then look the plan up."""
        plan = self.plan(geom, batch, itemsize)
        if plan["p"] > 1:
            self._executor(plan["p"] - 1)

    def _executor(self, p: int) -> ThreadPoolExecutor:
        return self._workers.executor(p)

    def share_workers(self, workers: PartitionWorkers) -> None:
        """Run partitions on ``workers`` (shared with lowerings that never run at the same time) instead of this
        lowering's own threads, which end now."""
        if workers is not self._workers:
            self._workers.close()
            self._workers = workers

    def close(self) -> None:
        """End the partition threads (a later call starts them again)."""
        self._workers.close()

    def _run(self, geom: ConvGeometry, batch: int, itemsize: int, work: Callable[[int, int], Any],
             partitions: int | None = None, part_done: Callable[[int], Any] | None = None) -> list[list[Any]]:
        """Run ``work(start, stop)`` over the plan's chunks; results per partition, in order.

        ``part_done(i)`` (if given) runs in partition ``i``'s thread after its last chunk.
        """
        plan = self.plan(geom, batch, itemsize, partitions)
        p = plan["p"]
        if p == 1:
            res = [work(s, e) for s, e in plan["ranges"][0]]
            if part_done is not None:
                part_done(0)
            return [res]
        per = max(1, self.total_threads() // p)
        backend = blas.get_backend()
        local = blas.supports_thread_local_limits(backend)

        def part(i):
            with contextlib.ExitStack() as stack:
                if local:
                    stack.enter_context(blas.blas_threads(per, backend))
                stack.enter_context(_kernel_threads(per))  # numba kernels (im2col...): per calling thread
                res = [work(s, e) for s, e in plan["ranges"][i]]
                if part_done is not None:
                    part_done(i)
                return res

        pool = self._executor(p - 1)
        with contextlib.ExitStack() as stack:
            if not local:  # process-wide (OpenBLAS): same limit for all partitions
                stack.enter_context(blas.blas_threads(per, backend))
            futures = [submit_in_context(pool.submit, part, i) for i in range(1, p)]  # under this config
            try:
                first = part(0)  # the calling thread runs partition 0
            finally:
                rest = [f.result() for f in futures]
            return [first] + rest

    # -- the three passes -----------------------------------------------------------------------
    def forward_into(self, x: Any, w: Any, b: Any, geom: ConvGeometry, out: Any) -> Any:
        """``out[...] = conv(x, w) + b``, chunk by chunk (``out`` ``(N, M, *out)``, C-contiguous)."""
        n = x.shape[0]
        inner_into = getattr(self.inner, "forward_into", None)

        def work(s, e):
            if inner_into is not None:
                inner_into(x[s:e], w, b, geom, out[s:e])
            else:
                out[s:e] = self.inner.forward(x[s:e], w, b, geom)

        self.inner.prepare(w, geom, "fwd")
        if device_of(x).is_gpu:
            work(0, n)
            return out
        self._run(geom, n, x.itemsize, work)
        return out

    def backward_into(self, dy: Any, x: Any, w: Any, geom: ConvGeometry, dw: Any = None, db: Any = None,
                      dx: Any = None) -> None:
        """``dw += dL/dw``, ``db += dL/db``, ``dx[...] = dL/dx`` (each None to skip), chunk by chunk.

        Each partition accumulates its weight/bias gradient privately; the sums are added to
        ``dw``/``db`` at the end. With an inner ``backward_into`` one lowering per chunk feeds both
        gradients.
        """
        xp = array_module(dy)
        n = dy.shape[0]
        on_device = device_of(dy).is_gpu
        if on_device:
            plan = {"p": 1, "b_p": n, "ranges": [[(0, n)]]}
        else:
            plan = self.plan(geom, n, dy.itemsize)
        parts = plan["p"]
        inner_into = getattr(self.inner, "backward_into", None)
        # the inner lowering accumulates dW^T per partition (one transpose-add at the end, not per chunk)
        transposed = dw is not None and inner_into is not None and getattr(self.inner, "transposed_weight_grad", False)
        g, kd = geom.group, geom.kernel_dim
        accs = []
        for i in range(parts):
            if transposed:
                accs.append((xp.zeros((g, kd, geom.channels_out // g), dtype=dw.dtype),
                             db if parts == 1 else None if db is None else xp.zeros(db.shape, dtype=db.dtype)))
            elif i == 0 and parts == 1:
                accs.append((dw, db))  # one partition: accumulate straight into the outputs
            else:
                accs.append((None if dw is None else xp.zeros(dw.shape, dtype=dw.dtype),
                             None if db is None else xp.zeros(db.shape, dtype=db.dtype)))
        owner = {}
        for i, ranges in enumerate(plan["ranges"]):
            for s, _ in ranges:
                owner[s] = i
        wgeom = geom if db is not None else dataclasses.replace(geom, bias_term=False)
        if dx is not None:
            self.inner.prepare(w, geom, "bwd_data")

        def work(s, e):
            adw, adb = accs[owner[s]]
            if transposed:
                inner_into(dy[s:e], x[s:e] if x is not None else None, w, geom, dwt=adw, db=adb,
                           dx=None if dx is None else dx[s:e])
                return
            if inner_into is not None:
                inner_into(dy[s:e], x[s:e] if x is not None else None, w, geom, dw=adw, db=adb,
                           dx=None if dx is None else dx[s:e])
                return
            if adw is not None:
                gw, gb = self.inner.backward_weights(dy[s:e], x[s:e], wgeom)
                adw += gw.reshape(adw.shape)
                if adb is not None:
                    adb += gb
            elif adb is not None:
                adb += dy[s:e].reshape(e - s, geom.channels_out, -1).sum(axis=(0, 2))
            if dx is not None:
                dx[s:e] = self.inner.backward_data(dy[s:e], w, geom)

        if on_device:
            work(0, n)
        else:
            self._run(geom, n, dy.itemsize, work, parts)
        if transposed:
            total = accs[0][0]
            for adw, _ in accs[1:]:
                total += adw
            dw.reshape(g, geom.channels_out // g, kd)[...] += total.transpose(0, 2, 1)
            if db is not None and parts > 1:
                for _, adb in accs:
                    db += adb
        elif parts > 1:
            for adw, adb in accs:
                if dw is not None:
                    dw += adw
                if db is not None:
                    db += adb

    def __repr__(self) -> str:
        return f"<lowering {self.name} b_p={self.batch_partition} p={self.partitions}>"


def _kernel_threads(n: int):
    """Limit cct's compiled (numba) kernels to ``n`` threads in the calling thread, if they are on."""
    if not kernels.enabled():
        return contextlib.nullcontext()
    return kernels.num_threads(n)


def caffe_mode(inner: LoweringStrategy) -> BatchedLowering:
    """Caffe's convolution batching: lower + GEMM one image at a time (``b_p = 1``)."""
    return BatchedLowering(inner, batch_partition=1, partitions=1)


def describe(strategy: LoweringStrategy, geom: ConvGeometry, batch: int, itemsize: int = 4) -> str:
    """``"b_p=256 p=1 workspace 1.2 GiB"`` for a (possibly wrapped) strategy."""
    if isinstance(strategy, BatchedLowering):
        plan = strategy.plan(geom, batch, itemsize)
        ws = workspace_bytes(strategy.inner, geom, plan["b_p"], itemsize) * plan["p"]
        return f"b_p={plan['b_p']} p={plan['p']} workspace {ws / 2**30:.2f} GiB"
    ws = workspace_bytes(strategy, geom, batch, itemsize)
    return f"b_p={batch} p=1 workspace {ws / 2**30:.2f} GiB"


__all__ = ["BatchedLowering", "caffe_mode", "describe"]
