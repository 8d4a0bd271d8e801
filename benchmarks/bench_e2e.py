"""End-to-end training iteration speed: cct vs cct in Caffe-style mode (vs PyTorch if installed).

For each model (synthetic data, TRAIN phase) one SGD iteration = forward + backward + update,
timed through ``cct.solver``; then a per-layer forward/backward breakdown, the GFLOPS achieved by
the convolution and inner-product layers, and both as a fraction of this machine's SGEMM peak
measured in the same run.

    python benchmarks/bench_e2e.py --quick             # LeNet b64, cifar10_quick b100, CaffeNet b16
    python benchmarks/bench_e2e.py                     # + CaffeNet b64 and b256
    python benchmarks/bench_e2e.py --models caffenet --batch 64 --torch

Modes: ``cct`` (cost-model lowering choice with its close calls measured, as ``cct train`` plans;
whole-batch lowering) and ``caffe`` (type 1 lowering,
one image per GEMM: how BVLC Caffe runs on the CPU). ``--torch`` adds PyTorch's CPU training
step for the same models (if ``import torch`` works). ``--caffe BIN`` (or ``$CAFFE_BIN``) adds BVLC
Caffe's ``caffe time`` on the same synthetic nets, in the same run: its ``Average Forward-Backward``
(no solver update, so the comparison leans Caffe's way). No Caffe code ships with cct: build BVLC
Caffe (CPU_ONLY) or install a distribution's package and pass its binary. The benchmark re-executes itself without
OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE (see common.py) and reports the BLAS kernel that ran.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from common import (
    ROOT,
    caffe_line,
    caffe_report,
    environment_report,
    print_environment,
    print_table,
    reexec_clean,
    set_threads,
    sgemm_peak,
    write_json,
)

MODELS = {
    # name: (prototxt relative to the repo, data shape without batch, classes)
    "lenet": ("models/lenet/lenet_train_test.prototxt", (1, 28, 28), 10),
    "cifar10_quick": ("models/cifar10_quick/cifar10_quick_train_test.prototxt", (3, 32, 32), 10),
    "caffenet": ("models/caffenet/train_val.prototxt", (3, 227, 227), 1000),
}
DEFAULT_BATCH = {"lenet": 64, "cifar10_quick": 100, "caffenet": 64}


def synthetic_net_param(model: str, batch: int):
    """The model's TRAIN net with its data layers replaced by an Input layer of ``batch`` images."""
    from cct.io.prototxt import read_net_prototxt
    from cct.proto import caffe_pb2

    path, shape, _ = MODELS[model]
    src = read_net_prototxt(ROOT / path)
    out = caffe_pb2.NetParameter()
    out.name = src.name
    out.state.phase = caffe_pb2.TRAIN
    data_done = False
    for lp in src.layer:
        if lp.type in ("Data", "ImageData", "HDF5Data", "DummyData", "Input"):
            if data_done or any(r.phase == caffe_pb2.TEST for r in lp.include):
                continue
            data_done = True
            layer = out.layer.add(name=lp.name, type="Input")
            layer.top.extend(lp.top[:2])
            layer.input_param.shape.add().dim.extend((batch,) + shape)
            layer.input_param.shape.add().dim.extend((batch,))
            continue
        if any(r.phase == caffe_pb2.TEST for r in lp.include):
            continue
        out.layer.add().CopyFrom(lp)
    return out


def build_solver(model: str, batch: int):
    import numpy as np

    from cct.proto import caffe_pb2
    from cct.solver import get_solver

    sp = caffe_pb2.SolverParameter()
    sp.net_param.CopyFrom(synthetic_net_param(model, batch))
    sp.base_lr, sp.momentum, sp.weight_decay, sp.lr_policy = 0.001, 0.9, 5e-4, "fixed"
    sp.max_iter, sp.display, sp.random_seed = 1000000, 0, 1
    sp.snapshot_after_train = False
    sp.solver_mode = caffe_pb2.SolverParameter.CPU
    solver = get_solver(sp)
    net = solver.net
    rng = np.random.default_rng(0)
    data, label = net.input_blob_names[:2]
    net.blobs[data].data[...] = rng.standard_normal(net.blobs[data].shape, dtype=np.float32)
    net.blobs[label].data[...] = rng.integers(0, MODELS[model][2], size=net.blobs[label].shape)
    return solver


