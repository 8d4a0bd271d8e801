"""Figure 2 of the CcT paper (Omnivore Figure 4): the GEMM of CaffeNet's convolutions vs b_p and threads.

A batch of ``b`` images is convolved by ``b / b_p`` GEMMs of the Type 1 shape
``(o/g, k^2 d/g) x (k^2 d/g, b_p m^2)`` (``b_p = 1`` is Caffe's one-image-at-a-time mode,
``b_p = b`` CcT's whole-batch lowering). For each layer, thread count and ``b_p`` this reports
GFLOPS, the speedup over one thread (Fig. 2a/b) and the lowered matrix's memory footprint
(Fig. 2c). A second table runs ``p`` batch partitions concurrently (Python threads, ``threads/p``
BLAS threads each), and a third times the whole convolution (lowering + GEMM) in Caffe mode,
CcT batched mode and with partitions, through :class:`cct.lowering.partition.BatchedLowering`.

    python benchmarks/bench_batching.py --quick        # smoke run
    python benchmarks/bench_batching.py                # full (b = 256, quiet machine)
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402


def powers_upto(n: int) -> list[int]:
    out, v = [], 1
    while v < n:
        out.append(v)
        v *= 2
    out.append(n)
    return sorted(set(out))


def gemm_calls(a, bmat, c, calls):
    """``calls`` times, one GEMM per group: ``c[g] = a[g] @ bmat[g]``."""
    from cct import blas

    for _ in range(calls):
        for gi in range(a.shape[0]):
            blas.gemm(a[gi], bmat[gi], out=c[gi])


def partition_gemms(a, mats, outs, local_threads, i):
    """Partition ``i``'s GEMMs (with a thread-local BLAS limit when given)."""
    from cct import blas

    with blas.blas_threads(local_threads):
        gemm_calls(a, mats[i], outs[i], 1)


