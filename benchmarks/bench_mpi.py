"""Data-parallel training on MPI: 1 process x 2 threads vs 2 ranks x 1 thread, the all-reduce time per
iteration, the fraction of it hidden behind backward, and a MODEL of the scaling to larger clusters.

    python benchmarks/bench_mpi.py                 # LeNet (global batch 64) and cifar10_quick (global batch 32)
    python benchmarks/bench_mpi.py --quick         # fewer iterations (smoke test)
    python benchmarks/bench_mpi.py --models lenet --iters 40 --bandwidth 10

Each configuration trains the upstream train_test net (its Data layers replaced by HDF5Data over random
data) with SGD for ``--warmup`` + ``--iters`` iterations at the same global batch:

* ``1x2``: one process, BLAS/OpenMP 2 threads, batch B;
* ``2x1``: ``mpiexec -n 2``, 1 thread per rank, batch B/2 per rank, gradients all-reduced in buckets
  started from the backward hooks (overlap) -- and again with the all-reduce only after backward
  (``overlap off``: the whole all-reduce is exposed; the difference is what the overlap hides).

The all-reduce alone (the same bytes, blocking, between the same 2 ranks) is timed too. The scaling
table is a model, not a measurement: t(N) = t_compute(b) + (1 - hidden) * t_allreduce(N) with a ring
all-reduce t_allreduce(N) = 2 (N-1)/N * bytes / bandwidth + 2 (N-1) * latency, the measured compute
time per iteration at per-rank batch b, the measured hidden fraction, and an assumed network
(``--bandwidth`` Gbit/s, ``--latency`` us). Writes ``results/bench_mpi[_quick].json``.

"Exposed" all-reduce time is what the solver waited for before the update; it also contains any
wait for a slower rank, so on a loaded machine it over-states the communication cost.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from common import (  # noqa: E402
    ROOT,
    environment_report,
    print_environment,
    print_table,
    reexec_clean,
    write_json,
)

from cct.paths import shared_path  # noqa: E402

MODELS = {
    # name: (train_test prototxt under shared/caffe-models, data shape, global batch)
    "lenet": (("mnist", "lenet_train_test.prototxt"), (1, 28, 28), 64),
    "cifar10_quick": (("cifar10", "cifar10_quick_train_test.prototxt"), (3, 32, 32), 32),
}


def _prepare(model: str, workdir: str, batch: int) -> str:
    """A solver + net in ``workdir`` whose TRAIN data layer is HDF5Data over random data at ``batch``."""
    import h5py

    from cct.io.prototxt import read_net_prototxt, to_text
    from cct.proto import caffe_pb2

    rel, shape, _ = MODELS[model]
    src = read_net_prototxt(str(shared_path("caffe-models", *rel)))
    rng = np.random.default_rng(0)
    h5 = os.path.join(workdir, f"{model}.h5")
    if not os.path.exists(h5):
        with h5py.File(h5, "w") as f:
            f["data"] = rng.random((256,) + shape, dtype=np.float32)
            f["label"] = rng.integers(0, 10, 256).astype(np.float32)
    with open(os.path.join(workdir, f"{model}.txt"), "w") as f:
        f.write(h5 + "\n")
    net = caffe_pb2.NetParameter(name=src.name)
    for lp in src.layer:
        if lp.type == "Data":
            if any(r.phase == caffe_pb2.TEST for r in lp.include):
                continue
            new = net.layer.add(name=lp.name, type="HDF5Data", top=list(lp.top))
            new.hdf5_data_param.source = os.path.join(workdir, f"{model}.txt")
            new.hdf5_data_param.batch_size = batch
            continue
        if lp.type == "Accuracy":
            continue
        net.layer.add().CopyFrom(lp)
    net_path = os.path.join(workdir, f"{model}_b{batch}.prototxt")
    with open(net_path, "w") as f:
        f.write(to_text(net))
    solver = os.path.join(workdir, f"{model}_b{batch}_solver.prototxt")
    with open(solver, "w") as f:
        f.write(f'net: "{net_path}"\nbase_lr: 0.001\nmomentum: 0.9\nweight_decay: 0.0005\nlr_policy: "fixed"\n'
                f'max_iter: 100000\ndisplay: 0\nrandom_seed: 1\ntype: "SGD"\n')
    return solver


def worker(args) -> None:
    """One configuration (under mpiexec or alone): time the iterations, write JSON (rank 0)."""
    from cct.distributed.gradsync import GradientSync
    from cct.solver import get_solver

    solver = get_solver(args.solver_file)
    par = solver.parallel
    if par is not None and not args.overlap:
        solver.net.backward_hooks.remove(par.sync.hook)
        par.sync = GradientSync(solver.net, par.comm, overlap=False)
        solver.net.backward_hooks.append(par.sync.hook)
    solver.step(args.warmup)
    comm = solver.comm
    if comm is not None:
        comm.barrier()
        wait0 = par.sync.stats.wait_s
    t0 = time.perf_counter()
    solver.step(args.iters)
    if comm is not None:
        comm.barrier()
    elapsed = time.perf_counter() - t0
    out = {"iters": args.iters, "elapsed_s": elapsed, "iter_s": elapsed / args.iters}
    if comm is not None:
        out["wait_s_per_iter"] = (par.sync.stats.wait_s - wait0) / args.iters
        out["bytes"] = par.sync.stats.bytes
        out["buckets"] = par.sync.stats.buckets
        buf = np.ones(par.sync.stats.bytes // 4, np.float32)
        comm.barrier()
        t = time.perf_counter()
        for _ in range(args.iters):
            comm.allreduce(buf, out=buf)
        out["allreduce_alone_s"] = (time.perf_counter() - t) / args.iters
        out["ranks"] = comm.size
        times = comm.gather_obj(elapsed)
        if not comm.is_root:
            return
        out["rank_elapsed_s"] = times
    with open(args.out, "w") as f:
        json.dump(out, f)


def _run(cmd: list[str], threads: int) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "MPI_"))}
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("CCT_CALIBRATE", "0")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")


def _mpiexec() -> str:
    from cct.distributed.launch import mpiexec_path

    return mpiexec_path() or "mpiexec"


def model_table(bytes_: int, t_compute: float, hidden: float, per_rank_batch: int, gbits: float,
                latency_us: float) -> list[list]:
    """Time per iteration and images/s vs N from the ring all-reduce model (see module docstring)."""
    bw = gbits * 1e9 / 8
    rows = []
    for n in (1, 2, 4, 8, 16, 32, 64, 128):
        t_ar = 0.0 if n == 1 else 2 * (n - 1) / n * bytes_ / bw + 2 * (n - 1) * latency_us * 1e-6
        t = t_compute + (1 - hidden) * t_ar
        rows.append([n, t_ar * 1e3, t * 1e3, n * per_rank_batch / t, t_compute / t])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="lenet,cifar10_quick")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--bandwidth", type=float, default=10.0, help="assumed network bandwidth, Gbit/s (model)")
    p.add_argument("--latency", type=float, default=20.0, help="assumed per-message latency, us (model)")
    p.add_argument("--out", default=None)
    p.add_argument("--keep-env", action="store_true", help="keep OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--solver_file", help=argparse.SUPPRESS)
    p.add_argument("--overlap", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    removed = reexec_clean(keep_env=args.keep_env)
    if args.quick:
        args.iters, args.warmup = 8, 2
    rep = environment_report(removed)
    print_environment(rep)
    results = {"environment": rep, "models": {}, "model_assumptions": {
        "bandwidth_gbit_s": args.bandwidth, "latency_us": args.latency, "allreduce": "ring"}}
    me = os.path.abspath(__file__)
    rows, model_rows = [], {}
    with tempfile.TemporaryDirectory(prefix="cct-bench-mpi-") as work:
        for model in args.models.split(","):
            gbatch = MODELS[model][2]
            res = {}
            for name, ranks, threads, overlap in (("1x2", 1, 2, 1), ("2x1", 2, 1, 1), ("2x1 overlap off", 2, 1, 0)):
                batch = gbatch // ranks
                solver = _prepare(model, work, batch)
                out = os.path.join(work, f"{model}_{ranks}_{overlap}.json")
                cmd = [sys.executable, me, "--worker", "--solver_file", solver, "--iters", str(args.iters),
                       "--warmup", str(args.warmup), "--overlap", str(overlap), "--out", out]
                _run(([_mpiexec(), "-n", str(ranks)] if ranks > 1 else []) + cmd, threads)
                with open(out) as f:
                    res[name] = json.load(f)
            on, off = res["2x1"], res["2x1 overlap off"]
            hidden = max(0.0, 1 - on["wait_s_per_iter"] / off["wait_s_per_iter"]) if off["wait_s_per_iter"] else 0
            res["hidden_fraction"] = hidden
            for name in ("1x2", "2x1", "2x1 overlap off"):
                r = res[name]
                rows.append([model, name, gbatch, r["iter_s"] * 1e3, gbatch / r["iter_s"],
                             r.get("wait_s_per_iter", 0) * 1e3, r.get("allreduce_alone_s", 0) * 1e3,
                             hidden if name == "2x1" else ""])
            t_compute = off["iter_s"] - off["wait_s_per_iter"]
            res["model"] = model_table(on["bytes"], t_compute, hidden, gbatch // 2, args.bandwidth, args.latency)
            model_rows[model] = res["model"]
            results["models"][model] = res
    print(f"\n# measured: global batch, ms/iter, images/s; all-reduce wait exposed per iteration; the same bytes "
          f"all-reduced alone; fraction of the all-reduce hidden behind backward (load avg {rep['load_avg']})")
    print_table(["model", "procs x threads", "batch", "ms/iter", "images/s", "allreduce exposed ms",
                 "allreduce alone ms", "hidden"], rows)
    for model, mrows in model_rows.items():
        print(f"\n# MODEL (not measured): {model}, per-rank batch {MODELS[model][2] // 2}, ring all-reduce over "
              f"{args.bandwidth:g} Gbit/s, {args.latency:g} us latency, measured compute time and hidden fraction")
        print_table(["N", "allreduce ms", "ms/iter", "images/s", "efficiency"], mrows)
    path = write_json("bench_mpi_quick" if args.quick else "bench_mpi", results, args.out)
    print(f"\n# wrote {path}")


if __name__ == "__main__":
    main()
