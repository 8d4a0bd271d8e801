"""Measured throughput of the non-GEMM convolution primitives the cost model prices.

:func:`measure_rates` times, on the calling thread's BLAS/kernel thread counts (well under a
second once numba's cached machine code is loaded):

* ``direct_gflops`` -- the register-blocked direct-convolution kernel (:mod:`cct.kernels.conv_simd`)
  alone (beside a copy of itself on each other share of the cores, :func:`loaded_best_time`),
  forward on 32 images of a 32-channel 5x5 layer of 16x16 outputs and a 64-channel 5x5 layer of
  13x13 outputs together (2 flops per multiply-add the tiles compute, dropped positions
  included, as :meth:`~cct.lowering.direct.DirectConvolution.pass_ops` declares them; the buffer
  copies are priced as sweeps), the whole numpy-path forward when the kernels are off;
  ``direct_k3_gflops`` its forward on the same layers with 3x3 kernels (the cost model's kernel-width
  term, :meth:`~cct.lowering.cost_model.Machine.direct_seconds`); ``direct_wgrad_gflops`` the same
  for its weight-gradient kernel;
* ``fft_gflops`` / ``ifft_gflops`` -- real transforms of conv-sized planes, zero-extended and
  written frequency-major as the FFT strategy's are (:func:`cct.lowering.fft.spectrum`), and their
  pruned inverses from that layout, in nominal FFT flops
  (``2.5 n log2 n`` per complex line, :func:`cct.lowering.fft._fft_flops`), on 18-point planes;
  ``fft_large_gflops`` the forward transforms on 36-point planes (the rate grows with the size);

* ``call_overhead_s`` -- per strategy and pass, one call on a trivial layer (8 channels, 4x4 output,
  one image): the fixed cost a thin or tiny layer pays whatever its size;
* ``chunk_overhead_s`` -- what running a pass in batch chunks adds per chunk beyond those calls;
  ``partition_overhead_s`` -- what each parallel batch partition adds (hand-off and join).

Each point keeps the best of a few runs. :func:`cct.lowering.calibrate.calibrate` stores them in
the :class:`~cct.lowering.cost_model.Machine`.
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import blas, kernels
from .base import get_strategy, strategy_names
from .cost_model import FFT_LARGE_POINTS, FFT_POINTS
from .direct import DirectConvolution
from .direct_layout import Scratch
from .fft import _fft_flops, half_shape, inverse_spectrum, spectrum
from .geometry import ConvGeometry
from .partition import BatchedLowering

#: bumped when a measured kernel changes enough that cached rates mislead (2: register-blocked direct;
#: 3: its weight gradient; 4: rates over the multiply-adds the tiles compute; 5: the FFT rate best of three passes;
#: 6: direct kernels timed beside their twins, the per-chunk overhead and the inverse-FFT rate measured;
#: 7: the direct kernels' vectors and tiles sized to the CPU's registers, 2-3x faster on AVX2;
#: 8: the forward rate on 3x3 layers too, for its kernel-width term; 9: forward drivers per kernel width,
#: the taps of a kernel row unrolled, 1.3-1.4x faster on AVX2; 10: the forward FFT rate at two sizes;
#: 11: FFT stages frequency-major; 12: kernels compiled serial, run in pieces on cct's kernel threads)
RATES_VERSION = 12


#: ``(channels, size, kernel)`` of the layers the direct kernels' rates are timed on: 5x5 layers, the
#: kernel variants most small nets use
DIRECT_RATE_LAYERS = ((32, 16, 5), (64, 13, 5))


def rate_geometry(c: int, m: int, n: int, k: int) -> ConvGeometry:
    """The unbiased, same-padded ``k x k`` convolution of ``c`` to ``m`` channels on ``n x n`` images
    that the rates are timed on."""
    o = n - k + 1 + 2 * (k // 2)
    return ConvGeometry(c, m, 1, (n, n), (k, k), (k // 2, k // 2), (1, 1), (1, 1), (o, o), False)


#: the 3x3 layers :data:`DIRECT_RATE_LAYERS` become for the forward rate's kernel-width term
DIRECT_K3_LAYERS = tuple((c, n, 3) for c, n, _ in DIRECT_RATE_LAYERS)


def direct_rate(pass_: str, layers: tuple[tuple[int, int, int], ...], repeats: int = 3) -> float:
    """GFLOPS of the direct kernels' ``pass_`` over ``layers`` (``(channels, size, kernel)``, 32 images
    each), each timed beside its twins (:func:`loaded_best_time`), counting the multiply-adds the tiles
    compute as :meth:`~cct.lowering.direct.DirectConvolution.pass_ops` declares them."""
    rng = np.random.default_rng(0)
    seconds = flops = 0.0
    for c, n, k in layers:
        g = rate_geometry(c, c, n, k)
        x = rng.standard_normal((32, c, n, n), dtype=np.float32)
        w = rng.standard_normal(g.weight_shape, dtype=np.float32)
        seconds += loaded_best_time(lambda g=g, x=x, w=w, p=pass_: DirectConvolution().kernel_call(x, w, g, p),
                                    max(repeats, 7))  # ~1 ms a call
        flops += 2.0 * sum(op[1] for op in DirectConvolution().pass_ops(g, 32, pass_)
                           if op[0] in ("direct", "direct_wgrad"))
    return flops / seconds / 1e9


def measure_rates(repeats: int = 3, kernel_widths: bool = True) -> dict[str, float]:
    """``{"direct_gflops", "direct_k3_gflops", "direct_wgrad_gflops", "fft_gflops", "ifft_gflops", "fft_large_gflops",
    "call_overhead_s",
    "chunk_overhead_s", "partition_overhead_s"}`` of this machine (see
    the module docstring). Complex GEMMs are priced from the real GEMM grids (a complex multiply-add
    is four real ones). Without ``kernel_widths`` the 3x3 forward rate is left out (0.0: measured when a
    layer first needs it, :func:`cct.lowering.calibrate.ensure_kernel_width_rate`)."""
    blas.limit_openblas_spin()  # as in a net: GEMM workers spinning after the grids would slow the kernels
    rng = np.random.default_rng(0)
    # conv-like transforms as FFTConvolution runs them: 14x14 planes zero-extended to 18x18 written
    # frequency-major (the layout of the channel products), and back from that layout keeping 14x14,
    # buffers reused (flops counted as FFTConvolution.pass_ops counts them)
    scratch = Scratch()

    def forward_rate(points: int) -> tuple[float, np.ndarray, tuple[int, int], tuple[int, int]]:
        shape, keep = (points, points), (points - 4, points - 4)
        planes = np.zeros((64, 16, keep[0], points), dtype=np.float32)
        planes[..., :keep[1]] = rng.standard_normal((64, 16) + keep, dtype=np.float32)
        out = np.empty(half_shape(shape) + (64, 16), dtype=np.complex64).transpose(2, 3, 0, 1)
        t = min(blas.best_time(lambda: spectrum(planes, shape, out, scratch=scratch, tag="rate"), repeats)
                for _ in range(3))
        return 64 * 16 * _fft_flops(shape, keep) / t / 1e9, out, shape, keep

    fft_gflops, spec, shape, keep = forward_rate(FFT_POINTS)
    fft_large_gflops = forward_rate(FFT_LARGE_POINTS)[0]
    t = min(blas.best_time(lambda: inverse_spectrum(spec, shape, keep, scratch=scratch, tag="rate"), repeats)
            for _ in range(3))
    ifft_gflops = 64 * 16 * _fft_flops(shape, keep) / t / 1e9

    return {"direct_gflops": direct_rate("fwd", DIRECT_RATE_LAYERS, repeats),
            "direct_k3_gflops": direct_rate("fwd", DIRECT_K3_LAYERS, repeats) if kernel_widths else 0.0,
            "direct_wgrad_gflops": direct_rate("bwd_weights", DIRECT_RATE_LAYERS, repeats), "fft_gflops": fft_gflops,
            "ifft_gflops": ifft_gflops, "fft_large_gflops": fft_large_gflops,
            "call_overhead_s": measure_call_overheads(), "chunk_overhead_s": measure_chunk_overhead(),
            "partition_overhead_s": measure_partition_overhead()}


def measure_partition_overhead(repeats: int = 20) -> float:
    """Seconds per partition of running a pass in parallel batch partitions, one per core, with no work
    in them (:meth:`~cct.lowering.partition.BatchedLowering`'s hand-off to its worker threads and the
    join; a 2-core Zen 5 VM: 30-33 us a partition); 0 on one core."""
    p = os.cpu_count() or 1
    if p < 2:
        return 0.0
    g = rate_geometry(8, 8, 4, 5)
    runner = BatchedLowering(get_strategy("type1"), batch_partition=1, partitions=p, threads=p)
    t = min(blas.best_time(lambda: runner._run(g, p, 4, lambda s, e: None, p), repeats) for _ in range(2))
    return t / p


def measure_chunk_overhead(repeats: int = 10, chunks: int = 4) -> float:
    """Seconds :class:`~cct.lowering.partition.BatchedLowering` adds per chunk beyond the strategy's own
    call: a forward pass of type 1 on ``chunks`` one-image chunks of a trivial layer against ``chunks``
    calls of type 1 alone (0 when within noise)."""
    rng = np.random.default_rng(2)
    g = rate_geometry(8, 8, 4, 5)
    x = rng.standard_normal((chunks, 8, 4, 4), dtype=np.float32)
    w = rng.standard_normal(g.weight_shape, dtype=np.float32)
    alone, batched = get_strategy("type1"), BatchedLowering(get_strategy("type1"), batch_partition=1, partitions=1)
    one = min(blas.best_time(lambda: alone.forward(x[:1], w, None, g), repeats) for _ in range(2))
    many = min(blas.best_time(lambda: batched.forward(x, w, None, g), repeats) for _ in range(2))
    return max(0.0, (many - chunks * one) / chunks)


def loaded_best_time(make_call: Callable[[], Callable[[], Any]], repeats: int) -> float:
    """Seconds of the fastest call of ``make_call()`` while the rest of the machine is as busy as in a
    partitioned net: when the calling thread's kernel thread count is a share of the cores, each other
    share runs a copy of the same call at the same time (as :class:`~cct.lowering.partition.
    BatchedLowering`'s partitions do), and a repeat lasts until the slowest copy ends. Measured alone,
    one thread of a 2-core Zen 5 ran the direct kernel ~1.3x faster than it did beside its twin."""
    threads = max(1, kernels.get_num_threads())
    copies = max(1, (os.cpu_count() or 1) // threads)
    calls = [make_call() for _ in range(copies)]
    for call in calls:
        call()  # compile / load the kernel, fault the buffers in
    if copies == 1:
        return blas.best_time(calls[0], repeats)
    start = threading.Barrier(copies)

    def timed(call: Callable[[], Any]) -> list[float]:
        with kernels.num_threads(threads):
            out = []
            for _ in range(repeats):
                start.wait()
                t0 = time.perf_counter()
                call()
                out.append(time.perf_counter() - t0)
            return out

    others = [kernels.worker_pool().submit(timed, call) for call in calls[1:]]
    mine = timed(calls[0])
    return min(max(ts) for ts in zip(mine, *(f.result() for f in others)))


def overhead_layer() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, ConvGeometry]:
    """``(x, w, b, dy, geometry)`` of the trivial layer the call overheads are timed on: one image, 8
    channels, 4x4, 5x5 kernels (the kernel variants the rates compiled)."""
    rng = np.random.default_rng(1)
    g = rate_geometry(8, 8, 4, 5)
    return (rng.standard_normal((1, 8, 4, 4), dtype=np.float32), rng.standard_normal(g.weight_shape, dtype=np.float32),
            np.zeros(8, np.float32), rng.standard_normal((1, 8) + g.out_shape, dtype=np.float32), g)


def measure_call_overheads(repeats: int = 10) -> dict[str, dict[str, float]]:
    """``{strategy: {pass: seconds}}`` of one call of every registered strategy on a trivial layer."""
    x, w, b, dy, g = overhead_layer()
    out: dict[str, dict[str, float]] = {}
    for _ in range(2):  # two sweeps over the strategies, each call keeping its best
        for name in strategy_names():
            s = get_strategy(name)
            if not s.supports(g):
                continue
            calls = {"fwd": lambda s=s: s.forward(x, w, b, g), "bwd_data": lambda s=s: s.backward_data(dy, w, g),
                     "bwd_weights": lambda s=s: s.backward_weights(dy, x, g)}
            best = out.setdefault(name, {})
            for p, fn in calls.items():
                best[p] = min(best.get(p, float("inf")), blas.best_time(fn, repeats))
    return out