def run_all(pool, fn, parts):
    """Run ``fn(i)`` for every partition concurrently and wait."""
    list(pool.map(fn, range(parts)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small smoke run")
    ap.add_argument("--batch", type=int, default=None, help="images per batch b (default 256, quick 16)")
    ap.add_argument("--layers", default=None,
                    help="comma-separated CaffeNet conv layers (default all; quick conv2,conv5)")
    ap.add_argument("--threads", default=None, help="comma-separated thread counts (default 1,2,4,..,cpus)")
    ap.add_argument("--bp", default=None, help="comma-separated b_p values (default 1,2,4,..,b)")
    ap.add_argument("--blas", choices=("auto", "openblas", "mkl"), default=None)
    ap.add_argument("--no-groups", action="store_true", help="ignore CaffeNet's groups (the paper's Figure 7 sizes)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--skip-conv", action="store_true", help="skip the full-convolution table")
    ap.add_argument("--keep-env", action="store_true", help="keep OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    removed = common.reexec_clean(keep_env=args.keep_env)

    import numpy as np

    from cct import blas
    from cct.lowering import get_strategy
    from cct.lowering.partition import BatchedLowering

    if args.blas:
        blas.set_backend(args.blas)
    rep = common.environment_report(removed)
    common.print_environment(rep)
    cpus = os.cpu_count() or 1
    b = args.batch or (16 if args.quick else 256)
    layers = args.layers.split(",") if args.layers else (["conv2", "conv5"] if args.quick else list(common.CAFFENET))
    threads = [int(t) for t in args.threads.split(",")] if args.threads else powers_upto(cpus)
    bps = [int(v) for v in args.bp.split(",")] if args.bp else powers_upto(b)
    bps = [v for v in bps if b % v == 0]
    repeats = args.repeats or (1 if args.quick else 3)
    peak = {t: common.sgemm_peak(t, size=1024 if args.quick else 2048) for t in threads}
    print("# measured SGEMM peak (GFLOPS): " + ", ".join(f"{t} thr {g:.0f}" for t, g in peak.items()))
    rng = np.random.default_rng(0)

    gemm_rows, gemm_pts = [], []
    for name in layers:
        geom = common.caffenet_geom(name, groups=not args.no_groups)
        g = geom.group
        mg, kd, p = geom.channels_out // g, geom.kernel_dim, geom.out_size
        a = rng.standard_normal((g, mg, kd), dtype=np.float32)
        flops = 2.0 * geom.channels_out * kd * p * b
        for bp in bps:
            bmat = rng.standard_normal((g, kd, bp * p), dtype=np.float32)
            c = np.empty((g, mg, bp * p), np.float32)

            run = functools.partial(gemm_calls, a, bmat, c, b // bp)
            base = None
            for t in threads:
                with blas.blas_threads(t):
                    sec = common.time_call(run, repeats=repeats)["best"]
                gf = flops / sec / 1e9
                base = base or sec
                mem = 4 * geom.channels_in * geom.kernel_size * bp * p
                gemm_pts.append({"layer": name, "b_p": bp, "threads": t, "seconds": sec, "gflops": gf,
                                 "speedup_vs_1_thread": base / sec, "lowered_bytes": mem,
                                 "fraction_of_peak": gf / peak[t]})
                gemm_rows.append([name, bp, t, f"{sec * 1e3:.1f}", f"{gf:.1f}", f"{gf / peak[t]:.0%}",
                                  f"{base / sec:.2f}", f"{mem / 2**20:.1f}"])
    print(f"\nFigure 2: GEMM of {b} images in b/b_p calls (Type 1 shapes)")
    common.print_table(["layer", "b_p", "threads", "ms", "GFLOPS", "%peak", "speedup/1thr", "lowered MiB"], gemm_rows)

    # p concurrent partitions, threads/p BLAS threads each (GEMM only, b_p = b/p)
    tmax = max(threads)
    part_rows, part_pts = [], []
    for name in layers:
        geom = common.caffenet_geom(name, groups=not args.no_groups)
        g = geom.group
        mg, kd, p = geom.channels_out // g, geom.kernel_dim, geom.out_size
        a = rng.standard_normal((g, mg, kd), dtype=np.float32)
        flops = 2.0 * geom.channels_out * kd * p * b
        for parts in [v for v in powers_upto(tmax) if b % v == 0]:
            bp = b // parts
            mats = [rng.standard_normal((g, kd, bp * p), dtype=np.float32) for _ in range(parts)]
            outs = [np.empty((g, mg, bp * p), np.float32) for _ in range(parts)]
            per = max(1, tmax // parts)
            local = blas.supports_thread_local_limits()

            with ThreadPoolExecutor(parts) as pool:
                one = functools.partial(partition_gemms, a, mats, outs, per if local else None)
                run = functools.partial(run_all, pool, one, parts)
                if local:
                    sec = common.time_call(run, repeats=repeats)["best"]
                else:
                    with blas.blas_threads(per):
                        sec = common.time_call(run, repeats=repeats)["best"]
            gf = flops / sec / 1e9
            part_pts.append({"layer": name, "partitions": parts, "threads_per_partition": per, "b_p": bp,
                             "seconds": sec, "gflops": gf})
            part_rows.append([name, parts, per, bp, f"{sec * 1e3:.1f}", f"{gf:.1f}"])
    print(f"\nBatch partitions: p concurrent GEMMs of b/p images, {tmax}/p BLAS threads each "
          f"(thread limits {'per thread' if blas.supports_thread_local_limits() else 'process-wide'})")
    common.print_table(["layer", "p", "thr/part", "b_p", "ms", "GFLOPS"], part_rows)

    conv_rows, conv_pts = [], []
    if not args.skip_conv:
        for name in layers:
            geom = common.caffenet_geom(name, groups=not args.no_groups)
            x = rng.standard_normal((b, geom.channels_in) + geom.in_shape, dtype=np.float32)
            w = (rng.standard_normal(geom.weight_shape, dtype=np.float32) * 0.01).astype(np.float32)
            bias = np.zeros(geom.channels_out, np.float32)
            modes = [("caffe (b_p=1)", BatchedLowering(get_strategy("type1"), batch_partition=1)),
                     (f"cct (b_p={b})", BatchedLowering(get_strategy("type1"), batch_partition=b))]
            for parts in [v for v in powers_upto(tmax) if v > 1 and b % v == 0]:
                modes.append((f"cct p={parts}", BatchedLowering(get_strategy("type1"), batch_partition=b // parts,
                                                                partitions=parts, threads=tmax)))
            for label, strat in modes:
                with blas.blas_threads(tmax):
                    sec = common.time_call(functools.partial(strat.forward, x, w, bias, geom), repeats=repeats)["best"]
                gf = 2.0 * geom.channels_out * geom.kernel_dim * geom.out_size * b / sec / 1e9
                conv_pts.append({"layer": name, "mode": label, "seconds": sec, "gflops": gf})
                conv_rows.append([name, label, f"{sec * 1e3:.1f}", f"{gf:.1f}"])
        print(f"\nWhole convolution forward (lowering + GEMM, type 1), {tmax} threads, b={b}")
        common.print_table(["layer", "mode", "ms", "GFLOPS"], conv_rows)

    path = common.write_json("batching_quick" if args.quick else "batching",
                             {"config": {"batch": b, "layers": layers, "threads": threads, "b_p": bps,
                                         "repeats": repeats, "groups": not args.no_groups},
                              "environment": rep, "sgemm_peak_gflops": peak, "gemm": gemm_pts,
                              "partitions": part_pts, "conv": conv_pts}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