def gemm_flops(net) -> dict[str, float]:
    """Per layer: multiply-add FLOPs (x2) of one forward + the backward passes the net runs."""
    out = {}
    for i, layer in enumerate(net.layers):
        fwd = 0.0
        if layer.type in ("Convolution", "Deconvolution"):
            g = layer.geom
            fwd = 2.0 * layer.num * g.channels_out * g.kernel_dim * g.out_size
        elif layer.type == "InnerProduct":
            fwd = 2.0 * layer.M * layer.K * layer.num_output
        if not fwd:
            continue
        bwd = 0.0
        if net.layer_need_backward[i]:
            bwd += fwd if layer.param_propagate_down and layer.param_propagate_down[0] else 0.0
            bwd += fwd if any(net.bottom_need_backward[i]) else 0.0
        out[layer.name] = fwd + bwd
    return out


def per_layer_times(net, repeats: int) -> list[tuple[str, str, float, float]]:
    fwd = {n: [] for n in net.layer_names}
    bwd = {n: [] for n in net.layer_names}
    for _ in range(repeats):
        for i, name in enumerate(net.layer_names):
            t0 = time.perf_counter()
            net.forward_from_to(i, i)
            fwd[name].append(time.perf_counter() - t0)
        for i in range(len(net.layers) - 1, -1, -1):
            t0 = time.perf_counter()
            net.backward_from_to(i, i)
            bwd[net.layer_names[i]].append(time.perf_counter() - t0)
    return [(n, l.type, statistics.median(fwd[n]), statistics.median(bwd[n])) for n, l in zip(net.layer_names,
                                                                                              net.layers)]


def conv_plans(net) -> dict[str, str]:
    """Per conv layer: the lowering and its batching (``type1 p=2 b_p=8``)."""
    out = {}
    for layer in net.layers:
        if layer.type not in ("Convolution", "Deconvolution"):
            continue
        low = layer.lowering
        plan = low.plan(layer.geom, layer.num) if hasattr(low, "plan") else {"p": 1, "b_p": layer.num}
        out[layer.name] = f"{low.name} p={plan['p']} b_p={plan['b_p']}"
    return out


