"""Training step on one GPU: cct (eager and CUDA graphs, FP32 and TF32) vs PyTorch (FP32, its TF32 defaults,
and its step captured as a CUDA graph), side by side in one run.

    python benchmarks/bench_gpu.py                                  # lenet b64, cifar10_quick b100, caffenet b64
    python benchmarks/bench_gpu.py --models caffenet --batch 256 --rounds 3 --iters 10

Each model's TRAIN net with an Input layer of random images (as bench_e2e.py); one step = forward, backward and
the SGD update (momentum 0.9, weight decay 5e-4, fixed rate). Every implementation is set up once per model; then
``--rounds`` rounds each time ``--iters`` steps of every implementation in turn (the GPU synchronized around each
step) and keep the median; the table shows the median over rounds. Rows:

* ``cct eager``: each layer's kernels issued from Python (``--nograph``), FP32;
* ``cct graphs``: the iteration replayed as CUDA graphs (cct's default on a GPU), FP32, and with ``--tf32``;
* ``pytorch FP32``: eager, cuDNN with TF32 off for convolutions and matmuls;
* ``pytorch default``: eager, PyTorch's defaults (TF32 convolutions, FP32 matmuls);
* ``pytorch graph``: the FP32 step captured whole with ``torch.cuda.graph`` -- the launch-free ceiling.

Also: the GPU's SGEMM rate (CuPy float32 matmul, 8192^3) measured in the same run and each cct row's GEMM
FLOPS as a fraction of it, and the kernel nodes in cct's graphs per step. Writes ``results/bench_gpu.json``.
Needs CuPy and a GPU (``pip install cct[gpu]``); PyTorch is optional.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_e2e import DEFAULT_BATCH, MODELS, gemm_flops, synthetic_net_param, torch_model  # noqa: E402
from common import print_table, write_json  # noqa: E402

Stepper = tuple[str, Callable[[], None], dict]


def gpu_sgemm_gflops(n: int = 8192, repeats: int = 5) -> float:
    import cupy

    a = cupy.random.standard_normal((n, n), dtype=cupy.float32)
    b = cupy.random.standard_normal((n, n), dtype=cupy.float32)
    a @ b
    cupy.cuda.Device().synchronize()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        cupy.cuda.Device().synchronize()
        ts.append(time.perf_counter() - t0)
    return 2.0 * n ** 3 / min(ts) / 1e9


def cct_stepper(model: str, batch: int, graphs: bool, tf32: bool) -> Stepper:
    import cupy
    import numpy as np

    from cct.config import using_config
    from cct.proto import caffe_pb2
    from cct.solver import get_solver

    sp = caffe_pb2.SolverParameter()
    sp.net_param.CopyFrom(synthetic_net_param(model, batch))
    sp.base_lr, sp.momentum, sp.weight_decay, sp.lr_policy = 0.001, 0.9, 5e-4, "fixed"
    sp.max_iter, sp.display, sp.random_seed = 1000000, 0, 1
    sp.snapshot_after_train = False
    sp.solver_mode = caffe_pb2.SolverParameter.GPU  # device_id 0: the net lives on the GPU
    t0 = time.perf_counter()
    with using_config(gpu={"graphs": graphs, "tf32": tf32}):
        solver = get_solver(sp)
    net = solver.net
    data, label = net.input_blob_names[:2]
    rng = np.random.default_rng(0)
    net.blobs[data].data[...] = cupy.asarray(rng.standard_normal(net.blobs[data].shape, dtype=np.float32))
    net.blobs[label].data[...] = cupy.asarray(rng.integers(0, MODELS[model][2], size=net.blobs[label].shape))
    solver.step(3)  # warm-up, capture
    cupy.cuda.Device().synchronize()
    info = {"setup_s": time.perf_counter() - t0, "flops": sum(gemm_flops(net).values()),
            "graph_nodes": solver.graph_nodes() if hasattr(solver, "graph_nodes") else None}
    name = f"cct {'graphs' if graphs else 'eager'} {'TF32' if tf32 else 'FP32'}"
    return name, lambda: solver.step(1), info


def torch_steppers(model: str, batch: int) -> list[Stepper]:
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    dev = torch.device("cuda:0")
    torch.backends.cudnn.benchmark = True
    x = torch.randn((batch,) + MODELS[model][1], device=dev)
    y = torch.randint(0, MODELS[model][2], (batch,), device=dev)
    loss_fn = torch.nn.CrossEntropyLoss()
    fp32 = {"conv": False, "matmul": False}
    default = {"conv": True, "matmul": False}

    def make(precision: dict):
        net = torch_model(model).to(dev)
        opt = torch.optim.SGD(net.parameters(), lr=0.001, momentum=0.9, weight_decay=5e-4)

        def step():
            torch.backends.cudnn.allow_tf32 = precision["conv"]
            torch.backends.cuda.matmul.allow_tf32 = precision["matmul"]
            opt.zero_grad(set_to_none=False)
            loss_fn(net(x), y).backward()
            opt.step()

        for _ in range(3):
            step()
        return net, opt, step

    out: list[Stepper] = []
    version = torch.__version__
    _, _, step_fp32 = make(fp32)
    out.append((f"pytorch {version} FP32", step_fp32, {}))
    _, _, step_default = make(default)
    out.append((f"pytorch {version} default (TF32 conv)", step_default, {}))
    # the whole FP32 step captured once and replayed (torch.cuda.graphs' recipe: warm up on a side stream)
    net, opt, step = make(fp32)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=False)
    with torch.cuda.graph(graph):
        loss_fn(net(x), y).backward()
        opt.step()
    out.append((f"pytorch {version} graph FP32", graph.replay, {}))
    return out


def time_steps(step: Callable[[], None], sync: Callable[[], None], iters: int) -> float:
    ts = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="lenet,cifar10_quick,caffenet")
    ap.add_argument("--batch", type=int, default=None, help="default: each model's own (64, 100, 64)")
    ap.add_argument("--iters", type=int, default=20, help="steps per round (median)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over all implementations (median of medians)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import cupy

    import cct
    from cct.blas import cpu_model

    cct.init_log(level=40)
    from cct.lowering.tune import device_name

    name = device_name(cupy)  # device 0, the one the resident nets use
    peak = gpu_sgemm_gflops()
    host = cpu_model()
    print(f"# GPU: {name}; CuPy {cupy.__version__}; measured SGEMM {peak:.0f} GFLOPS; host CPU: {host}")
    sync = cupy.cuda.Device().synchronize
    rows, results = [], []
    for model in args.models.split(","):
        batch = args.batch or DEFAULT_BATCH[model]
        steppers = [cct_stepper(model, batch, graphs=False, tf32=False),
                    cct_stepper(model, batch, graphs=True, tf32=False),
                    cct_stepper(model, batch, graphs=True, tf32=True)] + torch_steppers(model, batch)
        times: dict[str, list[float]] = {s[0]: [] for s in steppers}
        for _ in range(args.rounds):
            for impl, step, _info in steppers:
                times[impl].append(time_steps(step, sync, args.iters))
        base = statistics.median(times[steppers[0][0]])
        torch_fp32 = next((statistics.median(v) for k, v in times.items() if k.endswith(" FP32")
                           and k.startswith("pytorch") and "graph" not in k), None)
        for impl, _step, info in steppers:
            t = statistics.median(times[impl])
            gflops = info["flops"] / t / 1e9 if "flops" in info else None
            r = {"model": model, "batch": batch, "impl": impl, "iter_s": t, "round_medians_s": times[impl],
                 "img_s": batch / t, "vs_cct_eager": base / t,
                 "vs_pytorch_fp32": (torch_fp32 / t) if torch_fp32 else None,
                 "gflops": gflops, "of_sgemm": gflops / peak if gflops else None,
                 "graph_nodes": info.get("graph_nodes"), "setup_s": info.get("setup_s")}
            results.append(r)
            rows.append([model, batch, impl, t * 1e3, r["img_s"],
                         f"{r['vs_pytorch_fp32']:.2f}x" if r["vs_pytorch_fp32"] else "",
                         f"{100 * r['of_sgemm']:.1f}%" if r["of_sgemm"] else "",
                         r["graph_nodes"] if r["graph_nodes"] is not None else ""])
        del steppers
    print_table(["model", "batch", "implementation", "ms/step (median)", "img/s", "vs PyTorch FP32", "of SGEMM",
                 "graph nodes"], rows)
    path = write_json("bench_gpu", {"gpu": name, "host_cpu": host, "sgemm_gflops": peak, "rounds": args.rounds,
                                    "iters": args.iters, "results": results}, args.out)
    print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
