"""Dense sliding-window inference throughput (ZNNi, Fig. 5/7): output voxels/s against the input patch size.

For ZNNi's n337 and n537 (Table III; ``--fmaps`` feature maps, random weights) on one random volume, each
row runs in its own process (so its peak resident memory is its own) and times, median of ``--runs``:

* ``naive``: the net applied once per window position (batches of windows; a sample of positions),
* ``cct-shift``: cct patch inference without MPF (the plain strided net run at every offset),
* ``cct-mpf``: cct with max-pooling fragments on every pooling layer, at the given patch,
* ``cct-plan``: cct with the planner's choice of patch and MPF under the memory budget,
* ``cct-pipe``: cct-mpf as the two-stage CPU pipeline (ZNNi VII; ``--theta`` convolution/pooling layers in
  the first stage, default ``auto``: the planner's; the plan line says which theta ran),
* ``monai``: the same net and weights in PyTorch in its dense form (pooling with stride 1, later layers
  dilated: filter rarefaction) run by MONAI's ``sliding_window_inference`` with ``roi_size`` = the patch,
  ``overlap`` = (field of view - 1) / patch so the valid outputs tile, the ROI weight map 1 on the valid
  part, ``sw_batch_size`` tuned over 1, 2, 4 (when the volume holds more than one window);
* on a GPU (ZNNi VII; skipped with a line where CuPy sees none): ``gpu`` (the net built on GPU 0, patches
  uploaded and tiles downloaded), ``gpu+host`` (activations in host RAM, each convolution on the GPU in
  sub-layers under ``--device_budget``) and ``cpu-gpu`` (the first theta layers on the CPU, the rest on the GPU,
  ``--theta``), each at the given patch; the GPU rows report the CuPy pool's size after the run too.

Every output is compared with cct-mpf's at the largest patch (max abs difference in the table). The cct rows
give the plan's predicted peak; with ``--trace_memory`` they first run one pass of a net of their own under
tracemalloc from setup on (freed before the timed runs) and give its peak too (what the plan predicts:
allocated bytes, where resident memory leaves out zero pages never touched).

torch and monai come from the ``[bench-infer]`` extra: ``pip install -e '.[bench-infer]'``.

    python benchmarks/bench_infer.py [--nets n337:8:1,2 n537:4:1] [--runs 3]
        [--shift_grids max|none|1,2] [--out results/bench_infer_n337.json]

A net spec is ``name:fmaps:grids`` (grids: output voxels per fragment and axis; the patch is
``grid * stride + fov - 1``); the volume's output is the largest grid's tile.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc

import numpy as np  # noqa: I001
from common import environment_report, print_environment, print_table, reexec_clean, time_call, write_json

import cct
from cct.device.driver import gpu_count
from cct.infer.geometry import analyze
from cct.infer.naive import naive_dense
from cct.infer.pipeline import DenseInference
from cct.infer.placement import gpu_config, gpu_device
from cct.infer.znni_nets import znni_prototxt


def _torch_dense_net(net):
    """The PyTorch dense form of a cct chain net: stride-1 pooling, later layers dilated."""
    import torch
    from torch import nn

    mods, dil = [], 1
    for lp in net.param.layer:
        if lp.type == "Convolution":
            w, b = net.params[lp.name][0].data, net.params[lp.name][1].data
            conv = nn.Conv3d(w.shape[1], w.shape[0], w.shape[2:], dilation=dil)
            conv.weight.data = torch.from_numpy(np.ascontiguousarray(w))
            conv.bias.data = torch.from_numpy(np.ascontiguousarray(b))
            mods.append(conv)
        elif lp.type == "Pooling":
            k = lp.pooling_param.kernel_size
            mods.append(nn.MaxPool3d(k, stride=1, dilation=dil))
            dil *= k
        elif lp.type == "ReLU":
            mods.append(nn.ReLU(inplace=True))
        elif lp.type == "Sigmoid":
            mods.append(nn.Sigmoid())
    return nn.Sequential(*mods).eval()


def _monai(net, geom, vol, patch, runs):
    import torch
    from monai.inferers import sliding_window_inference

    torch.set_num_threads(os.cpu_count() or 1)
    model = _torch_dense_net(net)
    fov = geom.field_of_view
    lo = [(f - 1) // 2 for f in fov]

    def predictor(x):
        y = model(x)
        pad = []
        for a in reversed(range(3)):
            pad += [lo[a], fov[a] - 1 - lo[a]]
        return torch.nn.functional.pad(y, pad)

    weight = torch.zeros((1, 1) + tuple(patch))
    weight[(0, 0) + tuple(slice(a, a + p - f + 1) for a, p, f in zip(lo, patch, fov))] = 1
    x = torch.from_numpy(vol)[None, None]
    overlap = [(f - 1) / p for f, p in zip(fov, patch)]

    def run(bs):
        with torch.no_grad():
            return sliding_window_inference(x, patch, bs, predictor, overlap=overlap, mode="constant",
                                            roi_weight_map=weight)

    tuned = {}
    windows = int(np.prod([_window_count(n, p, f) for n, p, f in zip(vol.shape, patch, fov)]))
    for bs in (1, 2, 4) if windows > 1 else (1,):  # one window: the batch size changes nothing
        t0 = time.perf_counter()
        run(bs)
        tuned[bs] = time.perf_counter() - t0
    bs = min(tuned, key=tuned.get)
    last: list = []
    timing = time_call(lambda: last.append(run(bs)), repeats=runs, warmup=0)
    out = last[-1][0].numpy()
    crop = (slice(None),) + tuple(slice(a, n - (f - 1 - a)) for a, n, f in zip(lo, vol.shape, fov))
    return timing, out[crop], {"sw_batch_size": bs, "tuning_s": tuned}


def _window_count(size: int, patch: int, fov: int) -> int:
    """MONAI's window count along one axis for ``overlap = (fov - 1) / patch``: stride ``patch - fov + 1``."""
    step = patch - fov + 1
    return max(1, -(-(size - patch) // step) + 1)


def _shift_wanted(flag: str, grid: int, grids: list[int]) -> bool:
    if flag == "none":
        return False
    if flag == "max":
        return grid == max(grids)
    return grid in {int(g) for g in flag.split(",")}


def _dense_inference(method: str, net, spec: dict, patch: tuple) -> DenseInference:
    """The DenseInference of one cct row (the CPU ones and the GPU ones)."""
    theta = spec.get("theta") or "auto"
    pipeline = int(theta) if theta != "auto" else theta
    if method == "cct-plan":
        return DenseInference(net, budget=spec.get("budget"))
    if method == "cct-pipe":
        return DenseInference(net, patch=patch, pipeline=pipeline)
    if method == "gpu":
        on_gpu = cct.Net(spec["model"], cct.TEST, weights=spec["weights"], config=gpu_config(0))
        return DenseInference(on_gpu, patch=patch, device_budget=spec.get("device_budget"))
    if method == "gpu+host":
        return DenseInference(net, patch=patch, device=gpu_device(0), host_ram=True,
                              device_budget=spec.get("device_budget"))
    if method == "cpu-gpu":
        return DenseInference(net, patch=patch, device=gpu_device(0), pipeline=pipeline)
    return DenseInference(net, patch=patch, method="shift" if method == "cct-shift" else "mpf")


def _traced_peak(method: str, spec: dict, patch: tuple, vol: np.ndarray) -> int:
    """Peak bytes tracemalloc sees over the setup and one pass of a net of its own (freed before the timed
    runs: the runner's activation pool lives as long as the net whose blobs it backs)."""
    net = cct.Net(spec["model"], cct.TEST, weights=spec["weights"])
    tracemalloc.start()
    try:
        result = _dense_inference(method, net, spec, patch)(vol)
        _, traced = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return traced - result.nbytes  # the returned volume is not part of the plan


def worker(spec: dict) -> dict:
    """One row, in this process: time it, save its output, report peak RSS."""
    net = cct.Net(spec["model"], cct.TEST, weights=spec["weights"])
    geom = analyze(net)
    vol = np.load(spec["volume"])
    method, patch, runs = spec["method"], tuple(spec["patch"]), spec["runs"]
    extra: dict = {}
    if method == "naive":
        k = spec["windows"]
        sub = vol[: geom.field_of_view[0], : geom.field_of_view[1], : geom.field_of_view[2] + k - 1]
        timing = time_call(lambda: naive_dense(net, geom, sub[None], batch=k), repeats=runs)
        out = naive_dense(net, geom, sub[None], batch=k)
        voxels = k
    elif method == "monai":
        timing, out, extra = _monai(net, geom, vol, patch, runs)
        voxels = int(np.prod(out.shape[1:]))
    else:
        traced = _traced_peak(method, spec, patch, vol) if spec.get("trace_memory") and method not in GPU_METHODS \
            else None
        di = _dense_inference(method, net, spec, patch)
        di.prepare(vol.shape)
        last: list = []
        timing = time_call(lambda: last.append(di(vol)), repeats=runs)
        out = last[-1]
        voxels = int(np.prod(out.shape[1:]))
        extra = {"plan": di.plan.describe().splitlines()[0], "predicted_peak_bytes": di.plan.peak_bytes,
                 "predicted_voxels_per_s": di.plan.voxels_per_second, "patch": list(di.plan.patch),
                 "mpf": list(di.plan.mpf), "theta": di.plan.theta}
        if traced is not None:
            extra["traced_peak_bytes"] = traced
        if method in GPU_METHODS:
            import cupy

            extra.update({"device_peak_bytes": di.plan.device_peak_bytes,
                          "splits": [sp.describe() for sp in di.plan.splits if sp.split],
                          "cupy_pool_bytes": int(cupy.get_default_memory_pool().total_bytes())})
    np.save(spec["out"], out)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"timing": timing, "voxels": voxels, "voxels_per_s": voxels / timing["median"], "peak_rss": rss,
            **extra}


GPU_METHODS = ("gpu", "gpu+host", "cpu-gpu")
HEADER = ["net", "fmaps", "method", "patch", "voxels/s", "median s", "peak RSS MiB", "predicted MiB", "traced MiB",
          "max|diff|", "sw_bs"]


def _mib(nbytes: int | None) -> int | str:
    return "" if nbytes is None else round(nbytes / 2**20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nets", nargs="+", default=["n337:8:1,2", "n537:4:1"])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--windows", type=int, default=8, help="window positions timed by the naive approach")
    ap.add_argument("--methods", default="naive,cct-shift,cct-mpf,cct-plan,monai,gpu,gpu+host,cpu-gpu")
    ap.add_argument("--shift_grids", default="max",
                    help="grids cct-shift runs at: 'max' (the largest), 'none' or a list such as 1,2 "
                         "(it runs prod(stride) plain nets per patch)")
    ap.add_argument("--theta", default="auto", help="cct-pipe's first-stage layers (auto: the planner's)")
    ap.add_argument("--budget", default=None, help="memory budget of cct-plan (default CCT_MEMORY_BUDGET)")
    ap.add_argument("--device_budget", default=None, help="GPU memory of the gpu and gpu+host rows (default: free)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--trace_memory", action="store_true",
                    help="cct rows: one pass under tracemalloc from setup on first (beside the predicted peak)")
    ap.add_argument("--keep-env", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return
    removed = reexec_clean(keep_env=args.keep_env)
    env = environment_report(removed)
    print_environment(env)
    methods = args.methods.split(",")
    if gpu_count() == 0 and any(m in GPU_METHODS for m in methods):
        print(f"skipped {', '.join(m for m in methods if m in GPU_METHODS)}: no GPU (CuPy sees none)")
        methods = [m for m in methods if m not in GPU_METHODS]
    budget = device_budget = None
    if args.budget or args.device_budget:
        from cct.membudget import parse_size

        budget = parse_size(args.budget) if args.budget else None
        device_budget = parse_size(args.device_budget) if args.device_budget else None
    rows, results = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.nets:
            name, fmaps, grids = spec.split(":")
            grids = [int(g) for g in grids.split(",")]
            model = os.path.join(tmp, f"{name}.prototxt")
            with open(model, "w") as f:
                f.write(znni_prototxt(name, fmaps=int(fmaps), outputs=3))
            net = cct.Net(model, cct.TEST)
            rng = np.random.default_rng(0)
            for blobs in net.params.values():  # He-scaled weights keep activations O(1) through the depth
                blobs[0].data[...] = rng.standard_normal(blobs[0].shape) * np.sqrt(2.0 / blobs[0].data[0].size)
                blobs[1].data[...] = rng.uniform(-0.1, 0.1, blobs[1].shape)
            weights = os.path.join(tmp, f"{name}.caffemodel")
            net.save(weights)
            geom = analyze(net)
            fov, stride = geom.field_of_view[0], geom.stride[0]
            out_n = max(grids) * stride
            vol = rng.standard_normal((out_n + fov - 1,) * 3).astype(np.float32)
            vpath = os.path.join(tmp, f"{name}_vol.npy")
            np.save(vpath, vol)
            ref = None
            order = [m for m in ("cct-mpf", "naive", "cct-shift", "cct-plan", "cct-pipe", "monai") + GPU_METHODS
                     if m in methods]
            for method in order:
                for g in (grids if method in ("cct-mpf", "cct-shift", "cct-pipe", "monai") + GPU_METHODS
                          else [max(grids)]):
                    if method == "cct-shift" and not _shift_wanted(args.shift_grids, g, grids):
                        continue
                    patch = (g * stride + fov - 1,) * 3
                    out = os.path.join(tmp, f"{name}_{method}_{g}.npy")
                    job = {"model": model, "weights": weights, "volume": vpath, "method": method, "patch": patch,
                           "runs": args.runs, "out": out, "windows": args.windows, "budget": budget,
                           "theta": args.theta, "device_budget": device_budget, "trace_memory": args.trace_memory}
                    t0 = time.perf_counter()
                    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(job)],
                                          capture_output=True, text=True, env=os.environ.copy())
                    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                    if proc.returncode != 0 or not lines:
                        raise SystemExit(f"{name} {method} {g} failed:\n{proc.stderr[-3000:]}")
                    res = json.loads(lines[-1][7:])
                    got = np.load(out)
                    if ref is None:
                        ref = got  # cct-mpf at the first grid: the whole volume
                    if method == "naive":
                        diff = float(np.abs(got - ref[(slice(None), 0, 0, slice(0, got.shape[-1]))]
                                            .reshape(got.shape)).max())
                    else:
                        diff = float(np.abs(got - ref).max())
                    res.update({"net": name, "fmaps": int(fmaps), "fov": fov, "method": method, "grid": g,
                                "patch": res.get("patch", list(patch)), "volume": list(vol.shape),
                                "max_abs_diff_vs_cct_mpf": diff, "wall_s": time.perf_counter() - t0})
                    results.append(res)
                    label = f"{method} (theta {res.get('theta')})" if method in ("cct-pipe", "cpu-gpu") else method
                    rows.append([name, int(fmaps), label, "x".join(map(str, res["patch"])) if method != "naive"
                                 else f"{fov}^3 windows", round(res["voxels_per_s"], 1), res["timing"]["median"],
                                 round(res["peak_rss"] / 2**20), _mib(res.get("predicted_peak_bytes")),
                                 _mib(res.get("traced_peak_bytes")), f"{diff:.1e}", res.get("sw_batch_size", "")])
                    print_table(HEADER, rows[-1:])
    print()
    print_table(HEADER, rows)
    path = write_json("bench_infer", {"environment": env, "results": results}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
