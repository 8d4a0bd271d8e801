"""Whole training loops: ``cct train`` on the upstream solvers vs a PyTorch loop reading the same LMDB.

Usage::

    python benchmarks/bench_train.py                      # LeNet, 1000 iterations, 3 runs each
    python benchmarks/bench_train.py --models lenet,cifar10_quick --runs 3
    python benchmarks/bench_train.py --iterations 200 --runs 1   # a short run (say so when quoting it)

Each model trains from its upstream prototxts (``../shared/caffe-models``) with only the data
paths, ``max_iter``, ``test_interval`` and ``snapshot`` changed: LeNet on generated digits
(``cct make_digits``, 60000 + 10000 images in LMDB), cifar10_quick on synthetic 32x32 colour
images in LMDB with their mean file (``compute_image_mean``). The loop tests three times (before
the first iteration, as Caffe's default ``test_initialization`` does, at half the iterations and at
the end) and snapshots twice, as upstream LeNet's 10000/5000 schedule scaled to the run (the
PyTorch loop keeps the same schedule; before 2026-11-27 it skipped the first test): 1000 LeNet
iterations match the issue's BVLC Caffe figure (19.5-20.5 s on the 2-core Zen 4 machine, Caffe 1.0,
OpenBLAS).

* **cct**: ``python -m cct train SOLVER --phase_times`` in a fresh process, as a user runs it. The
  loop time is the log's ``Starting Optimization`` -> ``Optimization Done.``; ``startup`` is the
  process start -> ``Starting Optimization`` (imports, calibration, net setup); the phase split
  (data wait, forward, backward, update, test, snapshot, other) comes from ``--phase_times``.
* **pytorch**: the same net (``bench_e2e.torch_model``), SGD with the same momentum, weight
  decay and lr policy, reading the same LMDB records (Datum parsing, scale and mean as the
  prototxt) in a prefetch thread, the same test passes (``test_iter`` batches) and snapshots
  (``torch.save`` of model and optimizer), timed with the same phases.

* **caffe** (``--caffe BIN`` or ``$CAFFE_BIN``): a BVLC ``caffe train --solver=...`` on the same
  solver, net and LMDB, in the same run (its glog to stderr; the loop is timed from the same two
  log lines). No Caffe code ships with cct: build BVLC Caffe (CPU_ONLY) or install a distribution's
  package (Debian 11's ``caffe``, CPU_ONLY) and pass its binary; its version and BLAS are recorded.

The figure per framework is the median over ``--runs`` (spread shown); the table and
``results/bench_train.json`` name the CPU, the BLAS kernel and the load average.
"""
from __future__ import annotations

import argparse
import os
import queue
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import numpy as np
from common import (
    ROOT,
    caffe_line,
    caffe_report,
    environment_report,
    print_environment,
    print_table,
    reexec_clean,
    write_json,
)

SHARED = ROOT.parent / "shared" / "caffe-models"
CAFFE_LENET_1000_S = (19.5, 20.5)  # BVLC Caffe 1.0, 2-core Zen 4, LeNet 1000 iter, 2 tests, 2 snapshots (issue 12)
PHASES = ("data", "forward", "backward", "update", "test", "snapshot", "other")

MODELS = {
    "lenet": {"dir": "mnist", "net": "lenet_train_test.prototxt", "solver": "lenet_solver.prototxt",
              "iterations": 1000, "batch": 64, "shape": (1, 28, 28)},
    "cifar10_quick": {"dir": "cifar10", "net": "cifar10_quick_train_test.prototxt",
                      "solver": "cifar10_quick_solver.prototxt", "iterations": 500, "batch": 100,
                      "shape": (3, 32, 32)},
}


# -- data ---------------------------------------------------------------------------------------
def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return out


