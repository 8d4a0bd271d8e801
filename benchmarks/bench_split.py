"""CcT Appendix B / Figure 9 on two CPU devices: time per iteration vs the share p, and the overlap of
gradient aggregation with backward (Le et al., Table 3 style).

    python benchmarks/bench_split.py --quick           # smoke: batch 8 conv1, CaffeNet batch 4, 5 shares
    python benchmarks/bench_split.py                   # full: batch 32 conv1, CaffeNet batch 16, p step 0.05
    python benchmarks/bench_split.py --pair homo       # two OpenBLAS devices (default: heterogeneous if possible)
    python benchmarks/bench_split.py --devices gpu:0,cpu:0:threads=16   # a GPU beside the host CPU

Devices: ``cpu:0`` = numpy's OpenBLAS with 1 thread, ``cpu:1`` = MKL with 1 thread (``--pair hetero``,
needs per-thread backend selection in cct.blas), or two 1-thread OpenBLAS devices (``--pair homo``).
p is the fraction of every split layer's batch given to ``cpu:0``; p = 1 and p = 0 are the single
devices alone. The FLOPS heuristic's p comes from the concurrent SGEMM probe (``auto``) and from
the theoretical peaks (``peak``). Re-executes itself without OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE
unless ``--keep-env`` (see benchmarks/README.md); prints the kernels that ran; writes
``results/bench_split[_quick].json``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from common import ROOT, environment_report, print_environment, print_table, reexec_clean, write_json  # noqa: E402

import cct  # noqa: E402
from cct import scheduler  # noqa: E402
from cct.io.prototxt import read_net_prototxt  # noqa: E402
from cct.paths import shared_path  # noqa: E402
from cct.proto import caffe_pb2  # noqa: E402
from cct.scheduler.devices import per_thread_blas_supported  # noqa: E402
from cct.scheduler.split import ShareTable, shares_to_counts  # noqa: E402

CAFFENET_DEPLOY = str(shared_path("caffe-models", "bvlc_reference_caffenet", "deploy.prototxt"))


def caffenet_param(batch: int, conv1_only: bool = False) -> caffe_pb2.NetParameter:
    """CaffeNet (deploy) with a label input and SoftmaxWithLoss, gaussian fillers; or just conv1."""
    path = CAFFENET_DEPLOY if os.path.exists(CAFFENET_DEPLOY) else os.path.join(
        ROOT, "models", "bvlc_reference_caffenet", "deploy.prototxt")
    src = read_net_prototxt(path)
    out = caffe_pb2.NetParameter(name=src.name, force_backward=conv1_only)
    for lp in src.layer:
        if lp.type == "Input":
            inp = out.layer.add(name="data", type="Input", top=["data", "label"])
            inp.input_param.shape.add(dim=[batch, 3, 227, 227])
            inp.input_param.shape.add(dim=[batch])
            continue
        if lp.type == "Softmax":
            out.layer.add(name="loss", type="SoftmaxWithLoss", bottom=[lp.bottom[0], "label"], top=["loss"])
            continue
        new = out.layer.add()
        new.CopyFrom(lp)
        for field in ("convolution_param", "inner_product_param"):
            if new.HasField(field):
                getattr(new, field).weight_filler.type = "gaussian"
                getattr(new, field).weight_filler.std = 0.01
        if conv1_only and lp.name == "conv1":
            out.layer.add(name="silence", type="Silence", bottom=["label"])
            break
    return out


def build_net(batch: int, conv1_only: bool) -> cct.Net:
    cct.set_random_seed(1)
    net = cct.Net(caffenet_param(batch, conv1_only), cct.TRAIN)
    rng = np.random.default_rng(0)
    net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].shape).astype(np.float32)
    net.blobs["label"].data[...] = rng.integers(0, 1000, net.blobs["label"].shape)
    return net


SYNC: list = []  # devices to synchronize before each clock reading (GPUs run asynchronously)


def _sync() -> None:
    for d in SYNC:
        d.synchronize()


def iteration(net: cct.Net, lr: float = 1e-4, update: bool = True) -> dict:
    """One training iteration: forward, backward (with aggregation), SGD update; seconds per phase."""
    net.clear_param_diffs()
    _sync()
    t0 = time.perf_counter()
    net.forward()
    _sync()
    t1 = time.perf_counter()
    net.backward()
    _sync()
    t2 = time.perf_counter()
    if update:
        for p in net.learnable_params:
            p.data -= lr * p.diff
    _sync()
    t3 = time.perf_counter()
    return {"forward": t1 - t0, "backward": t2 - t1, "update": t3 - t2, "total": t3 - t0}


def time_shares(net: cct.Net, ex, p: float, iters: int, warmup: int = 1) -> dict:
    ex.shares = ShareTable([p, 1.0 - p])
    for _ in range(warmup):
        iteration(net, update=False)
    ts = [iteration(net, update=False)["total"] for _ in range(iters)]
    return {"p": p, "median_s": statistics.median(ts), "best_s": min(ts), "runs": ts}


def sweep(name: str, net: cct.Net, cfg, ps: list[float], heuristics: dict, iters: int) -> dict:
    batch = net.blobs["data"].shape[0]
    ex = cfg.attach(net)
    try:
        points: dict[float, dict] = {}
        by_counts: dict[tuple, dict] = {}
        for p in sorted(set(ps) | set(heuristics.values())):
            counts = tuple(shares_to_counts([p, 1.0 - p], batch))
            if counts not in by_counts:  # shares that give the same images per device: measure once
                by_counts[counts] = time_shares(net, ex, p, iters)
            points[p] = dict(by_counts[counts], p=p, images=list(counts))
    finally:
        scheduler.detach(net)
    best_p = min(points, key=lambda q: points[q]["median_s"])
    best = points[best_p]["median_s"]
    names = [d.name for d in cfg.devices]
    alone = {f"{names[0]} alone (p=1)": points[1.0]["median_s"], f"{names[1]} alone (p=0)": points[0.0]["median_s"]}
    fastest_alone = min(alone.values())
    rows = []
    for p, r in points.items():
        tags = [k for k, v in heuristics.items() if v == p]
        rows.append([f"{p:.3f}", "/".join(map(str, r["images"])), r["median_s"] * 1e3, r["best_s"] * 1e3,
                     fastest_alone / r["median_s"],
                     ",".join(tags) + ("  <- best" if p == best_p else "")])
    print(f"\n## {name}: time per iteration (forward + backward) vs p = share of {names[0]}")
    print_table(["p", "images", "median ms", "best ms", "speedup vs fastest alone", "note"], rows)
    summary = {"best_p": best_p, "best_s": best, "fastest_alone_s": fastest_alone}
    for k, p in heuristics.items():
        t = points[p]["median_s"]
        summary[k] = {"p": p, "time_s": t, "vs_best": t / best, "within_5pct": t <= 1.05 * best,
                      "speedup_vs_fastest_alone": fastest_alone / t, "faster_than_fastest_alone": t < fastest_alone}
        print(f"# {k} heuristic p={p:.3f}: {t * 1e3:.1f} ms = {t / best:.3f}x the best swept share "
              f"({'within' if t <= 1.05 * best else 'NOT within'} 5%), {fastest_alone / t:.2f}x the faster "
              f"device alone")
    return {"points": list(points.values()), "summary": summary}


def overlap(net: cct.Net, cfg, p: float, iters: int) -> dict:
    """Per-phase times with the aggregation overlapped (default) and inline after each layer, with the
    fc layers split by output channels (auto) and by batch (never: full-size fc gradients to aggregate)."""
    out = {}
    for fc in ("auto", "never"):
        for mode in ("overlapped", "inline"):
            ex = cfg.attach(net)
            ex.overlap = mode == "overlapped"
            ex.model_parallel = fc
            ex.shares = ShareTable([p, 1.0 - p])
            try:
                iteration(net)
                ex.reset_stats()
                phases = [iteration(net) for _ in range(iters)]
                st = ex.stats
            finally:
                scheduler.detach(net)
            med = {k: statistics.median(ph[k] for ph in phases) for k in phases[0]}
            n = max(1, st.iterations)
            out[f"fc model_parallel={fc}, {mode}"] = {
                "forward_s": med["forward"], "backward_s": med["backward"], "update_s": med["update"],
                "total_s": med["total"], "aggregation_s": st.aggregation_s / n,
                "aggregation_not_hidden_s": st.aggregation_wait_s / n,
                "aggregation_hidden_s": st.aggregation_hidden_s / n if mode == "overlapped" else 0.0}
    rows = [[m, r["forward_s"] * 1e3, r["backward_s"] * 1e3, r["aggregation_s"] * 1e3,
             r["aggregation_hidden_s"] * 1e3, r["aggregation_not_hidden_s"] * 1e3, r["update_s"] * 1e3,
             r["total_s"] * 1e3] for m, r in out.items()]
    print(f"\n## Overlap of gradient aggregation with backward (CaffeNet, p={p:.3f}; ms per iteration)")
    print("# backward includes the inline aggregation (inline) or the wait for what was not hidden (overlapped)")
    print_table(["run", "forward", "backward", "aggregation", "hidden", "not hidden", "update", "total"], rows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short smoke run")
    ap.add_argument("--keep-env", action="store_true", help="keep OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE")
    ap.add_argument("--pair", choices=("auto", "hetero", "homo"), default="auto")
    ap.add_argument("--devices", default=None,
                    help="the two devices to split over, e.g. gpu:0,cpu:0:threads=16 (overrides --pair)")
    ap.add_argument("--conv-batch", type=int, default=None)
    ap.add_argument("--net-batch", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--skip-net", action="store_true", help="only the conv1 sweep")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    removed = reexec_clean(keep_env=args.keep_env)
    cct.init_log(level=40)

    quick = args.quick
    conv_batch = args.conv_batch or (8 if quick else 32)
    net_batch = args.net_batch or (4 if quick else 16)
    iters = args.iters or (2 if quick else 5)
    ps = [0.0, 0.25, 0.5, 0.75, 1.0] if quick else [round(0.05 * i, 2) for i in range(21)]

    pair = args.pair
    note = None
    if pair == "auto":
        pair = "hetero" if per_thread_blas_supported() and cct.blas.mkl_available() else "homo"
        if pair == "homo":
            note = ("heterogeneous pair unavailable: cct.blas has no per-thread backend selection "
                    "(set_thread_backend), so a device cannot run MKL while the other runs OpenBLAS")
    specs = ["cpu:0:blas=openblas:threads=1",
             "cpu:1:blas=mkl:threads=1" if pair == "hetero" else "cpu:1:blas=openblas:threads=1"]
    if args.devices:
        specs, pair, note = args.devices, "custom", None
    rep = environment_report(removed)
    print_environment(rep)
    if note:
        print(f"# NOTE: {note}")
    cfg = scheduler.make_config(specs, [0.5, 0.5])
    if len(cfg.devices) != 2:
        raise SystemExit(f"bench_split needs exactly two devices, got {[d.name for d in cfg.devices]}")
    SYNC[:] = [d for d in cfg.devices if d.kind == "gpu"]
    try:
        gflops = scheduler.probe(cfg.devices, force=True)
        peaks = [scheduler.peak_gflops(d) for d in cfg.devices]
        devinfo = [dict(d.info(), measured_gflops=g, peak_gflops=pk) for d, g, pk in zip(cfg.devices, gflops, peaks)]
        for d in devinfo:
            print(f"# {d['name']}: blas={d['blas']} kernel={d['kernel'][:40]} threads={d['threads']} "
                  f"probe {d['measured_gflops']:.1f} GFLOPS (concurrent), peak {d['peak_gflops'] or 0:.0f}")
        heur = {"auto": round(gflops[0] / sum(gflops), 3)}
        if all(peaks):
            heur["peak"] = round(peaks[0] / sum(peaks), 3)
        result = {"environment": rep, "pair": pair, "note": note, "devices": devinfo, "heuristics": heur,
                  "quick": quick, "conv_batch": conv_batch, "net_batch": net_batch, "iters": iters}
        conv = build_net(conv_batch, conv1_only=True)
        result["conv1"] = sweep(f"CaffeNet conv1, batch {conv_batch}", conv, cfg, ps, heur, iters)
        del conv
        if not args.skip_net:
            net = build_net(net_batch, conv1_only=False)
            net_ps = [0.0, 0.5, 1.0] if quick else ps
            result["caffenet"] = sweep(f"CaffeNet end-to-end, batch {net_batch}", net, cfg, net_ps, heur, iters)
            result["overlap"] = overlap(net, cfg, heur["auto"], iters)
    finally:
        cfg.close()
    path = write_json("bench_split_quick" if quick else "bench_split", result, args.out)
    print(f"\n# wrote {path}")


if __name__ == "__main__":
    main()