def run_cct(model: str, batch: int, mode: str, iters: int, breakdown: bool) -> dict:
    from cct.lowering import engine

    engine.configure(mode=mode, tune=True)  # as `cct train` plans: close calls measured on the layer (cached)
    solver = build_solver(model, batch)
    solver.step(2)  # warm-up: planning, JIT compiles, allocation
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        solver.step(1)
        ts.append(time.perf_counter() - t0)
    t = statistics.median(ts)
    flops = gemm_flops(solver.net)
    res = {"model": model, "batch": batch, "mode": mode, "iter_s": t, "img_s": batch / t,
           "gemm_gflop_per_iter": sum(flops.values()) / 1e9}
    if breakdown:
        layers = per_layer_times(solver.net, max(2, iters // 2))
        res["layers"] = [{"name": n, "type": ty, "fwd_ms": f * 1e3, "bwd_ms": b * 1e3,
                          "gflops": (flops.get(n, 0.0) / (f + b) / 1e9) if flops.get(n) else None}
                         for n, ty, f, b in layers]
        conv_t = sum(f + b for n, ty, f, b in layers if ty == "Convolution")
        conv_f = sum(flops.get(n, 0.0) for n, ty, f, b in layers if ty == "Convolution")
        res["conv_gflops"] = conv_f / conv_t / 1e9 if conv_t else None
        res["conv_time_frac"] = conv_t / sum(f + b for _, _, f, b in layers)
    res["iter_gflops"] = sum(flops.values()) / t / 1e9
    res["plans"] = conv_plans(solver.net)
    res["load_avg"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    solver.net.close()
    return res


# -- PyTorch baseline (optional) ----------------------------------------------------------------
def torch_model(model: str):
    import torch.nn as nn

    if model == "lenet":
        return nn.Sequential(nn.Conv2d(1, 20, 5), nn.MaxPool2d(2, 2), nn.Conv2d(20, 50, 5), nn.MaxPool2d(2, 2),
                             nn.Flatten(), nn.Linear(800, 500), nn.ReLU(), nn.Linear(500, 10))
    if model == "cifar10_quick":
        return nn.Sequential(nn.Conv2d(3, 32, 5, padding=2), nn.MaxPool2d(3, 2, ceil_mode=True), nn.ReLU(),
                             nn.Conv2d(32, 32, 5, padding=2), nn.ReLU(), nn.AvgPool2d(3, 2, ceil_mode=True),
                             nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.AvgPool2d(3, 2, ceil_mode=True),
                             nn.Flatten(), nn.Linear(64 * 4 * 4, 64), nn.Linear(64, 10))
    lrn = nn.LocalResponseNorm(5, alpha=1e-4, beta=0.75)
    return nn.Sequential(
        nn.Conv2d(3, 96, 11, stride=4), nn.ReLU(), nn.MaxPool2d(3, 2), lrn,
        nn.Conv2d(96, 256, 5, padding=2, groups=2), nn.ReLU(), nn.MaxPool2d(3, 2), nn.LocalResponseNorm(5, 1e-4, 0.75),
        nn.Conv2d(256, 384, 3, padding=1), nn.ReLU(), nn.Conv2d(384, 384, 3, padding=1, groups=2), nn.ReLU(),
        nn.Conv2d(384, 256, 3, padding=1, groups=2), nn.ReLU(), nn.MaxPool2d(3, 2), nn.Flatten(),
        nn.Linear(9216, 4096), nn.ReLU(), nn.Dropout(), nn.Linear(4096, 4096), nn.ReLU(), nn.Dropout(),
        nn.Linear(4096, 1000))


def run_torch(model: str, batch: int, iters: int) -> dict | None:
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(os.cpu_count() or 1)
    net = torch_model(model)
    opt = torch.optim.SGD(net.parameters(), lr=0.001, momentum=0.9, weight_decay=5e-4)
    x = torch.randn((batch,) + MODELS[model][1])
    y = torch.randint(0, MODELS[model][2], (batch,))
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        opt.zero_grad()
        loss_fn(net(x), y).backward()
        opt.step()

    for _ in range(2):
        step()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t0)
    t = statistics.median(ts)
    return {"model": model, "batch": batch, "mode": f"pytorch {torch.__version__}", "iter_s": t, "img_s": batch / t}


# -- BVLC Caffe baseline (optional) ------------------------------------------------------------
_CAFFE_FB = re.compile(r"Average Forward-Backward: ([\d.]+) ms")


def parse_caffe_time(log: str) -> float | None:
    """Seconds per forward+backward from a ``caffe time`` log (None if the line is missing)."""
    m = _CAFFE_FB.search(log)
    return float(m.group(1)) / 1e3 if m else None


def run_caffe_time(binary: str, model: str, batch: int, iters: int) -> dict:
    """``caffe time`` on the same synthetic TRAIN net (Input layers): forward + backward, no update."""
    from google.protobuf import text_format

    with tempfile.TemporaryDirectory(prefix="cct-caffe-time-") as tmp:
        net = os.path.join(tmp, f"{model}_b{batch}.prototxt")
        with open(net, "w") as f:
            f.write(text_format.MessageToString(synthetic_net_param(model, batch)))
        out = subprocess.run([binary, "time", f"--model={net}", f"--iterations={iters}"], capture_output=True,
                             text=True, env=dict(os.environ, GLOG_logtostderr="1"))
    t = parse_caffe_time(out.stderr)
    if out.returncode != 0 or t is None:
        raise SystemExit(f"caffe time on {model} b{batch} failed (rc {out.returncode}):\n{out.stderr[-2000:]}")
    return {"model": model, "batch": batch, "mode": "bvlc caffe (fwd+bwd)", "iter_s": t, "img_s": batch / t}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller CaffeNet batch (16), fewer iterations")
    ap.add_argument("--models", default="lenet,cifar10_quick,caffenet")
    ap.add_argument("--batch", type=int, default=None, help="one batch size for every model")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--modes", default="cct,caffe")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--torch", action="store_true", help="also time PyTorch's CPU training step")
    ap.add_argument("--caffe", default=os.environ.get("CAFFE_BIN"),
                    help="a BVLC caffe binary: add its `caffe time` on the same nets (default $CAFFE_BIN)")
    ap.add_argument("--keep-env", action="store_true", help="keep OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE")
    args = ap.parse_args(argv)
    removed = reexec_clean(keep_env=args.keep_env)
    set_threads(args.threads)
    env = environment_report(removed)
    print_environment(env)
    peak = sgemm_peak(args.threads)
    print(f"# measured SGEMM peak: {peak:.1f} GFLOPS")
    caffe = caffe_report(args.caffe) if args.caffe else None
    if caffe:
        print(caffe_line(caffe))

    runs = []
    for model in args.models.split(","):
        batches = [args.batch] if args.batch else [DEFAULT_BATCH[model]]
        if model == "caffenet" and not args.batch:
            batches = [16] if args.quick else [64, 256]
        for batch in batches:
            iters = args.iters or (3 if args.quick or model == "caffenet" else 10)
            for mode in args.modes.split(","):
                r = run_cct(model, batch, mode, iters, breakdown=(mode == "cct"))
                runs.append(r)
                print(f"# {model} b{batch} {mode}: {r['img_s']:.1f} img/s", file=sys.stderr)
            if args.torch:
                r = run_torch(model, batch, iters)
                if r is None:
                    print("# --torch: PyTorch is not installed; skipped", file=sys.stderr)
                else:
                    runs.append(r)
            if caffe:
                r = run_caffe_time(args.caffe, model, batch, iters if model == "caffenet" else max(iters, 20))
                flops = next((x["gemm_gflop_per_iter"] for x in runs if x["model"] == model and x["batch"] == batch
                              and "gemm_gflop_per_iter" in x), None)
                if flops:
                    r["iter_gflops"] = flops / r["iter_s"]
                runs.append(r)

    rows = []
    for r in runs:
        frac = r.get("iter_gflops", 0) / peak if r.get("iter_gflops") else None
        conv = r.get("conv_gflops")
        rows.append([r["model"], r["batch"], r["mode"], r["iter_s"] * 1e3, r["img_s"], r.get("iter_gflops"),
                     frac, conv / peak if conv else None, r.get("conv_time_frac")])
    print_table(["model", "batch", "mode", "ms/iter", "img/s", "GFLOPS", "of peak", "conv of peak",
                 "conv time"], rows)
    for r in runs:
        if "layers" in r:
            print(f"\nper-layer breakdown: {r['model']} batch {r['batch']} ({r['mode']}); "
                  + "; ".join(f"{k}: {v}" for k, v in r.get("plans", {}).items()))
            print_table(["layer", "type", "fwd ms", "bwd ms", "GFLOPS"],
                        [[x["name"], x["type"], x["fwd_ms"], x["bwd_ms"], x["gflops"]] for x in r["layers"]])
    for r in runs:
        if r["mode"].startswith("bvlc caffe"):
            mine = next((x for x in runs if x["model"] == r["model"] and x["batch"] == r["batch"]
                         and x["mode"] == "cct"), None)
            if mine:
                print(f"# {r['model']} b{r['batch']}: cct iteration (with update) {r['iter_s'] / mine['iter_s']:.2f}x "
                      "faster than BVLC Caffe's forward+backward (without)")
    path = write_json("bench_e2e_quick" if args.quick else "bench_e2e",
                      {"environment": env, "sgemm_peak_gflops": peak, "runs": runs, "caffe": caffe})
    print(f"\nwrote {path}; load average now {os.getloadavg() if hasattr(os, 'getloadavg') else '?'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