def make_data(model: str, work: Path) -> dict:
    """The model's train/test LMDBs (and mean file) under ``work``; returns their paths."""
    if model == "lenet":
        train, test = work / "digits_train_lmdb", work / "digits_test_lmdb"
        if not (train.exists() and test.exists()):
            _run([sys.executable, "-m", "cct", "make_digits", str(work), "--train", "60000", "--test", "10000"], work)
        return {"train": train, "test": test, "mean": None}
    from cct.tools.convert_mnist import write_images_db

    train, test, mean = work / "cifar_train_lmdb", work / "cifar_test_lmdb", work / "cifar_mean.binaryproto"
    if not (train.exists() and test.exists() and mean.exists()):
        colour = np.random.default_rng(0).integers(0, 256, (10, 3, 1, 1))  # one colour per class, in both sets
        for path, n, seed in ((train, 20000, 1), (test, 10000, 2)):
            rng = np.random.default_rng(seed)
            labels = rng.integers(0, 10, n)  # plus noise and a gradient per image
            images = np.empty((n, 3, 32, 32), np.uint8)
            ramp = np.linspace(-40, 40, 32)[None, None, :]
            for s in range(0, n, 2000):
                lab = labels[s:s + 2000]
                x = colour[lab] + ramp + rng.normal(0, 40, (len(lab), 3, 32, 32))
                images[s:s + 2000] = np.clip(x, 0, 255).astype(np.uint8)
            write_images_db(str(path), images, labels)
        _run([sys.executable, "-m", "cct", "compute_image_mean", str(train), str(mean)], work)
    return {"train": train, "test": test, "mean": mean}


