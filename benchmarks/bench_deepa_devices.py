"""Per-layer plans on in-process devices (issue 32 item 3): training step time of LeNet and CaffeNet on
``--devices cpu,cpu:1`` run as one worker thread per device (a ThreadComm; each worker at batch b) under data
parallelism, OWT and LeNet's per-layer plans, side by side in one run with the scheduler's split of the global
batch 2b over the same two devices (today's ``--devices``, ``--parallel data``) and one process at batch 2b.

``python benchmarks/bench_deepa_devices.py [--iters 10] [--models lenet,caffenet] [--out NAME]``

Every mode trains the same global batch (DummyData; LeNet 2 x 64, CaffeNet 2 x 4); the figure is the median
of 3 timed runs of ``--iters`` SGD iterations (after 2 untimed ones) in seconds per iteration (workers: the
slowest worker's), with the bytes the workers copy per step in the exchanges (the planner's count) and the
gradient bytes each all-reduces. Run it under ``flock /tmp/cct-timing.lock``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_deepa import lenet_modes, training_net  # noqa: E402
from common import environment_report, print_environment, print_table, reexec_clean, write_json  # noqa: E402

from cct.config import Config  # noqa: E402
from cct.parallel_plan.inprocess import run_device_workers, worker_config  # noqa: E402
from cct.parallel_plan.owt import enable_owt  # noqa: E402
from cct.parallel_plan.perlayer import enable_per_layer  # noqa: E402
from cct.proto import caffe_pb2  # noqa: E402
from cct.scheduler import make_config  # noqa: E402
from cct.solver import get_solver  # noqa: E402

BATCH = {"lenet": 64, "caffenet": 4}  # per worker; the global batch is twice it


def _param(model: str, batch: int) -> caffe_pb2.SolverParameter:
    param = caffe_pb2.SolverParameter(base_lr=0.001, momentum=0.9, lr_policy="fixed", max_iter=10**6, display=0,
                                      snapshot_after_train=False, random_seed=1,
                                      solver_mode=caffe_pb2.SolverParameter.CPU)
    param.net_param.CopyFrom(training_net(model, batch))
    return param


def _timed(solver, iters: int, sync=None) -> list[float]:
    solver.step(2)
    runs = []
    for _ in range(3):
        if sync is not None:
            sync.barrier()
        t = time.perf_counter()
        solver.step(iters)
        dt = (time.perf_counter() - t) / iters
        runs.append(sync.allreduce_scalar(dt, op="max") if sync is not None else dt)
    return runs


def one_process(model: str, iters: int, config: Config) -> dict:
    """One solver at the global batch (``config``'s devices: none, or the scheduler's split over them)."""
    solver = get_solver(_param(model, 2 * BATCH[model]), config=config)
    runs = _timed(solver, iters)
    return {"step_s": statistics.median(runs), "runs": runs, "copied_bytes": 0, "reduced_bytes": 0}


def workers(model: str, mode: str, iters: int, devices) -> dict:
    """Two worker threads, one per device, each a solver at batch b under ``mode``."""
    param, config = _param(model, BATCH[model]), Config()

    def body(comm):
        devices[comm.rank].bind_thread()
        solver = get_solver(param, config=worker_config(config, comm.rank), comm=comm)
        if mode == "owt":
            ex = enable_owt(solver)
        elif mode != "data":
            ex = enable_per_layer(solver, lenet_modes(comm.size)[mode])
        else:
            ex = None
        runs = _timed(solver, iters, comm)
        done = 2 + 3 * iters
        copied = 0 if ex is None else (ex.bytes_moved + getattr(ex, "update_bytes", 0)) / done
        return runs, copied, solver.parallel.sync.stats.bytes

    results = run_device_workers(2, body, timeout_s=600)
    runs = results[0][0]
    return {"step_s": statistics.median(runs), "runs": runs, "copied_bytes": sum(r[1] for r in results),
            "reduced_bytes": results[0][2]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--models", default="lenet,caffenet")
    ap.add_argument("--keep-env", action="store_true")
    ap.add_argument("--out", default=None, help="result file (default benchmarks/results/bench_deepa_devices.json)")
    a = ap.parse_args()
    removed = reexec_clean(keep_env=a.keep_env)
    env = environment_report(removed)
    print_environment(env)
    rows, out = [], {}
    for model in a.models.split(","):
        iters = a.iters if model == "lenet" else max(2, a.iters // 3)
        res = {"one process": one_process(model, iters, Config())}
        cfg = make_config("cpu,cpu:1", shares=[0.5, 0.5])
        try:
            res["scheduler (--parallel data)"] = one_process(model, iters, Config(devices=cfg))
            modes = ["data", "owt"] + (["mixed", "tailmix", "spatial"] if model == "lenet" else [])
            for mode in modes:
                res[f"workers {mode}"] = workers(model, mode, iters, cfg.devices)
        finally:
            cfg.close()
        base = res["scheduler (--parallel data)"]["step_s"]
        for name, r in res.items():
            rows.append([model, 2 * BATCH[model], name, f"{r['step_s'] * 1e3:.1f}", f"{base / r['step_s']:.2f}x",
                         f"{r['copied_bytes'] / 2**10:.1f}", f"{r['reduced_bytes'] / 2**10:.1f}"])
        out[model] = res
    print_table(["model", "global batch", "mode", "ms/iter (median of 3)", "vs scheduler", "KiB copied/step",
                 "KiB all-reduced"], rows)
    path = write_json("bench_deepa_devices", {"env": env, "iters": a.iters, "results": out}, a.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
