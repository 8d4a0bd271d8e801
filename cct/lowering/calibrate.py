"""Measure the machine constants of the lowering cost model once, and cache them.

``calibrate()`` times, with the current BLAS backend and thread count:

* GEMM throughput on two grids of matrix aspects (see :class:`cct.lowering.cost_model.Machine`),
  each point best-of-``repeats``, with at most ~``flop_budget`` flops per GEMM;
* a small-"big"-dimension correction curve (the thin GEMMs of Caffe's one-image-at-a-time mode);
* the element-wise sweeps the lowerings run: strided window copies (lowering), strided
  accumulation (lifting), zero fills.

The result is cached as JSON in the user cache dir (``$CCT_CACHE_DIR``, ``$XDG_CACHE_HOME/cct``
or ``~/.cache/cct``), keyed by :func:`cct.blas.machine_key`, the backend and the thread count;
``load_machine()`` reads it (measuring when missing). ``cct calibrate`` runs :func:`main`.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from .. import blas, kernels
from ..config import current
from ..errors import CctError
from ..flags import FlagParser, add_progress_flag, command_parser
from ..progress import Progress
from . import type1
from .cost_model import Machine, detect_cache_bytes, nominal_machine
from .direct import DirectConvolution
from .geometry import ConvGeometry
from .im2col import col2im
from .rates import DIRECT_K3_LAYERS, RATES_VERSION, direct_rate, measure_rates, overhead_layer
from .type2 import Type2Lowering

FULL_DIMS = [4, 16, 64, 256, 1024, 4096]
QUICK_DIMS = [8, 64, 512]
# sweep sizes (elements) of the element-wise curves and (d, batch) points of the lowering curves
FULL_ELEM_SIZES = (1 << 14, 1 << 17, 1 << 20, 1 << 23, 1 << 25)
FULL_LOWERING_SIZES = ((32, 4), (256, 16), (512, 32))
# the first run drops the largest sweep (128 MB arrays, beyond every cache: its rate is the 32 MB one's)
FIRST_ELEM_SIZES = FULL_ELEM_SIZES[:-1]


@dataclass(frozen=True)
class CalibrationLevel:
    """How much :func:`calibrate` measures: the GEMM grid, its sweeps and sizes, the element-wise
    and lowering curves, and whether the result is cached."""

    name: str
    dims: tuple[int, ...]
    passes: int  # sweeps over both GEMM grids, each point keeping its best
    repeats: int  # timed calls per GEMM point (best of)
    budget: float  # multiply-adds per timed GEMM of the grids, within [lo, hi] for the big dimension
    lo: int
    hi: int
    bigs: tuple[int, ...]  # the small-"big"-dimension correction curve
    elem_sizes: tuple[int, ...]
    lowering_sizes: tuple[tuple[int, int], ...]
    cached: bool
    curve_passes: int = 2  # passes over the lowering curves' points, each keeping its best


LEVELS = {
    # coarse and sub-second, never cached: tests and `cct calibrate --quick`
    "quick": CalibrationLevel("quick", tuple(QUICK_DIMS), 1, 1, 2e7, 256, 8192, (32, 256),
                              (1 << 14, 1 << 18), ((16, 2), (64, 8)), False, 1),
    # the first run on a new machine: the full grid once, with smaller products (a few seconds)
    "first": CalibrationLevel("first", tuple(FULL_DIMS), 1, 2, 1e8, 256, 32768, (16, 64, 256, 1024),
                              FIRST_ELEM_SIZES, FULL_LOWERING_SIZES, True, 1),
    # `cct calibrate`: three sweeps over the full grid at full size
    "full": CalibrationLevel("full", tuple(FULL_DIMS), 3, 2, 2e8, 512, 65536, (16, 64, 256, 1024, 4096),
                             FULL_ELEM_SIZES, FULL_LOWERING_SIZES, True),
}
def _memo() -> dict[str, Machine]:
    """The calibrated machines of the current configuration (:class:`cct.config.PlanningCaches`)."""
    return current().caches.machines

log = logging.getLogger("cct")


def _cache_name(threads: int, backend: str) -> str:
    return f"machine-{blas.machine_key()}-{backend}-t{threads}.json"


_best_time = blas.best_time  # the timer of the element-wise and lowering curves


#: flops of one GEMM from which a grid point is timed once (after its warm-up call) whatever the level's
#: repeats: such a call lasts 15-120 ms, long enough to average out what a repeat would, and the grid's
#: three largest points were three quarters of a first-run level's GEMM work (96 GFLOP a thread count)
ONE_TIMING_FLOPS = 2e9


def _gemm_gflops(m: int, n: int, k: int, repeats: int, pool: blas.OperandPool | None = None) -> float:
    return blas.gemm_gflops([(m, n, k)], repeats=1 if 2.0 * m * n * k >= ONE_TIMING_FLOPS else repeats,
                            operands=pool, backend=blas.get_backend())


def _big(m: int, k: int, budget: float, lo: int, hi: int) -> int:
    return _unaliased(int(min(hi, max(lo, budget / (2.0 * m * k)))))


def _unaliased(n: int) -> int:
    """``n``, or 16 less when ``n`` float32 elements span a multiple of 1 KiB. The grids' operands are
    contiguous, so their long dimension is their row stride, and rows a multiple of 1 KiB apart
    share cache sets: OpenBLAS ran 16x64 @ 64xN at 157 GFLOPS for N = 65536 and 276 for N = 60000
    (a 2-core Zen 5). A conv layer's ``b * P`` columns rarely alias so (P = 169, 729, 3025...)."""
    return n - 16 if n > 16 and (4 * n) % 1024 == 0 else n