def write_solver(model: str, work: Path, data: dict, iterations: int) -> Path:
    """The upstream solver + net with the data paths and the schedule of this run."""
    spec = MODELS[model]
    net = (SHARED / spec["dir"] / spec["net"]).read_text()
    net = re.sub(r'source: "[^"]*train[^"]*"', f'source: "{data["train"]}"', net)
    net = re.sub(r'source: "[^"]*test[^"]*"', f'source: "{data["test"]}"', net)
    if data["mean"] is not None:
        net = re.sub(r'mean_file: "[^"]*"', f'mean_file: "{data["mean"]}"', net)
    net_path = work / f"{model}_train_test.prototxt"
    net_path.write_text(net)
    half = max(1, iterations // 2)
    solver = (SHARED / spec["dir"] / spec["solver"]).read_text()
    for key, value in (("net", f'"{net_path}"'), ("max_iter", iterations), ("test_interval", half),
                       ("snapshot", half), ("snapshot_prefix", f'"{work / "snap" / model}"'),
                       ("solver_mode", "CPU"), ("display", 100)):
        solver, n = re.subn(rf"^{key}:.*$", f"{key}: {value}", solver, flags=re.M)
        if n == 0:
            solver += f"\n{key}: {value}\n"
    path = work / f"{model}_solver.prototxt"
    path.write_text(solver)
    return path


def read_solver(path: Path) -> dict:
    """The solver fields the PyTorch loop needs."""
    from cct.solver import read_solver_param

    p = read_solver_param(str(path))
    return {"base_lr": p.base_lr, "momentum": p.momentum, "weight_decay": p.weight_decay, "lr_policy": p.lr_policy,
            "gamma": p.gamma, "power": p.power, "max_iter": p.max_iter, "test_interval": p.test_interval,
            "test_iter": p.test_iter[0], "test_initialization": p.test_initialization, "snapshot": p.snapshot,
            "display": p.display}


# -- cct ----------------------------------------------------------------------------------------
_GLOG = re.compile(r"^[IWEF](\d{4})?(\d{4}) (\d\d):(\d\d):(\d\d\.\d+)")  # newer glog writes the year too
_PHASE = re.compile(r"^\s*(\w+):\s+([\d.]+) s\s+([\d.]+) ms/iter")


def _glog_time(line: str, year: int) -> float | None:
    m = _GLOG.match(line)
    if not m:
        return None
    yyyy, md, hh, mm, ss = m.groups()
    sec = float(ss)
    t = datetime(int(yyyy) if yyyy else year, int(md[:2]), int(md[2:]), int(hh), int(mm), int(sec))
    return t.timestamp() + (sec - int(sec))


def parse_train_log(text: str, year: int) -> dict:
    """Loop seconds (``Starting Optimization`` -> ``Optimization Done.``), the last test accuracy and
    cct's ``--phase_times`` split (seconds) from a glog-style ``train`` log (cct's or Caffe's)."""
    start = done = None
    phases: dict[str, float] = {}
    accuracy = None
    for line in text.splitlines():
        if "Starting Optimization" in line:
            start = _glog_time(line, year)
        elif "Optimization Done." in line:
            done = _glog_time(line, year)
        elif "Test net output" in line and "accuracy" in line:
            accuracy = float(line.rsplit("=", 1)[1].split()[0])
        else:
            body = line.split("] ", 1)[-1]
            m = _PHASE.match(body)
            if m and m.group(1) in PHASES:
                phases[m.group(1)] = float(m.group(2))
    if start is None or done is None:
        raise ValueError("no 'Starting Optimization' / 'Optimization Done.' in the log")
    return {"loop_s": done - start, "start": start, "phases_s": phases, "accuracy": accuracy}


def run_train(cmd: list[str], work: Path, what: str, env: dict | None = None) -> dict:
    """One training process (``cmd``) in ``work``: loop and startup seconds, phases, final test accuracy."""
    for f in (work / "snap").glob("*"):
        f.unlink()
    t_launch = time.time()
    out = subprocess.run(cmd, cwd=work, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{what} failed:\n{out.stderr[-3000:]}")
    try:
        r = parse_train_log(out.stderr, datetime.now().year)
    except ValueError as e:
        raise SystemExit(f"{what}: {e}") from None
    r["startup_s"] = r.pop("start") - t_launch
    return r


def run_cct(solver: Path, work: Path, extra: list[str]) -> dict:
    """One ``cct train`` in a fresh process, as a user runs it."""
    return run_train([sys.executable, "-m", "cct", "train", str(solver), "--phase_times", *extra], work, "cct train")


def run_caffe(binary: str, solver: Path, work: Path) -> dict:
    """One BVLC ``caffe train`` on the same solver (its glog to stderr)."""
    r = run_train([binary, "train", f"--solver={solver}"], work, "caffe train",
                  env=dict(os.environ, GLOG_logtostderr="1"))
    r["phases_s"] = {}
    return r


# -- PyTorch ------------------------------------------------------------------------------------
class LmdbBatches:
    """Batches of (float32 images, int64 labels) from a Caffe LMDB, in key order, wrapping around,
    read ahead in a thread (depth 4) as cct's data layer does."""

    def __init__(self, path: Path, batch: int, scale: float, mean: np.ndarray | None):
        import lmdb

        from cct.proto import caffe_pb2

        self.env = lmdb.open(str(path), readonly=True, lock=False)
        self.batch, self.scale, self.mean = batch, scale, mean
        self.datum = caffe_pb2.Datum()
        self.txn = self.env.begin()
        self.q: queue.Queue = queue.Queue(maxsize=4)
        self.stop = False
        self.thread = threading.Thread(target=self._fill, daemon=True, name="torch-data")
        self.thread.start()

    def _records(self):
        while True:
            for _, value in self.txn.cursor():
                self.datum.ParseFromString(value)
                d = self.datum
                yield np.frombuffer(d.data, np.uint8).reshape(d.channels, d.height, d.width), d.label

    def _fill(self) -> None:
        import torch

        records = self._records()
        while not self.stop:
            recs = [next(records) for _ in range(self.batch)]
            x = np.stack([r[0] for r in recs]).astype(np.float32)
            if self.mean is not None:
                x -= self.mean
            x *= self.scale
            y = np.array([r[1] for r in recs], np.int64)
            item = (torch.from_numpy(x), torch.from_numpy(y))
            while not self.stop:
                try:
                    self.q.put(item, timeout=0.05)
                    break
                except queue.Full:
                    continue

    def get(self):
        return self.q.get()

    def close(self) -> None:
        self.stop = True
        self.thread.join(5)
        self.env.close()


def _transform(model: str, data: dict) -> tuple[float, np.ndarray | None]:
    if model == "lenet":
        return 0.00390625, None
    from cct.io.blobproto import blobproto_to_array, read_binaryproto

    return 1.0, np.asarray(blobproto_to_array(read_binaryproto(data["mean"])), np.float32).reshape(3, 32, 32)


def run_torch(model: str, data: dict, solver: dict, work: Path) -> dict:
    """The same schedule in PyTorch; seconds per phase, like ``--phase_times``."""
    import torch
    from bench_e2e import torch_model

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(1)
    batch = MODELS[model]["batch"]
    scale, mean = _transform(model, data)
    net = torch_model(model)
    s = solver
    opt = torch.optim.SGD(net.parameters(), lr=s["base_lr"], momentum=s["momentum"], weight_decay=s["weight_decay"])
    if s["lr_policy"] == "inv":
        rate = lambda it: (1 + s["gamma"] * it) ** (-s["power"])  # noqa: E731
    else:
        rate = lambda it: 1.0  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(opt, rate)
    loss_fn = torch.nn.CrossEntropyLoss()
    train = LmdbBatches(data["train"], batch, scale, mean)
    test = LmdbBatches(data["test"], 100, scale, mean)
    ph = dict.fromkeys(PHASES, 0.0)
    clock = time.perf_counter
    accuracy = None

    def test_pass() -> float:
        net.eval()
        correct = total = 0
        with torch.no_grad():
            for _ in range(s["test_iter"]):
                x, y = test.get()
                out = net(x)
                loss_fn(out, y)
                correct += int((out.argmax(1) == y).sum())
                total += len(y)
        net.train()
        return correct / total

    t_start = clock()
    for it in range(s["max_iter"]):
        t0 = clock()
        # Caffe's schedule: a test before the first iteration too, unless test_initialization is false
        if s["test_interval"] and it % s["test_interval"] == 0 and (it > 0 or s["test_initialization"]):
            accuracy = test_pass()
        t1 = clock()
        opt.zero_grad(set_to_none=False)
        x, y = train.get()
        t2 = clock()
        loss = loss_fn(net(x), y)
        t3 = clock()
        loss.backward()
        t4 = clock()
        opt.step()
        sched.step()
        t5 = clock()
        if s["display"] and it % s["display"] == 0:
            loss.item()
        if s["snapshot"] and (it + 1) % s["snapshot"] == 0:
            torch.save({"model": net.state_dict(), "opt": opt.state_dict()}, work / "snap" / f"torch_{it + 1}.pt")
        t6 = clock()
        for name, dt in (("test", t1 - t0), ("data", t2 - t1), ("forward", t3 - t2), ("backward", t4 - t3),
                         ("update", t5 - t4), ("snapshot", t6 - t5)):
            ph[name] += dt
    t7 = clock()
    accuracy = test_pass()
    ph["test"] += clock() - t7
    loop = clock() - t_start
    ph["other"] = max(0.0, loop - sum(ph.values()))
    train.close()
    test.close()
    return {"loop_s": loop, "startup_s": None, "phases_s": ph, "accuracy": accuracy,
            "version": torch.__version__}


# -- main ---------------------------------------------------------------------------------------
def summarize(runs: list[dict], iterations: int, batch: int) -> dict:
    loops = [r["loop_s"] for r in runs]
    med = statistics.median(loops)
    best = runs[loops.index(min(loops, key=lambda v: abs(v - med)))]
    starts = [r["startup_s"] for r in runs if r["startup_s"] is not None]
    return {"loop_s": med, "loop_min_s": min(loops), "loop_max_s": max(loops), "iter_per_s": iterations / med,
            "img_per_s": iterations * batch / med, "startup_s": statistics.median(starts) if starts else None,
            "phases_ms_per_iter": {k: v * 1e3 / iterations for k, v in best["phases_s"].items()},
            "accuracy": best["accuracy"], "runs": runs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="lenet", help="comma list of: " + ", ".join(MODELS))
    ap.add_argument("--runs", type=int, default=3, help="runs per framework (the median is reported)")
    ap.add_argument("--iterations", type=int, default=None, help="iterations per run (default per model)")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch loop")
    ap.add_argument("--caffe", default=os.environ.get("CAFFE_BIN"),
                    help="a BVLC caffe binary to run on the same solver and LMDB side by side (default $CAFFE_BIN)")
    ap.add_argument("--workdir", default=None, help="where data and snapshots go (default a temp dir; kept)")
    ap.add_argument("--cct-args", default="", help="extra flags for cct train (e.g. '--lowering_mode caffe')")
    ap.add_argument("--keep-env", action="store_true", help="keep OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE")
    ap.add_argument("--out", default=None, help="JSON path (default results/bench_train[_quick].json)")
    args = ap.parse_args(argv)
    removed = reexec_clean(keep_env=args.keep_env)
    rep = environment_report(removed)
    print_environment(rep)
    caffe = caffe_report(args.caffe) if args.caffe else None
    if caffe:
        print(caffe_line(caffe))
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="cct-bench-train-"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "snap").mkdir(exist_ok=True)
    results = []
    rows = []
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        if model not in MODELS:
            raise SystemExit(f"unknown model '{model}' (known: {', '.join(MODELS)})")
        iters = args.iterations or MODELS[model]["iterations"]
        batch = MODELS[model]["batch"]
        data = make_data(model, work)
        solver = write_solver(model, work, data, iters)
        per = {}
        cct_runs = []
        for _ in range(args.runs):
            cct_runs.append(run_cct(solver, work, args.cct_args.split()))
        per["cct"] = summarize(cct_runs, iters, batch)
        if args.caffe:
            per["caffe"] = summarize([run_caffe(args.caffe, solver, work) for _ in range(args.runs)], iters, batch)
        if not args.no_torch:
            try:
                import torch  # noqa: F401
            except ImportError:
                print("# PyTorch is not installed: its loop is skipped", file=sys.stderr)
            else:
                sp = read_solver(solver)
                per["pytorch"] = summarize([run_torch(model, data, sp, work) for _ in range(args.runs)], iters, batch)
        for fw, r in per.items():
            ph = r["phases_ms_per_iter"]
            rows.append([model, fw, iters, f"{r['loop_s']:.2f} ({r['loop_min_s']:.2f}-{r['loop_max_s']:.2f})",
                         f"{r['iter_per_s']:.1f}", f"{r['img_per_s']:.0f}",
                         "-" if r["startup_s"] is None else f"{r['startup_s']:.1f}"]
                        + [f"{ph.get(k, 0.0):.2f}" for k in PHASES] + [r["accuracy"]])
        entry = {"model": model, "iterations": iters, "batch": batch, "results": per}
        if "pytorch" in per:
            entry["cct_vs_pytorch"] = per["pytorch"]["loop_s"] / per["cct"]["loop_s"]
        if "caffe" in per:
            entry["cct_vs_caffe_same_run"] = per["caffe"]["loop_s"] / per["cct"]["loop_s"]
        if model == "lenet" and iters == 1000 and "caffe" not in per:  # only a reference from another CPU
            entry["caffe_loop_s"] = CAFFE_LENET_1000_S
            entry["cct_vs_caffe"] = [c / per["cct"]["loop_s"] for c in CAFFE_LENET_1000_S]
        results.append(entry)
    print_table(["model", "framework", "iters", "loop s (min-max)", "iter/s", "img/s", "startup s"]
                + [f"{k} ms/it" for k in PHASES] + ["test acc"], rows)
    for e in results:
        if "cct_vs_pytorch" in e:
            print(f"# {e['model']}: cct loop {e['cct_vs_pytorch']:.2f}x PyTorch's (>1 = cct faster)")
        if "cct_vs_caffe_same_run" in e:
            print(f"# {e['model']}: cct loop {e['cct_vs_caffe_same_run']:.2f}x BVLC Caffe's, measured in this run "
                  "(>1 = cct faster)")
        if "cct_vs_caffe" in e:
            lo, hi = e["cct_vs_caffe"]
            print(f"# {e['model']}: cct loop {min(lo, hi):.2f}-{max(lo, hi):.2f}x BVLC Caffe's "
                  f"{CAFFE_LENET_1000_S[0]}-{CAFFE_LENET_1000_S[1]} s, measured on ANOTHER CPU (2-core Zen 4, "
                  "issue 12): compare only if this is that CPU; --caffe BIN measures Caffe in the same run")
    quick = args.iterations is not None and any(args.iterations < MODELS[e["model"]]["iterations"] for e in results)
    path = write_json("bench_train_quick" if quick else "bench_train",
                      {"environment": rep, "runs": args.runs, "results": results,
                       "cct_args": args.cct_args, "caffe": caffe}, args.out)
    print(f"# wrote {path}; data and snapshots in {work}")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
