"""Measured throughput of the non-GEMM convolution primitives the cost model prices.

:func:`measure_rates` times, on the calling thread's BLAS/kernel thread counts (well under a
second once numba's cached machine code is loaded):

* ``direct_gflops`` -- the register-blocked direct-convolution kernel (:mod:`cct.kernels.conv_simd`)
  alone, forward on 32 images of a 32-channel 5x5 layer of 16x16 outputs and a 64-channel 5x5
  layer of 13x13 outputs together (2 flops per multiply-add the tiles compute, dropped positions
  included, as :meth:`~cct.lowering.direct.DirectConvolution.pass_ops` declares them; the buffer
  copies are priced as sweeps), the whole numpy-path forward when the kernels are off;
  ``direct_wgrad_gflops`` the same for its weight-gradient kernel;
* ``fft_gflops`` -- real transforms of conv-sized planes as the FFT strategy runs them
  (:func:`cct.lowering.fft.rfftn`), in nominal FFT flops (``2.5 n log2 n`` per complex line,
  :func:`cct.lowering.fft._fft_flops`);

* ``call_overhead_s`` -- per strategy and pass, one call on a trivial layer (8 channels, 4x4 output,
  one image): the fixed cost a thin or tiny layer pays whatever its size.

Each point keeps the best of a few runs. :func:`cct.lowering.calibrate.calibrate` stores them in
the :class:`~cct.lowering.cost_model.Machine`.
"""
from __future__ import annotations

import numpy as np

from .. import blas
from .geometry import ConvGeometry

#: bumped when a measured kernel changes enough that cached rates mislead (2: register-blocked direct;
#: 3: its weight gradient; 4: rates over the multiply-adds the tiles compute; 5: FFT split over the batch)
RATES_VERSION = 5


def _geom(c: int, m: int, n: int, k: int) -> ConvGeometry:
    o = n - k + 1 + 2 * (k // 2)
    return ConvGeometry(c, m, 1, (n, n), (k, k), (k // 2, k // 2), (1, 1), (1, 1), (o, o), False)


def measure_rates(repeats: int = 3) -> dict[str, float]:
    """``{"direct_gflops", "direct_wgrad_gflops", "fft_gflops", "call_overhead_s"}`` of this machine (see
    the module docstring). Complex GEMMs are priced from the real GEMM grids (a complex multiply-add
    is four real ones)."""
    from .direct import DirectConvolution
    from .fft import _fft_flops, rfftn

    blas.limit_openblas_spin()  # as in a net: GEMM workers spinning after the grids would slow the kernels
    rng = np.random.default_rng(0)
    direct_rates = []
    for pass_ in ("fwd", "bwd_weights"):
        seconds = flops = 0.0
        for c, n, k in ((32, 16, 5), (64, 13, 5)):  # 5x5 layers: the kernel variants most small nets use
            g = _geom(c, c, n, k)
            x = rng.standard_normal((32, c, n, n), dtype=np.float32)
            w = rng.standard_normal(g.weight_shape, dtype=np.float32)
            direct = DirectConvolution()
            call = direct.kernel_call(x, w, g, pass_)
            call()  # compile / load the kernel
            seconds += blas.best_time(call, max(repeats, 7))  # ~1 ms a call
            # the multiply-adds the tiles compute (dropped positions and channels included), as priced
            flops += 2.0 * sum(op[1] for op in direct.pass_ops(g, 32, pass_) if op[0] in ("direct", "direct_wgrad"))
        direct_rates.append(flops / seconds / 1e9)

    planes = rng.standard_normal((64, 16, 18, 18), dtype=np.float32)
    t = min(blas.best_time(lambda: rfftn(planes, (18, 18)), repeats) for _ in range(3))
    fft_gflops = 64 * 16 * _fft_flops((18, 18), (18, 18)) / t / 1e9

    return {"direct_gflops": direct_rates[0], "direct_wgrad_gflops": direct_rates[1], "fft_gflops": fft_gflops,
            "call_overhead_s": measure_call_overheads()}


def measure_call_overheads(repeats: int = 10) -> dict[str, dict[str, float]]:
    """``{strategy: {pass: seconds}}`` of one call of every registered strategy on a trivial layer."""
    from .base import get_strategy, strategy_names

    rng = np.random.default_rng(1)
    g = _geom(8, 8, 4, 5)  # 8 channels, 5x5: the kernel variants the rates compiled
    x = rng.standard_normal((1, 8, 4, 4), dtype=np.float32)
    w = rng.standard_normal(g.weight_shape, dtype=np.float32)
    b = np.zeros(8, np.float32)
    dy = rng.standard_normal((1, 8) + g.out_shape, dtype=np.float32)
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
