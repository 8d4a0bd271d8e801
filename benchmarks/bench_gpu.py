"""Training step on one GPU: cct (net resident on the GPU, CuPy + cuBLAS) vs PyTorch CUDA, same run.

    python benchmarks/bench_gpu.py                                  # lenet, cifar10_quick, caffenet
    python benchmarks/bench_gpu.py --models caffenet --batch 128 --iters 10

Each model's TRAIN net with an Input layer of random images (as bench_e2e.py); one step = forward,
backward and the SGD update (momentum 0.9, weight decay 5e-4); the GPU is synchronized around each
timed step; the median of ``--iters`` steps after two warm-up steps. cct runs twice: every conv layer
on type 1 (the default), and with each layer's strategy measured on the GPU at setup
(``EngineConfig(tune_device=True)``, ``CCT_TUNE_DEVICE=1``; the setup time includes measuring). The
SGEMM rate of the GPU is measured in the same run (CuPy float32 matmul, 8192^3). Writes
``results/bench_gpu.json``.
Needs CuPy and a GPU (``pip install cct[gpu]``); PyTorch is optional.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_e2e import DEFAULT_BATCH, MODELS, gemm_flops, synthetic_net_param, torch_model  # noqa: E402
from common import print_table, write_json  # noqa: E402


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


def run_cct(model: str, batch: int, iters: int, tune: bool = False) -> dict:
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
    with using_config(engine={"tune_device": tune}):
        solver = get_solver(sp)
    setup_s = time.perf_counter() - t0
    net = solver.net
    data, label = net.input_blob_names[:2]
    rng = np.random.default_rng(0)
    net.blobs[data].data[...] = cupy.asarray(rng.standard_normal(net.blobs[data].shape, dtype=np.float32))
    net.blobs[label].data[...] = cupy.asarray(rng.integers(0, MODELS[model][2], size=net.blobs[label].shape))
    resident = isinstance(net.blobs[data].data, cupy.ndarray)
    sync = cupy.cuda.Device().synchronize
    solver.step(2)
    ts = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        solver.step(1)
        sync()
        ts.append(time.perf_counter() - t0)
    t = statistics.median(ts)
    flops = sum(gemm_flops(net).values())
    plans = {layer.name: layer.lowering.name for layer in net.layers if layer.type == "Convolution"}
    net.close()
    impl = ("cct (resident" if resident else "cct (NOT resident") + (", measured picks)" if tune else ", type 1)")
    return {"model": model, "batch": batch, "impl": impl, "tune": tune, "setup_s": setup_s,
            "iter_s": t, "img_s": batch / t, "gflops": flops / t / 1e9, "plans": plans}


def run_torch(model: str, batch: int, iters: int) -> dict | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    dev = torch.device("cuda:0")
    torch.backends.cudnn.benchmark = True
    net = torch_model(model).to(dev)
    opt = torch.optim.SGD(net.parameters(), lr=0.001, momentum=0.9, weight_decay=5e-4)
    x = torch.randn((batch,) + MODELS[model][1], device=dev)
    y = torch.randint(0, MODELS[model][2], (batch,), device=dev)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        opt.zero_grad()
        loss_fn(net(x), y).backward()
        opt.step()

    for _ in range(3):
        step()
    ts = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    t = statistics.median(ts)
    return {"model": model, "batch": batch, "impl": f"pytorch {torch.__version__} (cuDNN)", "iter_s": t,
            "img_s": batch / t}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="lenet,cifar10_quick,caffenet")
    ap.add_argument("--batch", type=int, default=None, help="default: each model's own (64, 100, 64)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import cupy

    import cct

    cct.init_log(level=40)
    from cct.lowering.tune import device_name

    name = device_name(cupy)  # device 0, the one the resident nets use
    peak = gpu_sgemm_gflops()
    print(f"# GPU: {name}; CuPy {cupy.__version__}; measured SGEMM {peak:.0f} GFLOPS")
    rows, results = [], []
    for model in args.models.split(","):
        batch = args.batch or DEFAULT_BATCH[model]
        for r in (run_cct(model, batch, args.iters), run_cct(model, batch, args.iters, tune=True),
                  run_torch(model, batch, args.iters)):
            if r is None:
                continue
            results.append(r)
            picks = ",".join(r["plans"].values()) if r.get("tune") else ""
            rows.append([model, batch, r["impl"], r["iter_s"] * 1e3, r["img_s"],
                         f"{100 * r['gflops'] / peak:.1f}%" if "gflops" in r else "",
                         f"{r['setup_s']:.2f}" if "setup_s" in r else "", picks])
    print_table(["model", "batch", "implementation", "ms/iter (median)", "img/s", "of SGEMM", "setup s", "picks"],
                rows)
    path = write_json("bench_gpu", {"gpu": name, "sgemm_gflops": peak, "results": results}, args.out)
    print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