#: bumped when the sweep or lowering curves change what they measure (2: the stream and sum sweeps, in
#: passes; curves timed on the Machine's own kernel thread count; 3: the lowering curves in passes; 4: copy
#: curves on transposes of two about equal axes; 5: im2col/col2im run in pieces on cct's kernel threads); a
#: cached Machine from before is re-measured on load
CURVES_VERSION = 5
#: bumped when the GEMM grids change what they measure (2: long dimensions that do not alias, see
#: :func:`_unaliased`); a cached Machine from before is calibrated anew on load
GRID_VERSION = 2
#: the element-wise sweep kinds :func:`measure_elementwise` measures (a cached Machine missing one is
#: re-measured)
ELEM_KINDS = ("copy", "stream", "add", "sum", "zero")


def measure_elementwise(sizes: tuple[int, ...] = (1 << 16, 1 << 20, 1 << 24), repeats: int = 3,
                        passes: int = 3) -> dict:
    """ns/element of the sweeps the lowerings run, per sweep size (elements, float32).

    ``copy``: a window of 13-wide rows read from 15-wide rows and written through a transposed
    view (as the lowerings and the lifting copy do); ``stream``: whole 169-element planes copied
    through the same transposed view (long contiguous runs: a channel-major transpose, an
    unpadded plane). Both transposes swap two axes of about equal length (batch and channels are
    both tens to hundreds): a swap with one short axis stays in a few cache lines and ran 3-5x
    faster than the transposes the lowerings do; ``add``: the window accumulated into a transposed
    view (lifting); ``sum``: a per-channel reduction (a bias gradient); ``zero``: a fill.
    ``passes`` sweeps over all sizes and kinds, each point keeping its best (a burst of load spoils
    one pass, not the curve). Returns
    ``{kind: [(elements, ns), ...]}``.
    """
    cases = []  # filled with ones, not random numbers: drawing them cost more than the sweeps
    for size in sizes:
        planes = max(4, size // 169)
        a = max(2, int(round(planes ** 0.5)))
        b = max(1, planes // a)
        src = np.ones((a, b, 15, 15), np.float32)
        dst = np.empty((b, a, 13, 13), np.float32).transpose(1, 0, 2, 3)
        acc = np.zeros((b, a, 13, 13), np.float32).transpose(1, 0, 2, 3)
        plane = src[:, :, 1:14, 1:14].copy()
        flat = np.empty(a * b * 169, np.float32)

        def copy(dst=dst, src=src):
            dst[...] = src[:, :, 1:14, 2:15]

        def stream(dst=dst, plane=plane):
            dst[...] = plane

        def add(acc=acc, src=src):
            acc += src[:, :, 2:15, 1:14]

        def reduce(plane=plane):
            plane.sum(axis=(0, 2, 3))

        def zero(flat=flat):
            flat.fill(0)

        cases.append((a * b * 169, dict(zip(ELEM_KINDS, (copy, stream, add, reduce, zero)))))
    best: dict[tuple[str, int], float] = {}
    for _ in range(max(1, passes)):
        for i, (n, fns) in enumerate(cases):
            for kind, fn in fns.items():
                t = _best_time(fn, repeats) / n * 1e9
                best[kind, i] = min(best.get((kind, i), t), t)
    return {kind: [(n, best[kind, i]) for i, (n, _) in enumerate(cases)] for kind in ELEM_KINDS}


def _calib_geom(d: int, n: int = 13, k: int = 3, pad: int = 1):
    m = n + 2 * pad - k + 1
    return ConvGeometry(channels_in=d, channels_out=d, group=1, in_shape=(n, n), kernel=(k, k), pad=(pad, pad),
                        stride=(1, 1), dilation=(1, 1), out_shape=(m, m), bias_term=True)


def measure_lowerings(sizes: tuple[tuple[int, int], ...] = ((32, 4), (256, 16), (512, 32)),
                      repeats: int = 3, passes: int = 2) -> dict:
    """ns per lowered element of each lowering's own replication (``lower``) and its adjoint
    (``unlower``), timed on the real implementations at 13x13 / 3x3 / pad 1 for ``(d, batch)``
    sizes, each point the best of ``passes`` passes over all of them (a first pass alone ran the
    smallest point 1.3x slow). Returns ``{lowering: {"lower": [(elements, ns)], "unlower": [...]}}``."""
    runs = [_measure_lowerings_once(sizes, repeats) for _ in range(max(1, passes))]
    return {t: {k: [(e, min(r[t][k][i][1] for r in runs)) for i, (e, _) in enumerate(curve)]
                for k, curve in kinds.items()} for t, kinds in runs[0].items()}


def _measure_lowerings_once(sizes: tuple[tuple[int, int], ...], repeats: int) -> dict:
    out: dict[str, dict[str, list]] = {"type1": {"lower": [], "unlower": []}, "type2": {"lower": [], "unlower": []}}
    s2 = Type2Lowering()
    for d, b in sizes:
        g = _calib_geom(d)
        x = np.ones((b, d) + g.in_shape, np.float32)  # the values do not change a copy's speed
        # type 1 (im2col over the batch, col2im for the data gradient)
        elems = d * g.kernel_size * b * g.out_size
        out["type1"]["lower"].append((elems, _best_time(lambda g=g, x=x: type1.Type1Lowering.lower(x, g),
                                                        repeats) / elems * 1e9))
        dcol = np.ones((d,) + g.kernel + (b,) + g.out_shape, np.float32)
        view = type1._col_buffer_view(dcol, 2) if hasattr(type1, "_col_buffer_view") else dcol
        out["type1"]["unlower"].append((elems, _best_time(
            lambda g=g, v=view: col2im(v, g.in_shape, g.kernel, g.pad, g.stride, g.dilation), repeats) / elems * 1e9))
        # type 2 (lowered along the width)
        ext = tuple((o - 1) * st + (kk - 1) * dl + 1 for o, st, kk, dl in zip(g.out_shape, g.stride, g.kernel,
                                                                             g.dilation))
        e2 = d * g.kernel[1] * b * ext[0] * g.out_shape[1]
        out["type2"]["lower"].append((e2, _best_time(
            lambda g=g, x=x, ext=ext: s2._lower(s2._padded_input(x, g, ext), g), repeats) / e2 * 1e9))
        dd = np.ones((d, g.kernel[1], b, ext[0], g.out_shape[1]), np.float32)
        out["type2"]["unlower"].append((e2, _best_time(lambda g=g, dd=dd, b=b: s2._unlower(dd, g, b), repeats)
                                        / e2 * 1e9))
    return out


#: what a calibration compiles, as jobs for :func:`precompile_kernels`, dealt out round-robin (the first
#: share to the calibrating process itself, which has numba loaded already): the direct kernels' forward and
#: data-gradient passes on the call-overhead layer, type 1's im2col and col2im, the direct weight gradient,
#: and the kernels nearly every net trains with, which would otherwise compile one after another on its
#: first iteration (MAX pooling's 2x2/2 forward and backward, the in-place ReLU and the SGD update).
#: Compiled alone on a 2-core Zen 3, fresh interpreter each: 2.05 s (im2col), 2.29, 1.67, 1.78 and 1.65 s,
#: and 2.75 s for the direct passes while they included the 3x3 forward variant (now deferred,
#: :data:`DEFERRED_RATES`); importing cct and numba takes a worker ~1 s more.
WARM_JOBS = ("direct:fwd", "type1:lower", "direct:wgrad", "type1:unlower", "train:pool", "train:elementwise")


def warm_kernel(job: str) -> None:
    """Run, once and on small inputs, the compiled kernels that calibration's ``job`` (one of
    :data:`WARM_JOBS`) times, with the argument types it times them with: numba compiles them into its
    on-disk cache, where the calibrating process finds them."""
    if job not in WARM_JOBS:
        raise CctError(f"unknown kernel warm-up job {job!r} (one of {', '.join(WARM_JOBS)})")
    if job.startswith("train:"):
        _warm_training_kernels(job)
        return
    if job.startswith("type1:"):
        g = _calib_geom(16)
        if job == "type1:lower":
            type1.Type1Lowering.lower(np.ones((2, 16) + g.in_shape, np.float32), g)
        else:
            dcol = np.ones((16,) + g.kernel + (2,) + g.out_shape, np.float32)
            col2im(type1._col_buffer_view(dcol, 2), g.in_shape, g.kernel, g.pad, g.stride, g.dilation)
        return

    x, w, b, dy, g = overhead_layer()  # the passes as measure_call_overheads runs them
    if job == "direct:wgrad":
        DirectConvolution().backward_weights(dy, x, g)
        return
    DirectConvolution().forward(x, w, b, g)
    DirectConvolution().backward_data(dy, w, g)


def _warm_training_kernels(job: str) -> None:
    """The layer and solver kernels of ``job`` called as the layers and the SGD solver call them
    (C-contiguous float32 blobs, int32 argmax indices)."""
    x = np.ones((2, 2, 4, 4), np.float32)
    if job == "train:elementwise":
        ke, ku = kernels.get("elementwise"), kernels.get("update")
        g = np.ones_like(x)
        ke.relu_forward(x, g)
        ke.relu_backward(x, g, g)  # an in-place ReLU: dx is dy
        ku.sgd_l2(x, g, np.zeros_like(x), 5e-4, 0.01, 0.9)
        return
    kp = kernels.get("pooling")
    best, arg = np.empty((2, 2, 2, 2), np.float32), np.empty((2, 2, 2, 2), np.int32)
    kp.max_forward(x, best, arg, (2, 2), (0, 0), (2, 2))
    kp.max_backward(best, arg, np.empty_like(x), (2, 2), (0, 0), (2, 2))


def precompile_kernels(jobs: Sequence[str] = WARM_JOBS, processes: int | None = None) -> float:
    """Compile the kernels of ``jobs`` (:func:`warm_kernel`) on every core, dealt out round-robin: the first
    share in this process, the others in worker processes; returns the seconds it took. Compiling is
    single-threaded and most of a first calibration. Nothing is done (0.0) on one core, with the compiled
    kernels off, or when this process has done it already. The workers are fresh interpreters running
    this module's :func:`warm_kernel` (not ``multiprocessing``, which would re-run a calling script that
    lacks a ``__main__`` guard); they write into numba's on-disk cache, where this process finds them."""
    n = min(len(jobs), processes or os.cpu_count() or 1)
    runtime = kernels.RUNTIME  # compiled code lives in the process: so does the note that it was compiled
    if runtime.precompiled or n < 2 or not kernels.enabled():
        return 0.0
    import subprocess
    from pathlib import Path

    runtime.precompiled = True
    t0 = time.perf_counter()
    root = str(Path(__file__).resolve().parents[2])  # the directory that holds this cct package
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))))
    code = "import sys; from cct.lowering.calibrate import warm_kernel; [warm_kernel(j) for j in sys.argv[1:]]"
    failed = "precompiling calibration kernels failed (they compile as they are timed): %s"
    workers = []
    try:
        workers = [subprocess.Popen([sys.executable, "-c", code, *jobs[i::n]], env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for i in range(1, n)]
    except OSError as e:
        log.debug(failed, e)
    try:
        for job in jobs[0::n]:
            warm_kernel(job)
    except Exception as e:  # noqa: BLE001 - a kernel that fails here fails again, with its error, when timed
        log.debug(failed, e)
    for w in workers:
        _, err = w.communicate()
        if w.returncode:
            log.debug(failed, err.decode(errors="replace")[-500:])
    return time.perf_counter() - t0


def calibrate(quick: bool = False, repeats: int | None = None, save: bool = True,
              threads: int | None = None, verbose: bool = False, passes: int | None = None,
              progress: Progress | None = None, level: str | None = None) -> Machine:
    """Measure this machine's cost-model constants and cache them (unless ``save`` is False).

    ``level``: one of :data:`LEVELS` -- ``"full"`` (the default, ``cct calibrate``), ``"first"``
    (what a first run on a new machine measures: a few seconds) or ``"quick"`` (coarse,
    sub-second, never cached; also ``quick=True``). ``repeats``/``passes`` override the level's;
    ``threads``: BLAS threads to measure with (default: the current setting); ``progress``:
    advanced per measured GEMM point and kernel sweep.
    """
    name = "quick" if quick else (level or "full")
    if name not in LEVELS:
        raise CctError(f"unknown calibration level {name!r} (one of {', '.join(LEVELS)})")
    lv = LEVELS[name]
    backend = blas.get_backend()
    dims = list(lv.dims)
    repeats = repeats if repeats is not None else lv.repeats
    n_passes = passes if passes is not None else lv.passes
    t0 = time.perf_counter()
    compiled = precompile_kernels() if lv.cached else 0.0
    blas.limit_openblas_spin()  # measure as a net runs: idle GEMM workers must not spin into the sweeps
    pool = blas.OperandPool()
    with blas.blas_threads(threads):
        nthreads = blas.get_num_threads()
        # Several passes over both grids, keeping each point's best: a load burst from another
        # process then spoils one pass of a point, not the point.
        bign = [[0.0] * len(dims) for _ in dims]
        bigk = [[0.0] * len(dims) for _ in dims]
        tick = progress.update if progress is not None else (lambda n=1: None)
        if progress is not None:
            progress.set_total(n_passes * len(dims) ** 2 + len(lv.bigs) + 3)

        def big(m: int, d: int) -> int:
            return _big(m, d, lv.budget, lv.lo, lv.hi)

        for _ in range(n_passes):
            for i, m in enumerate(dims):
                for j, d in enumerate(dims):
                    bign[i][j] = max(bign[i][j], _gemm_gflops(m, big(m, d), d, repeats, pool))
                    bigk[i][j] = max(bigk[i][j], _gemm_gflops(m, d, big(m, d), repeats, pool))
                    tick()
        ref_big = big(256, 256)
        ref = _gemm_gflops(256, ref_big, 256, repeats, pool)
        curve = []
        for b in (*map(_unaliased, lv.bigs), ref_big):
            curve.append((int(b), min(1.0, _gemm_gflops(256, b, 256, repeats, pool) / ref)))
            tick()
        del pool
        small = np.ones((2, 2), np.float32)
        overhead = _best_time(lambda: blas.gemm(small, small), 20)
    with _threads(threads):
        ew = _sweeps_measured(lv, backend) or measure_elementwise(lv.elem_sizes, repeats, passes=min(2, n_passes))
        tick()
        lw = measure_lowerings(lv.lowering_sizes, repeats, lv.curve_passes)
        tick()
    info = blas.blas_info()
    machine = Machine(grid_dims=list(dims), gemm_bign=bign, gemm_bigk=bigk, big_curve=curve,
                      copy_ns=ew["copy"][-1][1], add_ns=ew["add"][-1][1], zero_ns=ew["zero"][-1][1],
                      elem_curves=ew, lowering_curves=lw,
                      gemm_overhead_s=overhead, cache_bytes=detect_cache_bytes(), threads=int(nthreads),
                      backend=backend,
                      kernel=str(info.get("architecture") or ""), key=blas.machine_key(),
                      info={"quick": lv.name == "quick", "level": lv.name, "seconds": time.perf_counter() - t0,
                            "measured_at": time.time(), "blas": info, "precompile_seconds": compiled,
                            "curves_version": CURVES_VERSION,
                            "grid_version": GRID_VERSION})
    _add_rates(machine)
    machine.info["seconds"] = time.perf_counter() - t0
    if verbose:
        print(summary(machine))
    return _store(machine, backend, save and lv.cached)


def _sweeps_measured(level: CalibrationLevel, backend: str) -> dict | None:
    """The element-wise curves of a Machine this process measured already (another thread count) at
    ``level`` or a more thorough one: numpy's sweeps run on one thread whatever the BLAS or kernel
    thread count, so a second calibration reuses them (a first run calibrates two counts)."""
    rank = list(LEVELS)
    for m in _memo().values():
        lvl = m.info.get("level", "full")
        if (m.backend == backend and m.key == blas.machine_key() and lvl in rank and level.name in rank
                and rank.index(lvl) >= rank.index(level.name) and m.info.get("curves_version") == CURVES_VERSION
                and set(ELEM_KINDS) <= set(m.elem_curves)):
            return {k: list(v) for k, v in m.elem_curves.items()}
    return None


#: rates a first-run calibration leaves for the first layer that needs them (:func:`ensure_kernel_width_rate`):
#: the 3x3 forward rate compiles a forward driver of its own, ~1.5 s of a first run that LeNet never needs
DEFERRED_RATES = ("direct_k3_gflops",)


def _add_rates(machine: Machine) -> Machine:
    """Measure the direct, FFT and complex-GEMM rates into ``machine`` (:mod:`cct.lowering.rates`), on
    its own BLAS and kernel thread counts; a first-run level leaves :data:`DEFERRED_RATES` for later."""
    first = machine.info.get("level") == "first"
    with _threads(machine.threads):
        for key, value in measure_rates(kernel_widths=not first).items():
            setattr(machine, key, value if isinstance(value, dict) else float(value))
    machine.info = dict(machine.info, rates_version=RATES_VERSION, deferred_rates=list(DEFERRED_RATES) if first else [])
    return machine


def ensure_kernel_width_rate(machine: Machine, geom: ConvGeometry) -> Machine:
    """``machine``, with the direct kernels' 3x3 forward rate measured into it now if a first-run
    calibration deferred it and ``geom`` needs it (a kernel other than 5 wide: the direct pricing's
    kernel-width term, :meth:`~cct.lowering.cost_model.Machine.direct_seconds`). The process's cached
    machine is written back to the cache with it; a trial one (``calibrate(save=False)``) is not."""
    deferred = machine.info.get("deferred_rates") or []
    if "direct_k3_gflops" not in deferred or geom.kernel[-1] == 5:
        return machine

    t0 = time.perf_counter()
    with _threads(machine.threads):
        machine.direct_k3_gflops = float(direct_rate("fwd", DIRECT_K3_LAYERS))
    machine.info = dict(machine.info, deferred_rates=[r for r in deferred if r != "direct_k3_gflops"])
    log.info("Measured the direct kernels' 3x3 forward rate (threads: %d), which the first-run calibration "
             "left for the first layer that needs it: %.0f GFLOPS in %.1f s", machine.threads,
             machine.direct_k3_gflops, time.perf_counter() - t0)
    if _memo().get(_cache_name(machine.threads, machine.backend)) is machine:
        _store(machine, machine.backend, True)
    return machine


def recalibrate_kernels(threads: int | None = None, repeats: int = 2, save: bool = True) -> Machine:
    """Re-measure only the element-wise and lowering curves of the cached Machine for ``threads``
    (after the copy/lowering kernels changed), keeping its GEMM grids; a full :func:`calibrate` if
    none is cached. ``cct calibrate --kernels``."""
    backend = blas.get_backend()
    with blas.blas_threads(threads):
        cached = blas.read_cache(_cache_name(blas.get_num_threads(), backend))
    if not cached:
        return calibrate(threads=threads, save=save)
    return _store(_remeasure_curves(Machine.from_json(cached), repeats), backend, save)


def _remeasure_curves(machine: Machine, repeats: int = 2) -> Machine:
    """``machine`` with its element-wise and lowering curves measured anew, on its own thread count."""
    with _threads(machine.threads):
        ew = measure_elementwise(FULL_ELEM_SIZES, repeats)
        lw = measure_lowerings(FULL_LOWERING_SIZES, repeats)
    machine.elem_curves, machine.lowering_curves = ew, lw
    machine.copy_ns, machine.add_ns, machine.zero_ns = ew["copy"][-1][1], ew["add"][-1][1], ew["zero"][-1][1]
    machine.info = dict(machine.info, kernels_measured_at=time.time(), curves_version=CURVES_VERSION)
    return machine


@contextlib.contextmanager
def _threads(n: int | None) -> Iterator[None]:
    """BLAS *and* compiled-kernel threads limited to ``n`` (None: all): the lowering curves time the
    im2col/col2im kernels, which run on the kernel threads (:func:`cct.kernels.launch`)."""
    with blas.blas_threads(n), kernels.num_threads(n):
        yield


def _store(machine: Machine, backend: str, save: bool) -> Machine:
    """Remember ``machine`` for this process and (``save``) in the user cache; returns it."""
    if save:
        try:
            blas.write_cache(_cache_name(machine.threads, backend), machine.to_json())
        except OSError:
            pass
    _memo()[_cache_name(machine.threads, backend)] = machine
    return machine


def remember(machine: Machine) -> Machine:
    """Make ``machine`` the current configuration's machine for its thread count and backend (not saved)."""
    return _store(machine, machine.backend, False)


def load_machine(measure_if_missing: bool = True, threads: int | None = None) -> Machine:
    """The cached Machine for this machine/backend/thread count; measured (and cached) if absent.

    With ``measure_if_missing=False`` a missing cache gives :func:`nominal_machine` instead.
    """
    backend = blas.get_backend()
    n = threads if threads is not None else blas.get_num_threads()
    name = _cache_name(n, backend)
    memo = _memo()
    if name in memo:
        return memo[name]
    cached = blas.read_cache(name)
    m, outdated = None, False
    if cached is not None:
        try:
            m = Machine.from_json(cached)
        except (TypeError, ValueError, KeyError, AttributeError):
            m = None
        if m is not None and measure_if_missing and m.info.get("grid_version", 1) != GRID_VERSION:
            m, outdated = None, True  # grids measured the way an older cct did: calibrated anew below
        if m is not None:
            stale = m.info.get("rates_version", 1) != RATES_VERSION  # cached by an older cct's kernels
            if measure_if_missing and (stale or not (m.direct_gflops and m.call_overhead_s)):
                return _store(_add_rates(m), backend, True)
            if measure_if_missing and m.info.get("curves_version", 1) != CURVES_VERSION:
                return _store(_remeasure_curves(m), backend, True)
            memo[name] = m
            return m
    if not outdated and (blas.cache_dir() / name).exists():
        log.warning("The calibration cache %s is unreadable; %s", blas.cache_dir() / name,
                    "measuring again" if measure_if_missing else "using the nominal cost model")
    if not measure_if_missing:
        return nominal_machine()
    log.info("Calibrating the lowering cost model for this machine (%s, %d BLAS threads): first-run level, "
             "cached in %s (cct calibrate measures the full grid)", backend, n, blas.cache_dir())
    m = calibrate(threads=threads, level="first")
    log.info("Calibrated in %.1f s", m.info["seconds"])
    return m


def summary(machine: Machine) -> str:
    """A short table of the measured constants."""
    dims = machine.grid_dims
    lines = [f"machine {machine.key} backend {machine.backend} kernel {machine.kernel or '-'} "
             f"threads {machine.threads}" + (" (nominal)" if machine.nominal else
                                          f" (level {machine.info.get('level', 'full')})")]
    lines.append("GEMM GFLOPS, big N (rows M, cols K): " + " ".join(f"{d:>6}" for d in dims))
    for d, row in zip(dims, machine.gemm_bign):
        lines.append(f"  M={d:<6}" + " ".join(f"{v:6.1f}" for v in row))
    lines.append("GEMM GFLOPS, big K (rows M, cols N): " + " ".join(f"{d:>6}" for d in dims))
    for d, row in zip(dims, machine.gemm_bigk):
        lines.append(f"  M={d:<6}" + " ".join(f"{v:6.1f}" for v in row))
    lines.append("small-N factor: " + ", ".join(f"{b}:{f:.2f}" for b, f in machine.big_curve))
    for kind in ELEM_KINDS:
        curve = machine.elem_curves.get(kind) or [(0, getattr(machine, kind + "_ns", 0.0))]
        lines.append(f"{kind:>6} ns/elem by sweep size: " + ", ".join(f"{n:.3g}:{v:.3f}" for n, v in curve))
    for name, curves in sorted(machine.lowering_curves.items()):
        for kind, curve in sorted(curves.items()):
            lines.append(f"{name} {kind} ns/lowered elem: " + ", ".join(f"{n:.3g}:{v:.3f}" for n, v in curve))
    lines.append(f"direct kernels GFLOPS: forward {machine.direct_gflops:.0f} (3x3: {machine.direct_k3_gflops:.0f}), "
                 f"weight gradient {machine.direct_wgrad_gflops:.0f}; FFT GFLOPS: forward {machine.fft_gflops:.1f} "
                 f"(36-point planes: {machine.fft_large_gflops:.1f}), inverse {machine.ifft_gflops:.1f}")
    lines.append(f"GEMM call overhead {machine.gemm_overhead_s * 1e6:.1f} us, per batch chunk "
                 f"{machine.chunk_overhead_s * 1e6:.1f} us, per batch partition "
                 f"{machine.partition_overhead_s * 1e6:.1f} us")
    for name, passes in sorted((machine.call_overhead_s or {}).items()):
        lines.append(f"{name} call overhead (us): " + ", ".join(f"{p} {v * 1e6:.0f}" for p, v in passes.items()))
    return "\n".join(lines)


def build_parser() -> FlagParser:
    """The flags of ``cct calibrate``."""
    ap = command_parser("calibrate", __doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="coarse, sub-second measurement (not cached)")
    ap.add_argument("--threads", type=int, default=None, help="BLAS threads to calibrate for")
    ap.add_argument("--blas", choices=("auto", "openblas", "mkl"), default=None, help="BLAS backend")
    ap.add_argument("--show", action="store_true", help="print the cached constants, measure nothing")
    ap.add_argument("--kernels", action="store_true",
                    help="re-measure only the copy/lowering curves, keep the cached GEMM grids")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_progress_flag(ap)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """``cct calibrate`` as a program: parse ``argv`` (default ``sys.argv``) and :func:`run`."""
    return run(build_parser().parse_args(list(argv) if argv is not None else None))


def run(args: argparse.Namespace) -> int:
    """``cct calibrate``: measure the BLAS backends and the lowering cost model, print, cache."""
    if args.blas is not None:
        if args.blas == "auto":
            blas.choose_backend(force=not args.show)
        blas.set_backend(args.blas)
    elif not args.show and not args.kernels:
        blas.calibrate(force=True)
    if args.show:
        m = load_machine(measure_if_missing=False, threads=args.threads)
    elif args.kernels:
        m = recalibrate_kernels(threads=args.threads)
    else:
        with Progress(None, "calibrate", unit="step", enabled=args.progress) as bar:
            m = calibrate(quick=args.quick, threads=args.threads, progress=bar)
    if args.json:
        print(json.dumps(m.to_json(), indent=1))
    else:
        print(blas.describe())
        print(summary(m))
        if not args.quick and not args.show:
            print(f"cached in {blas.cache_dir()}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
