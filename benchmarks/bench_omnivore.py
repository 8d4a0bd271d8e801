"""Omnivore on MPI ranks (issue 11): HE, SE and time to a fixed training loss for every g, the
optimizer's choice, the HE model's predictions, and the implicit momentum of asynchrony.

``python benchmarks/bench_omnivore.py [--ranks 4] [--models lenet,cifar10_quick] [--quick]``

The script makes its data (generated digits for LeNet; class-structured synthetic 3x32x32 images for
cifar10_quick, both as real LMDBs read by the upstream nets' Data layers) and re-runs itself under
``mpiexec -n RANKS``: rank 0 is the FC server + conv model server, the others are conv compute ranks.
For each model and each g in 1..RANKS-1 (plus the optimizer, ``auto``) it trains from the same initial
weights until the training loss (mean of the last 20 iterations) reaches the model's target; explicit
momentum is the solver's 0.9 compensated for g (``1 - g (1 - 0.9)``). HE = measured seconds per
iteration, SE = iterations to the target, time = their product as measured. The HE model is fitted
from the fully asynchronous run (t_fc and t_conv(1) medians) and predicts every g; the lines for 9
and 33 ranks are the model alone (marked), with an assumed network. The implicit momentum table fits
``V(t+1) = m V(t) - eta' grad(W(t))`` to the conv model trajectory of a convex problem (logistic
regression as a convolution, no FC tail, the whole data set as the batch so that the only randomness
is the ranks' timing) on real ranks with explicit momentum 0, averaged over runs,
beside the event-driven simulation for larger g and the prediction 1 - 1/g.

All ranks share this machine's cores: with more ranks than cores, k ranks in a group do not run k
times faster, which the HE model (linear speed-up in k) does not know. Say so when quoting.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

TARGETS = {"lenet": 0.6, "cifar10_quick": 0.5}
MAX_ITERS = {"lenet": 400, "cifar10_quick": 600}


# -- data (parent process) ---------------------------------------------------------------------
def make_data(d: Path, quick: bool) -> None:
    from cct.tools.convert_mnist import write_images_db

    n = 2000 if quick else 6000
    subprocess.run([sys.executable, "-m", "cct", "make_digits", str(d / "digits"), "--train", str(n), "--test",
                    "100"], check=True, capture_output=True)
    rng = np.random.default_rng(5)
    templates = rng.integers(0, 256, size=(10, 3, 8, 8)).astype(np.float32)
    labels = np.arange(n) % 10
    rng.shuffle(labels)
    up = np.kron(templates[labels], np.ones((1, 1, 4, 4), np.float32))
    imgs = np.clip(0.6 * up + 0.4 * rng.integers(0, 256, size=up.shape), 0, 255).astype(np.uint8)
    write_images_db(str(d / "cifar_train_lmdb"), imgs, labels)
    # the convex problem of the momentum table
    import h5py

    n_pts, side = convex_size(quick)
    x = rng.standard_normal((n_pts, 1, side, side)).astype(np.float32)
    y = np.argmax(x.reshape(n_pts, -1) @ rng.standard_normal((side * side, 3)), axis=1).astype(np.float32)
    with h5py.File(d / "convex.h5", "w") as f:
        f["data"] = x
        f["label"] = y
    (d / "convex_list.txt").write_text(str(d / "convex.h5") + "\n")


def convex_size(quick: bool) -> tuple[int, int]:
    """(points, image side) of the convex problem. A group's step must take long against a message round
    trip, or every pull already sees the other groups' updates and there is no staleness to measure:
    the full run uses 8192 points of 48x48 (~0.3 GFLOP per gradient), --quick 256 of 6x6."""
    return (256, 6) if quick else (8192, 48)


def solver_param(model: str, d: Path, quick: bool = False):
    from cct.io.prototxt import read_net_prototxt
    from cct.proto import caffe_pb2

    if model == "convex":
        n_pts, side = convex_size(quick)
        net = caffe_pb2.NetParameter()
        from google.protobuf import text_format

        text_format.Merge(f'''name: "convex"
layer {{ name: "d" type: "HDF5Data" top: "data" top: "label"
        hdf5_data_param {{ source: "{d}/convex_list.txt" batch_size: {n_pts} }} }}
layer {{ name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param {{ num_output: 3 kernel_size: {side} weight_filler {{ type: "constant" }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "conv" bottom: "label" top: "loss" }}''', net)
        lr = 0.1
        decay = 0.0
    else:
        src = {"lenet": "models/lenet/lenet_train_test.prototxt",
               "cifar10_quick": "models/cifar10_quick/cifar10_quick_train_test.prototxt"}[model]
        full = read_net_prototxt(str(ROOT / src))
        net = caffe_pb2.NetParameter()
        net.CopyFrom(full)
        del net.layer[:]
        for layer in full.layer:
            if any(r.phase == caffe_pb2.TEST for r in layer.include):
                continue
            if layer.type == "Data":
                if model == "lenet":
                    layer.data_param.source = str(d / "digits" / "digits_train_lmdb")
                else:
                    layer.data_param.source = str(d / "cifar_train_lmdb")
                    # upstream subtracts the data set's mean image from raw 0-255 pixels; a constant mean
                    # does the same for these images (scaled to [0, 1] instead, the upstream net's tiny
                    # initial weights leave the loss at ln 10 for hundreds of iterations)
                    layer.transform_param.ClearField("mean_file")
                    layer.transform_param.mean_value.append(128.0)
            if layer.type == "Accuracy":
                continue
            net.layer.add().CopyFrom(layer)
        lr = 0.01 if model == "lenet" else 0.001
        decay = 0.0005
    p = caffe_pb2.SolverParameter()
    p.net_param.CopyFrom(net)
    p.base_lr, p.momentum, p.weight_decay, p.lr_policy = lr, 0.9, decay, "fixed"
    p.max_iter, p.display, p.random_seed = 100000, 0, 1
    p.solver_mode = caffe_pb2.SolverParameter.CPU
    return p


# -- ranks -------------------------------------------------------------------------------------
def run_to_target(server, g, mu, lr, target, max_iters, chunk=20):
    """Train in phases of ``chunk`` iterations until the mean of the last 20 losses <= target."""
    losses, t0, times = [], time.perf_counter(), []
    while len(losses) < max_iters:
        res = server.run_phase(g, mu, lr, chunk)
        losses += res.losses
        times.append(res.time_per_iter)
        if not np.isfinite(losses[-1]) or np.mean(losses[-20:]) <= target:
            break
    reached = bool(np.isfinite(losses[-1]) and np.mean(losses[-20:]) <= target)
    return {"iters": len(losses), "wall_s": time.perf_counter() - t0, "reached": reached,
            "s_per_iter": float(np.median(times)), "final_loss": float(np.mean(losses[-20:]))}


class _Reached(Exception):
    pass


def bench_model(comm, model: str, d: Path, quick: bool, search_iters: int = 0) -> dict:
    from cct.distributed import LocalComm
    from cct.omnivore.he_model import HEModel
    from cct.omnivore.momentum import compensate_momentum
    from cct.omnivore.mpi_exec import OmnivoreServer
    from cct.omnivore.optimizer import OmnivoreOptimizer
    from cct.omnivore.train import MPITrialRunner, measure_he
    from cct.solver import get_solver

    solver = get_solver(solver_param(model, d), comm=LocalComm())
    server = OmnivoreServer(solver, comm)
    n_conv = server.n_conv
    lr = solver.param.base_lr
    target, max_iters = TARGETS[model], MAX_ITERS[model] // (2 if quick else 1)
    runner = MPITrialRunner(server)
    server.run_phase(n_conv, 0.0, 0.0, 2 * n_conv)  # warm-up (first-iteration costs on every rank)
    start = server.checkpoint()
    he = measure_he(runner, iters=4 * n_conv)
    rows = []
    for g in range(1, n_conv + 1):
        server.restore(start)
        mu = compensate_momentum(0.9, g)
        r = run_to_target(server, g, mu, lr, target, max_iters)
        r.update(g=g, mu=mu, lr=lr, predicted_s_per_iter=he.time_per_iteration(g, n_conv))
        rows.append(r)
        print(f"  {model} g={g}: {r}", flush=True)
    # the optimizer: cold start + epochs, stopped when the target is reached (search time included)
    server.restore(start)
    t0 = time.perf_counter()
    trained: list[float] = []

    class Runner(MPITrialRunner):
        def train(self, g, mu, lr_, iters):
            left = iters
            state, done = server.checkpoint(), len(trained)
            while left > 0:
                res = server.run_phase(g, mu, lr_, min(20, left))
                left -= len(res.losses)
                trained.extend(res.losses)
                if not np.all(np.isfinite(res.losses)):
                    server.restore(state)
                    del trained[done:]
                    return float("nan")
                if np.mean(trained[-20:]) <= target or len(trained) >= max_iters:
                    raise _Reached
            return float(np.mean(trained[-20:]))

    epoch = 100 if quick else 200
    opt = OmnivoreOptimizer(Runner(server), n_conv, epoch_iters=epoch, he=he, cold_start_iters=epoch // 2,
                            trial_iters=20)
    try:
        opt.run(max_iters)
    except _Reached:
        pass
    auto = {"g": "auto", "iters": len(trained), "wall_s": time.perf_counter() - t0,
            "reached": bool(trained and np.mean(trained[-20:]) <= target),
            "final_loss": float(np.mean(trained[-20:])) if trained else None,
            "decisions": [d.line() for d in opt.decisions], "search_fraction": opt.search_fraction()}
    print(f"  {model} auto: {auto}", flush=True)
    search = bench_search_share(server, start, n_conv, he, search_iters) if search_iters else None
    # extrapolation by the model (not measured): 8 and 32 conv ranks, 10 Gbit/s network
    conv_bytes = 4 * sum(solver.net.learnable_params[i].data.size for i in server.conv_pids)
    big = HEModel(t_fc=he.t_fc, t_conv1=he.t_conv1, t_net1=2 * conv_bytes / 1.25e9)
    extrap = {str(n + 1): big.table(n) for n in (8, 32)}
    return {"model": model, "target_loss": target, "n_conv": n_conv, "t_fc_s": he.t_fc, "t_conv1_s": he.t_conv1,
            "fixed_g": rows, "auto": auto, "search_share": search, "model_extrapolation_10gbit": extrap}


def bench_search_share(server, start, n_conv: int, he, total: int) -> dict:
    """The optimizer as ``cct train --groups auto`` runs it (default trial length, epochs of ``total // 2``
    iterations, no early stop at a target): the share of iterations and of wall time its search costs."""
    from cct.omnivore.optimizer import OmnivoreOptimizer
    from cct.omnivore.train import MPITrialRunner

    spent = {"trial": 0.0, "train": 0.0}

    class Timed(MPITrialRunner):
        def _timed(self, kind, fn, *a):
            t0 = time.perf_counter()
            try:
                return fn(*a)
            finally:
                spent[kind] += time.perf_counter() - t0

        def trial(self, *a):
            return self._timed("trial", super().trial, *a)

        def train(self, *a):
            return self._timed("train", super().train, *a)

    server.restore(start)
    epoch = max(1, total // 2)
    opt = OmnivoreOptimizer(Timed(server), n_conv, epoch_iters=epoch, he=he)
    opt.run(total)
    search_it = sum(d.search_iters for d in opt.decisions)
    out = {"total_train_iters": total, "epoch_iters": epoch, "trial_iters": opt.trial_iters,
           "search_iters": search_it, "search_fraction_iters": opt.search_fraction(),
           "trial_s": spent["trial"], "train_s": spent["train"],
           "search_fraction_time": spent["trial"] / max(1e-9, spent["trial"] + spent["train"]),
           "decisions": [d.line() for d in opt.decisions]}
    print(f"  search share: {out}", flush=True)
    return out


def bench_momentum(comm, d: Path, quick: bool) -> dict:
    from cct.distributed import LocalComm
    from cct.omnivore.momentum import fit_momentum, implicit_momentum, simulate_async
    from cct.omnivore.mpi_exec import OmnivoreServer
    from cct.solver import get_solver

    solver = get_solver(solver_param("convex", d, quick), comm=LocalComm())
    server = OmnivoreServer(solver, comm)
    net = solver.net
    start = server.checkpoint()
    steps, runs = (80, 3) if quick else (150, 5)

    def full_gradient(w):
        at = 0
        for pid in server.conv_pids:
            p = net.learnable_params[pid]
            p.data[...] = w[at:at + p.data.size].reshape(p.data.shape)
            at += p.data.size
        net.clear_param_diffs()
        net.forward_backward()  # the batch is the whole data set: the exact gradient
        return np.concatenate([net.learnable_params[i].diff.ravel() for i in server.conv_pids])

    rows = []
    for g in range(1, server.n_conv + 1):
        Ws = []
        for _ in range(runs):
            server.restore(start)
            w0 = np.concatenate([net.learnable_params[i].data.ravel() for i in server.conv_pids])
            res = server.run_phase(g, 0.0, 0.05, steps, record=True)
            Ws.append(np.vstack([w0] + res.weights))
        W = np.mean(Ws, axis=0)
        saved = server.checkpoint()
        G = np.array([full_gradient(w) for w in W])
        server.restore(saved)
        m, eta = fit_momentum(W, G, skip=2 * g)
        rows.append({"g": g, "source": "MPI ranks", "measured": m, "eta_fit": eta, "predicted": implicit_momentum(g)})
        print(f"  momentum g={g} (ranks): {rows[-1]}", flush=True)
    for g in (1, 2, 4, 8, 16, 32):
        m, eta = fit_momentum(*simulate_async(g, 300, runs=300, seed=g), skip=2 * g)
        rows.append({"g": g, "source": "simulation (exponential step times)", "measured": m, "eta_fit": eta,
                     "predicted": implicit_momentum(g)})
    return {"rows": rows, "steps": steps, "runs": runs, "lr": 0.05}


def ranks_main(args) -> None:
    import logging

    from cct.distributed import LocalComm
    from cct.omnivore.mpi_exec import ConvWorker, omnivore_comm

    comm = omnivore_comm()
    logging.getLogger("cct").setLevel(logging.WARNING)
    d = Path(args.data)
    jobs = [m for m in args.models.split(",") if m] + ["momentum"]
    out = {}
    for job in jobs:
        if comm.rank != 0:
            from cct.solver import get_solver

            p = solver_param("convex" if job == "momentum" else job, d, args.quick)
            ConvWorker(get_solver(p, comm=LocalComm()).net, comm).serve()
            continue
        from cct.omnivore.mpi_exec import OmnivoreServer

        try:
            out[job] = (bench_momentum(comm, d, args.quick) if job == "momentum"
                        else bench_model(comm, job, d, args.quick, args.search_iters))
        finally:
            OmnivoreServer.stop_all(comm)
    if comm.rank == 0:
        Path(args.out).write_text(json.dumps(out, indent=1))


# -- report (parent) -------------------------------------------------------------------------
def report(out: dict, ranks: int, cpu: str, load: str) -> None:
    print(f"\nOmnivore, {ranks} MPI ranks (1 FC/model server + {ranks - 1} conv ranks) on {cpu}; load {load}")
    for model, r in out.items():
        if model in ("momentum", "environment"):
            continue
        print(f"\n{model}: target training loss {r['target_loss']} (mean of 20 iterations); "
              f"t_fc = {1e3 * r['t_fc_s']:.2f} ms, t_conv(1) = {1e3 * r['t_conv1_s']:.2f} ms (measured)")
        print("| g | mu | HE s/iter measured | HE predicted | SE iters to target | time to target s | reached |")
        print("|---|---|---|---|---|---|---|")
        for x in r["fixed_g"]:
            print(f"| {x['g']} | {x['mu']:.2g} | {x['s_per_iter']:.4f} | {x['predicted_s_per_iter']:.4f} | "
                  f"{x['iters']} | {x['wall_s']:.2f} | {x['reached']} |")
        a = r["auto"]
        print(f"| auto | - | - | - | {a['iters']} (+search) | {a['wall_s']:.2f} (incl. search) | {a['reached']} |")
        for line in a["decisions"]:
            print("   ", line)
        print(f"    search: {100 * a['search_fraction']:.1f}% of iterations")
        sh = r.get("search_share")
        if sh:
            print(f"  optimizer over {sh['total_train_iters']} training iterations (epochs of {sh['epoch_iters']}, "
                  f"trials of {sh['trial_iters']}): search {sh['search_iters']} iterations = "
                  f"{100 * sh['search_fraction_iters']:.1f}% of iterations, {100 * sh['search_fraction_time']:.1f}% "
                  f"of the time ({sh['trial_s']:.1f} s of {sh['trial_s'] + sh['train_s']:.1f} s)")
            for line in sh["decisions"]:
                print("   ", line)
        for n, rows in r["model_extrapolation_10gbit"].items():
            print(f"  MODEL ONLY (not measured), {n} ranks, 10 Gbit/s: " + ", ".join(
                f"g={x['g']}: {1e3 * x['time_per_iter']:.2f} ms{' (FC sat.)' if x['saturated'] else ''}" for x in rows))
    m = out.get("momentum")
    if m:
        print("\nImplicit momentum (explicit momentum 0): fit of V(t+1) = m V(t) - eta' grad(W(t))")
        print("| g | source | measured m | predicted 1-1/g | eta' fit (eta/g = 0.05/g) |")
        print("|---|---|---|---|---|")
        for x in m["rows"]:
            print(f"| {x['g']} | {x['source']} | {x['measured']:.3f} | {x['predicted']:.3f} | {x['eta_fit']:.4f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--models", default="lenet", help="lenet and/or cifar10_quick (comma-separated)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--search-iters", type=int, default=0,
                    help="also run the optimizer for this many training iterations (epochs of half that, default "
                         "trial length) and report the share of iterations and time its search takes")
    ap.add_argument("--data", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.data:  # we are a rank
        ranks_main(args)
        return
    from common import RESULTS

    tmp = Path(tempfile.mkdtemp(prefix="cct-omnivore-bench-"))
    try:
        make_data(tmp, args.quick)
        out_file = tmp / "out.json"
        mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        subprocess.run([mpiexec, "-n", str(args.ranks), sys.executable, __file__, "--data", str(tmp), "--out",
                        str(out_file), "--models", args.models, "--search-iters", str(args.search_iters)]
                       + (["--quick"] if args.quick else []),
                       check=True, env=env)
        out = json.loads(out_file.read_text())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    load = " ".join(open("/proc/loadavg").read().split()[:3])
    out["environment"] = {"cpu": cpu, "cores": os.cpu_count(), "ranks": args.ranks, "load_before_report": load}
    report(out, args.ranks, f"{cpu} ({os.cpu_count()} cores)", load)
    RESULTS.mkdir(exist_ok=True)
    name = "bench_omnivore_quick.json" if args.quick else "bench_omnivore.json"
    (RESULTS / name).write_text(json.dumps(out, indent=1))
    print(f"wrote {RESULTS / name}")


if __name__ == "__main__":
    main()
