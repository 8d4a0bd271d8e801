"""The one GEMM timer: measured GFLOPS of float32 GEMMs of given shapes.

Used for the BLAS backend choice (:func:`cct.blas.calibrate`), the devices' FLOPS probe
(:mod:`cct.scheduler.probe`) and the cost model's calibration (:mod:`cct.lowering.calibrate`).
Two ways to time, both after one warm-up call per shape (library start-up, page faults):

* ``repeats``: each shape best of ``repeats`` calls; GFLOPS = total flops / sum of the best times
  (the attainable rate, robust to another process's burst);
* ``duration``: cycle through all shapes for that many seconds of wall time; GFLOPS = flops done /
  time taken (a sustained rate; devices measured side by side start together on ``barrier``).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .product import gemm_on

Shape = tuple[int, int, int]  # (M, N, K): C[M, N] = A[M, K] @ B[K, N]


class OperandPool:
    """Random float32 GEMM operands cut from one buffer that grows as needed.

    Drawing fresh normal operands for every timed shape costs more than the GEMMs themselves for
    thin shapes (a 4 x 24414 @ 24414 x 1024 product reads a 100 MB operand it took ~0.3 s to
    draw); a calibration sweep that times many shapes shares one pool. Operands are contiguous
    views; A and B of one shape never overlap.
    """

    def __init__(self, seed: int = 0) -> None:
        self._rng = np.random.default_rng(seed)
        self._flat = np.empty(0, np.float32)

    def _grow(self, size: int) -> None:
        if size > self._flat.size:
            extra = self._rng.random(size - self._flat.size, dtype=np.float32) - np.float32(0.5)
            self._flat = np.concatenate((self._flat, extra))

    def pair(self, m: int, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """A (m x k) and B (k x n) views."""
        self._grow(m * k + k * n)
        return self._flat[:m * k].reshape(m, k), self._flat[m * k:m * k + k * n].reshape(k, n)


def best_time(fn: Callable[[], Any], repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` calls of ``fn`` after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def gemm_gflops(shapes: Sequence[Shape], *, repeats: int = 3, duration: float | None = None,
                backend: str | None = None, asarray: Callable[[np.ndarray], Any] | None = None,
                synchronize: Callable[[], Any] | None = None, barrier: threading.Barrier | None = None,
                operands: OperandPool | None = None) -> float:
    """GFLOPS of ``C = A @ B`` (float32, random operands) over ``shapes`` (see module docstring).

    ``backend``: the CPU BLAS backend (``"openblas"``, ``"mkl"``; None: numpy's own, OpenBLAS; the caller
    resolves the selected one, :func:`cct.blas.get_backend`); ``asarray``/``synchronize``: a
    device's upload and wait (GPU arrays go through ``xp.matmul``); ``barrier``: waited on after
    the warm-up (aborted if the set-up fails) so that devices measured together start together;
    ``operands``: a pool to cut the operands from (default: a fresh one).
    """
    to_device = asarray or (lambda x: x)
    sync = synchronize or (lambda: None)
    pool = operands if operands is not None else OperandPool()
    ops = []
    try:
        for m, n, k in shapes:
            a, b = pool.pair(m, n, k)
            a, b = to_device(a), to_device(b)
            c = to_device(np.empty((m, n), np.float32))
            ops.append((a, b, c, 2.0 * m * n * k))
        for a, b, c, _ in ops:  # warm-up
            gemm_on(backend, a, b, c)
        sync()
    except BaseException:
        if barrier is not None:
            barrier.abort()  # the others must not wait for this one
        raise
    if barrier is not None:
        barrier.wait(timeout=120)
    if duration is None:
        secs = 0.0
        for a, b, c, _ in ops:
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                gemm_on(backend, a, b, c)
                sync()
                best = min(best, time.perf_counter() - t0)
            secs += best
        return sum(f for *_, f in ops) / max(secs, 1e-12) / 1e9
    flops = 0.0
    t0 = time.perf_counter()
    elapsed = 0.0
    while elapsed < duration:
        for a, b, c, f in ops:
            gemm_on(backend, a, b, c)
            flops += f
        sync()
        elapsed = time.perf_counter() - t0
    return flops / elapsed / 1e9
