"""The solver update alone (``Solver.apply_update``) on the CPU: the per-parameter path against the fused pass
over the flat buffers (``cct.solver.flat_update``, numpy), for every solver type, in the same process.

    python benchmarks/bench_update.py                        # LeNet and cifar10_quick, 3 rounds x 30 updates
    python benchmarks/bench_update.py --models lenet --types SGD,Adam --rounds 5
    python benchmarks/bench_update.py --paths per-param    # only the default CPU path (runs on older trees too)
    python benchmarks/bench_update.py --layout             # whole SGD steps: flat buffers vs separate arrays

Each model's TRAIN net (synthetic Input data, ``bench_e2e.synthetic_net_param``) gets fixed random gradients;
two solvers of each type (same seed: same weights) are timed round by round, the per-parameter one and the flat
one alternating, ``--updates`` updates a round; the figure is the median over rounds of the mean update time.
The per-parameter SGD path is the numba kernel (``cct.kernels.update.sgd_l2``) where numba imports.

``--layout``: whole training steps (``bench_e2e.build_solver``: SGD, LeNet b64 / cifar10_quick b100) of two
solvers in one process, one with its parameters in the flat buffers (as every solver now has them), one with
them rebound to separately allocated arrays (the layout before the flat buffers; the per-parameter path then
runs), ``--rounds`` alternating rounds of ``--updates`` steps; the figure is the median of the round medians.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from bench_e2e import build_solver, synthetic_net_param
from common import environment_report, print_environment, print_table, reexec_clean, write_json

TYPES = {
    "SGD": dict(momentum=0.9),
    "Nesterov": dict(momentum=0.9),
    "AdaGrad": dict(delta=1e-8),
    "RMSProp": dict(rms_decay=0.98, delta=1e-8),
    "AdaDelta": dict(momentum=0.95, delta=1e-6),
    "Adam": dict(momentum=0.9, momentum2=0.999, delta=1e-8),
}


PATHS = ("per-param", "flat")


def build(model: str, kind: str, flat: bool):
    from cct.proto import caffe_pb2
    from cct.solver import get_solver

    sp = caffe_pb2.SolverParameter(type=kind, base_lr=0.001, weight_decay=5e-4, lr_policy="fixed", max_iter=10 ** 6,
                                   display=0, random_seed=1, **TYPES[kind])
    sp.net_param.CopyFrom(synthetic_net_param(model, 1))
    sp.solver_mode = caffe_pb2.SolverParameter.CPU
    s = get_solver(sp)
    if flat:
        s.use_flat_update(True)
    return s


def time_updates(s, grads, n: int) -> float:
    total = 0.0
    for _ in range(n):
        for p, g in zip(s.net.learnable_params, grads):
            p.diff[...] = g
        t0 = time.perf_counter()
        s.apply_update()
        total += time.perf_counter() - t0
    return total / n


def time_steps(s, n: int) -> float:
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        s.step(1)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def compare_layout(models: list[str], rounds: int, steps: int) -> tuple[list, list]:
    """Whole SGD steps, flat buffers vs separately allocated parameter arrays (see the module docstring)."""
    rows, results = [], []
    for model in models:
        batch = {"lenet": 64, "cifar10_quick": 100}.get(model, 32)
        flat, separate = build_solver(model, batch), build_solver(model, batch)
        for p in separate.net.learnable_params:
            p.data, p.diff = p.data.copy(), p.diff.copy()
        separate.net._share_weights()
        separate.history = [h.copy() for h in separate.history]
        assert flat.net.flat_params.intact() and not separate.net.flat_params.intact()
        flat.step(2)
        separate.step(2)
        t_sep, t_flat = [], []
        for _ in range(rounds):
            t_sep.append(time_steps(separate, steps))
            t_flat.append(time_steps(flat, steps))
        ms, mf = statistics.median(t_sep), statistics.median(t_flat)
        rows.append([model, batch, f"{ms * 1e3:.2f}", f"{mf * 1e3:.2f}", f"{mf / ms:.2f}"])
        results.append({"model": model, "batch": batch, "separate_s": t_sep, "flat_s": t_flat,
                        "separate_median_s": ms, "flat_median_s": mf})
    return rows, results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="lenet,cifar10_quick")
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--updates", type=int, default=30)
    ap.add_argument("--paths", default="per-param,flat", help="per-param, flat or both (comma-separated)")
    ap.add_argument("--layout", action="store_true", help="time whole SGD steps, flat vs separate arrays")
    ap.add_argument("--out", default=None)
    ap.add_argument("--keep-env", action="store_true")
    a = ap.parse_args(argv)
    removed = reexec_clean(keep_env=a.keep_env)
    env = environment_report(removed)
    print_environment(env)
    if a.layout:
        rows, results = compare_layout(a.models.split(","), a.rounds, a.updates)
        print_table(["model", "batch", "separate arrays ms", "flat buffers ms", "flat / separate"], rows)
        write_json("bench_update_layout", {"env": env, "rounds": a.rounds, "steps": a.updates, "results": results},
                   a.out)
        return 0
    rows, results = [], []
    paths = a.paths.split(",")
    if not paths or any(p not in PATHS for p in paths):
        ap.error(f"--paths: give per-param, flat or both, not {a.paths!r}")
    for model in a.models.split(","):
        for kind in a.types.split(","):
            solvers = {path: build(model, kind, path == "flat") for path in paths}
            rng = np.random.default_rng(0)
            first = next(iter(solvers.values()))
            grads = [rng.standard_normal(p.shape).astype(np.float32) * 1e-2 for p in first.net.learnable_params]
            n_params = sum(g.size for g in grads)
            times: dict[str, list[float]] = {path: [] for path in paths}
            for s in solvers.values():
                time_updates(s, grads, 2)  # warm-up (numba compiles)
            for _ in range(a.rounds):
                for path, s in solvers.items():
                    times[path].append(time_updates(s, grads, a.updates))
            med = {path: statistics.median(t) for path, t in times.items()}
            ratio = f"{med['flat'] / med['per-param']:.2f}" if len(med) == 2 else "-"
            rows.append([model, kind, n_params] + [f"{med[p] * 1e6:.0f}" if p in med else "-" for p in PATHS]
                        + [ratio])
            results.append({"model": model, "type": kind, "params": n_params,
                            **{f"{p}_s": t for p, t in times.items()}, **{f"{p}_median_s": m for p, m in med.items()}})
    print_table(["model", "solver", "params", "per-param us", "flat us", "flat / per-param"], rows)
    write_json("bench_update", {"env": env, "rounds": a.rounds, "updates": a.updates, "results": results}, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
