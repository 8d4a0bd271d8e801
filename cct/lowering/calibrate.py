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
import json
import sys
import time
from collections.abc import Sequence

import numpy as np

from .. import blas
from .cost_model import Machine, nominal_machine

FULL_DIMS = [4, 16, 64, 256, 1024, 4096]
QUICK_DIMS = [8, 64, 512]
_memo: dict[str, Machine] = {}


def _cache_name(threads: int, backend: str) -> str:
    return f"machine-{blas.machine_key()}-{backend}-t{threads}.json"


def _best_time(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _gemm_gflops(m: int, n: int, k: int, repeats: int, rng) -> float:
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    c = np.empty((m, n), np.float32)
    t = _best_time(lambda: blas.gemm(a, b, out=c), repeats)
    return 2.0 * m * n * k / max(t, 1e-9) / 1e9


def _big(m: int, k: int, budget: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, budget / (2.0 * m * k))))


def measure_elementwise(sizes: tuple[int, ...] = (1 << 16, 1 << 20, 1 << 24), repeats: int = 3) -> dict:
    """ns/element of the sweeps the lowerings run, per sweep size (elements, float32).

    ``copy``: a window of 13-wide rows read from 15-wide rows and written through a transposed
    view (as the lowerings and the lifting copy do); ``add``: the same window accumulated into
    a transposed view (lifting); ``zero``: a fill. Returns ``{kind: [(elements, ns), ...]}``.
    """
    curves: dict[str, list[tuple[int, float]]] = {"copy": [], "add": [], "zero": []}
    rng = np.random.default_rng(0)
    for size in sizes:
        planes = max(4, size // 169)
        a, b = 4, max(1, planes // 4)
        src = rng.standard_normal((a, b, 15, 15), dtype=np.float32)
        dst = np.empty((b, a, 13, 13), np.float32).transpose(1, 0, 2, 3)
        acc = np.zeros((b, a, 13, 13), np.float32).transpose(1, 0, 2, 3)
        flat = np.empty(a * b * 169, np.float32)
        n = a * b * 169

        def copy(dst=dst, src=src):
            dst[...] = src[:, :, 1:14, 2:15]

        def add(acc=acc, src=src):
            acc += src[:, :, 2:15, 1:14]

        def zero(flat=flat):
            flat.fill(0)

        for kind, fn in (("copy", copy), ("add", add), ("zero", zero)):
            curves[kind].append((n, _best_time(fn, repeats) / n * 1e9))
    return curves


def calibrate(quick: bool = False, repeats: int | None = None, save: bool = True,
              threads: int | None = None, verbose: bool = False) -> Machine:
    """Measure this machine's cost-model constants (a few seconds; ``quick``: well under one).

    ``threads``: BLAS threads to measure with (default: the current setting). The result is
    cached unless ``save`` is False.
    """
    backend = blas.get_backend()
    rng = np.random.default_rng(0)
    dims = QUICK_DIMS if quick else FULL_DIMS
    repeats = repeats if repeats is not None else (1 if quick else 3)
    budget = 2e7 if quick else 2e8
    lo, hi = (256, 8192) if quick else (2048, 65536)
    t0 = time.perf_counter()
    with blas.blas_threads(threads):
        nthreads = blas.get_num_threads()
        bign = [[_gemm_gflops(m, _big(m, k, budget, lo, hi), k, repeats, rng) for k in dims] for m in dims]
        bigk = [[_gemm_gflops(m, n, _big(m, n, budget, lo, hi), repeats, rng) for n in dims] for m in dims]
        ref_big = _big(256, 256, budget, lo, hi)
        ref = _gemm_gflops(256, ref_big, 256, repeats, rng)
        curve = []
        for big in ((32, 256, ref_big) if quick else (16, 64, 256, 1024, 4096, ref_big)):
            curve.append((int(big), min(1.0, _gemm_gflops(256, big, 256, repeats, rng) / ref)))
        small = np.ones((2, 2), np.float32)
        overhead = _best_time(lambda: blas.gemm(small, small), 20)
    ew = measure_elementwise((1 << 14, 1 << 18) if quick else (1 << 14, 1 << 17, 1 << 20, 1 << 23, 1 << 25),
                             repeats)
    info = blas.blas_info()
    machine = Machine(grid_dims=list(dims), gemm_bign=bign, gemm_bigk=bigk, big_curve=curve,
                      copy_ns=ew["copy"][-1][1], add_ns=ew["add"][-1][1], zero_ns=ew["zero"][-1][1],
                      elem_curves=ew,
                      gemm_overhead_s=overhead, threads=int(nthreads), backend=backend,
                      kernel=str(info.get("architecture") or ""), key=blas.machine_key(),
                      info={"quick": quick, "seconds": time.perf_counter() - t0, "measured_at": time.time(),
                            "blas": info})
    if verbose:
        print(summary(machine))
    if save and not quick:
        try:
            blas.write_cache(_cache_name(machine.threads, backend), machine.to_json())
        except OSError:
            pass
    _memo[_cache_name(machine.threads, backend)] = machine
    return machine


def load_machine(measure_if_missing: bool = True, threads: int | None = None) -> Machine:
    """The cached Machine for this machine/backend/thread count; measured (and cached) if absent.

    With ``measure_if_missing=False`` a missing cache gives :func:`nominal_machine` instead.
    """
    backend = blas.get_backend()
    n = threads if threads is not None else blas.get_num_threads()
    name = _cache_name(n, backend)
    if name in _memo:
        return _memo[name]
    cached = blas.read_cache(name)
    if cached is not None:
        try:
            m = Machine.from_json(cached)
            _memo[name] = m
            return m
        except (TypeError, ValueError):
            pass
    if not measure_if_missing:
        return nominal_machine()
    return calibrate(threads=threads)


def summary(machine: Machine) -> str:
    """A short table of the measured constants."""
    dims = machine.grid_dims
    lines = [f"machine {machine.key} backend {machine.backend} kernel {machine.kernel or '-'} "
             f"threads {machine.threads}" + (" (nominal)" if machine.nominal else "")]
    lines.append("GEMM GFLOPS, big N (rows M, cols K): " + " ".join(f"{d:>6}" for d in dims))
    for d, row in zip(dims, machine.gemm_bign):
        lines.append(f"  M={d:<6}" + " ".join(f"{v:6.1f}" for v in row))
    lines.append("GEMM GFLOPS, big K (rows M, cols N): " + " ".join(f"{d:>6}" for d in dims))
    for d, row in zip(dims, machine.gemm_bigk):
        lines.append(f"  M={d:<6}" + " ".join(f"{v:6.1f}" for v in row))
    lines.append("small-N factor: " + ", ".join(f"{b}:{f:.2f}" for b, f in machine.big_curve))
    for kind in ("copy", "add", "zero"):
        curve = machine.elem_curves.get(kind) or [(0, getattr(machine, kind + "_ns"))]
        lines.append(f"{kind:>4} ns/elem by sweep size: " + ", ".join(f"{n:.3g}:{v:.3f}" for n, v in curve))
    lines.append(f"GEMM call overhead {machine.gemm_overhead_s * 1e6:.1f} us")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``cct calibrate``: measure the BLAS backends and the lowering cost model, print, cache."""
    ap = argparse.ArgumentParser(prog="cct calibrate", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="coarse, sub-second measurement (not cached)")
    ap.add_argument("--threads", type=int, default=None, help="BLAS threads to calibrate for")
    ap.add_argument("--blas", choices=("auto", "openblas", "mkl"), default=None, help="BLAS backend")
    ap.add_argument("--show", action="store_true", help="print the cached constants, measure nothing")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args(list(argv) if argv is not None else None)
    if args.blas is not None:
        if args.blas == "auto":
            blas.choose_backend(force=not args.show)
        blas.set_backend(args.blas)
    elif not args.show:
        blas.calibrate(force=True)
    if args.show:
        m = load_machine(measure_if_missing=False, threads=args.threads)
    else:
        m = calibrate(quick=args.quick, threads=args.threads)
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
