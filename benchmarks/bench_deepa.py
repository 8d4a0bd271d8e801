"""Per-layer parallelism (DeePa, issue 32) from the cost model: bytes moved per step and predicted step
time of data parallelism, OWT and the DeePa choice for CaffeNet, VGG-16 and Inception-v3 at W = 2, 4, 16
(the paper's Figure 8 table), the search time, and the slow-network check on CaffeNet.

``python benchmarks/bench_deepa.py [--batch 512] [--speed 20] [--quick] [--measure] [--measure_modes data,owt,auto]
[--measure_only] [--overlap on|off|both] [--rounds R] [--out NAME]``

``--measure`` also trains on this machine's MPI ranks (``mpiexec``): LeNet and CaffeNet (DummyData,
per-rank batch 64 and 4) on 2 and 4 ranks under data parallelism and OWT (the executed plans), the
median seconds per iteration of 3 timed runs (the slowest rank's) and the bytes each rank hands to MPI
per step (an all-reduce counted as a ring moves it, 2 (N-1)/N of its payload), side by side with the
cost model's prediction for the same ranks (links measured by the ping-pong, layer times measured with
one thread, N ranks sharing this machine's cores), and the rank correlation of predicted and measured.
``--measure_modes data,auto`` measures ``--parallel auto`` (what it ran after measuring the candidates
on the ranks) beside data parallelism: its step time over data parallelism's (the 1.05x check).
``--overlap both`` runs each LeNet per-layer plan (``mixed``, ``tailmix``, ...) twice side by side: with the
per-layer executor's communication overlapped with backward (the default) and synchronous (``MODE-sync``:
``overlap=False``), with the seconds per step the ranks waited for what was not hidden.

THIS IS A MODEL, NOT A MEASUREMENT OF A CLUSTER. Each layer's forward + backward is measured once on
this machine (``--reference_batch`` samples, cached per machine); a worker of the described cluster
computes ``--speed`` times as fast; links: W = 2 and 4 are one machine (``--intra`` bytes/s), W = 16 is
4 machines x 4 workers (``--inter`` between machines). The slow-network check reruns CaffeNet at W = 16
on 16 machines of one worker linked at ``--slow_inter``. Transfers are exact byte counts of the
configurations (halos included), forward and backward; parameter reduction is a ring all-reduce
(2 (r-1) x slice bytes in all).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment_report, print_environment, reexec_clean, write_json  # noqa: E402

from cct import blas  # noqa: E402
from cct.parallel_plan.cluster import Cluster, parse_rate  # noqa: E402
from cct.parallel_plan.compute import ScaledCompute, compute_cache, reference_rates  # noqa: E402
from cct.parallel_plan.graph import graph_from_net, planning_net  # noqa: E402
from cct.parallel_plan.planner import plan_net  # noqa: E402
from cct.parallel_plan.plans import Plan, optimal  # noqa: E402
from cct.parallel_plan.split import Split  # noqa: E402
from cct.paths import shared_path  # noqa: E402

MODELS = {
    "caffenet": (ROOT / "models/caffenet/train_val_synthetic.prototxt", 8),
    "vgg16": (shared_path("zoo", "vgg16_official_v1.prototxt"), 2),
    "inception_v3": (shared_path("zoo", "inception_v3.prototxt"), 2),
}


def cluster_for(workers: int, intra: float, inter: float, speed: float) -> Cluster:
    """W <= 4: one machine; more: machines of 4 workers."""
    per = min(workers, 4)
    return Cluster(workers // per, per, intra, inter, speed)


MEASURED = (("lenet", 2, 64, 20), ("lenet", 4, 64, 20), ("caffenet", 2, 4, 3), ("caffenet", 4, 4, 3))


def training_net(model: str, batch: int):
    """The TRAIN net of ``model`` on DummyData at ``batch`` samples per rank (no data files needed)."""
    from cct.io import parse_text, read_net_prototxt
    from cct.proto import caffe_pb2

    if model == "caffenet":
        net = read_net_prototxt(str(ROOT / "models/caffenet/train_val_synthetic.prototxt"))
        for layer in net.layer:
            if layer.type == "DummyData":
                for shape in layer.dummy_data_param.shape:
                    shape.dim[0] = batch
        return net
    full = read_net_prototxt(str(ROOT / "models/lenet/lenet_train_test.prototxt"))
    net = parse_text(f"""name: "LeNet" layer {{ name: "data" type: "DummyData" top: "data" top: "label"
        dummy_data_param {{ shape {{ dim: {batch} dim: 1 dim: 28 dim: 28 }} shape {{ dim: {batch} }}
        data_filler {{ type: "gaussian" std: 1 }} data_filler {{ type: "constant" value: 0 }} }} }}""",
                     caffe_pb2.NetParameter())
    for layer in full.layer:
        if layer.type not in ("Data", "Accuracy"):
            net.layer.add().CopyFrom(layer)
    return net


def lenet_modes(ranks: int) -> dict[str, dict[str, Split]]:
    """LeNet's per-layer plans measured beside data parallelism (layer -> Split; the others by sample):
    ``spatial`` conv1, pool1, conv2 by height; ``conv`` conv1, conv2 by channel; ``mixed`` conv1, pool1 by
    height, conv2 and the tail by channel; ``tailmix`` ip1 by channel, ip2 by sample (the search's optimum
    on this machine); on 4 ranks ``factored``: two split axes per layer (n=2 h=2, n=2 c=2, ...)."""
    h, c = Split(h=ranks), Split(c=ranks)
    modes = {"spatial": {"conv1": h, "pool1": h, "conv2": h}, "conv": {"conv1": c, "conv2": c},
             "mixed": {"conv1": h, "pool1": h, "conv2": c, "ip1": c, "ip2": c}, "tailmix": {"ip1": c}}
    if ranks == 4:
        modes["factored"] = {"conv1": Split(n=2, h=2), "pool1": Split(n=2, w=2), "conv2": Split(n=2, c=2),
                             "pool2": Split(h=2, c=2), "ip1": Split(n=2, c=2), "ip2": c}
    return modes


def rank_run(model: str, batch: int, mode: str, iters: int, out: str) -> None:
    """Under mpiexec: time ``iters`` training iterations (3 runs) of ``model`` under ``mode``; rank 0 writes
    the median per-iteration seconds of the slowest rank and the bytes per step to ``out``."""
    import numpy as np

    from cct.distributed import abort_on_error
    from cct.parallel_plan.execute import setup_parallel
    from cct.parallel_plan.links import measure_links
    from cct.parallel_plan.owt import enable_owt
    from cct.parallel_plan.perlayer import enable_per_layer
    from cct.proto import caffe_pb2
    from cct.solver import get_solver

    param = caffe_pb2.SolverParameter(base_lr=0.001, momentum=0.9, lr_policy="fixed", max_iter=10**6, display=0,
                                      snapshot_after_train=False, random_seed=1)
    param.net_param.CopyFrom(training_net(model, batch))
    solver = get_solver(param)
    comm, n = solver.comm, solver.comm.size
    plan, sync = mode.removesuffix("-sync"), mode.endswith("-sync")  # MODE-sync: the executor without overlap
    with abort_on_error(comm):
        links = measure_links(comm)
        t = time.perf_counter()
        if mode == "auto":
            setup_parallel(solver, "auto")  # the model's pick checked by measuring the candidates on the ranks
            ex = solver.net.executor
        elif plan in lenet_modes(n):
            ex = enable_per_layer(solver, lenet_modes(n)[plan], overlap=not sync)
        elif mode in ("owt", "data"):
            ex = enable_owt(solver) if mode == "owt" else None
        else:
            raise SystemExit(f"error: mode {mode} is not defined for {model} on {n} ranks")
        setup_s = time.perf_counter() - t
        solver.step(2)
        runs = []
        for _ in range(3):
            comm.barrier()
            t = time.perf_counter()
            solver.step(iters)
            runs.append(comm.allreduce_scalar((time.perf_counter() - t) / iters, op="max"))
        done = 2 + 3 * iters
        ring = 2.0 * (n - 1) / n * solver.parallel.sync.stats.bytes
        owt = ((ex.bytes_moved + getattr(ex, "update_bytes", 0)) / done) if ex is not None else 0.0  # + slice sums
        per_rank = comm.allgather_obj(ring + owt)
        waited = (solver.parallel.sync.stats.wait_s + getattr(ex, "sum_wait_s", 0.0)) / done  # not hidden
        wait_s = comm.allreduce_scalar(waited, op="max")
    if comm.is_root:
        groups = getattr(ex, "sample_groups", None)
        if ex is None or groups is not None:
            ran = "data" if ex is None else "owt" if groups == 1 else f"tail n={groups}"
        else:
            ran = "deepa" if mode == "auto" else plan  # auto: the search's optimum, layer by layer
        Path(out).write_text(json.dumps({"step_s": float(np.median(runs)), "runs": runs, "ran": ran,
                                         "overlap": not sync, "wait_s": wait_s,
                                         "setup_s": setup_s, "bytes_per_step": float(sum(per_rank)),
                                         "links": links}))


def predicted(model: str, ranks: int, batch: int, links: dict) -> dict:
    """The cost model's data / OWT estimates for ``ranks`` ranks of this machine (layer times at 1 thread)."""
    import os

    net, _ = planning_net(training_net(model, batch))
    bw = links.get("shm", links["copy"])
    cl = Cluster(1, ranks, bw, bw, min(1.0, (os.cpu_count() or 1) / ranks))
    with blas.blas_threads(1):
        rates = reference_rates(net, graph_from_net(net, ranks * batch), batch, compute_cache())
    compute = ScaledCompute(rates, cl.speed)
    res = plan_net(net, cl, compute, "auto", ranks * batch)
    out = {k: res.estimates[k].totals() for k in ("data", "owt", "auto")}
    if model == "lenet":  # the per-layer plans of rank_run
        for mode, splits in lenet_modes(ranks).items():
            plan = Plan(ranks, {node.name: splits.get(node.name, Split(n=ranks)) for node in res.priced.graph.nodes})
            out[mode] = plan_net(net, cl, compute, plan, ranks * batch).chosen.totals()
    return out


def measure(args) -> dict:
    """Every point of :data:`MEASURED` under data and OWT, measured and predicted."""
    import subprocess
    import tempfile

    from scipy.stats import spearmanr

    from cct.distributed.launch import mpiexec_path

    points = []
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryDirectory() as tmp:
        for model, ranks, batch, iters in MEASURED:
            if model not in args.measure_models.split(",") or str(ranks) not in args.measure_ranks.split(","):
                continue
            for rnd in range(args.rounds):  # rounds interleave the modes: the load's drift hits each alike
                for mode in overlap_modes(args.measure_modes.split(","), args.overlap):
                    out = Path(tmp) / f"{model}-{ranks}-{mode}-{rnd}.json"
                    p = subprocess.run([mpiexec_path(), "-n", str(ranks), sys.executable, __file__, "--rank_run",
                                        f"{model},{batch},{mode},{iters},{out}"], env=env, capture_output=True,
                                       text=True)
                    if p.returncode != 0:
                        why = [ln for ln in p.stderr.splitlines() if "OWT:" in ln or "error" in ln.lower()]
                        print(f"# {model} {ranks} ranks {mode}: not run ({why[-1].strip() if why else p.returncode})")
                        continue
                    got = json.loads(out.read_text())
                    point = next((q for q in points if (q["model"], q["ranks"], q["mode"]) == (model, ranks, mode)),
                                 None)
                    if point is not None:  # a later round: every run of every round, median
                        point["measured_runs"] += got["runs"]
                        point["waits"].append(got["wait_s"])
                        point["measured_step_s"] = statistics.median(point["measured_runs"])
                        point["wait_s"] = statistics.median(point["waits"])
                    else:
                        pred = predicted(model, ranks, batch, got["links"]).get(got["ran"])  # auto: what it ran
                        points.append({"model": model, "ranks": ranks, "batch_per_rank": batch, "mode": mode,
                                       "ran": got["ran"], "setup_s": got["setup_s"],
                                       "measured_step_s": got["step_s"], "measured_runs": list(got["runs"]),
                                       "measured_bytes": got["bytes_per_step"], "overlap": got["overlap"],
                                       "wait_s": got["wait_s"], "waits": [got["wait_s"]],
                                       "predicted_step_s": pred["seconds"] if pred else None,
                                       "predicted_bytes": pred["total_bytes"] if pred else None, "links": got["links"]})
                    print(f"{model:<9s} {ranks:>2d} ranks {mode:<12s} round {rnd + 1} ran {got['ran']:<9s} measured "
                          f"{got['step_s'] * 1e3:9.1f} ms {got['bytes_per_step'] / 2**20:8.2f} MiB waited "
                          f"{got['wait_s'] * 1e3:6.2f} ms", flush=True)
    for q in points:
        pred = f"{q['predicted_step_s'] * 1e3:9.1f} ms {q['predicted_bytes'] / 2**20:8.2f} MiB" \
            if q["predicted_step_s"] is not None else "-"
        print(f"{q['model']:<9s} {q['ranks']:>2d} ranks {q['mode']:<12s} median of {len(q['measured_runs'])} runs "
              f"{q['measured_step_s'] * 1e3:9.1f} ms {q['measured_bytes'] / 2**20:8.2f} MiB waited "
              f"{q['wait_s'] * 1e3:6.2f} ms | predicted {pred}")
    ranked = [p for p in points if p["mode"] != "auto" and p["overlap"] and p["predicted_step_s"] is not None]
    corr = None
    if len(ranked) >= 3:
        rho = spearmanr([p["predicted_step_s"] for p in ranked], [p["measured_step_s"] for p in ranked])
        corr = float(rho.statistic if hasattr(rho, "statistic") else rho[0])
        print(f"rank correlation of predicted and measured step time over {len(ranked)} points: {corr:.3f}")
    auto_vs_data = {}
    for p in points:
        base = next((q for q in points if q["mode"] == "data" and (q["model"], q["ranks"]) == (p["model"], p["ranks"])),
                    None)
        if p["mode"] == "auto" and base is not None:
            ratio = p["measured_step_s"] / base["measured_step_s"]
            auto_vs_data[f"{p['model']}-{p['ranks']}"] = {"ran": p["ran"], "ratio": ratio}
            same = " (the same plan as data: run-to-run spread)" if p["ran"] == "data" else ""
            print(f"auto on {p['model']} x {p['ranks']} ranks ran {p['ran']}: {ratio:.3f}x data parallelism's step "
                  f"({'within' if ratio <= 1.05 else 'OVER'} 1.05x){same}")
    overlap_vs_sync = {}
    for p in points:
        twin = next((q for q in points if q["mode"] == p["mode"] + "-sync" and q["ranks"] == p["ranks"]
                     and q["model"] == p["model"]), None)
        if twin is not None:
            ratio = p["measured_step_s"] / twin["measured_step_s"]
            overlap_vs_sync[f"{p['model']}-{p['ranks']}-{p['mode']}"] = ratio
            print(f"{p['model']} x {p['ranks']} ranks {p['mode']}: overlapped {p['measured_step_s'] * 1e3:.1f} ms "
                  f"(waited {p['wait_s'] * 1e3:.2f}) vs synchronous {twin['measured_step_s'] * 1e3:.1f} ms (waited "
                  f"{twin['wait_s'] * 1e3:.2f}): {ratio:.3f}x")
    return {"points": points, "spearman": corr, "auto_vs_data": auto_vs_data, "overlap_vs_sync": overlap_vs_sync}


def overlap_modes(modes: list[str], overlap: str) -> list[str]:
    """The measured modes under ``--overlap``: a per-layer plan as it is (overlapped), as ``PLAN-sync``
    (``off``), or both side by side (``both``); data, OWT and auto as they are."""
    out = []
    for mode in modes:
        per_layer = mode not in ("data", "owt", "auto")
        if overlap != "off" or not per_layer:
            out.append(mode)
        if per_layer and overlap != "on":
            out.append(f"{mode}-sync")
    return out


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--rank_run":
        model, batch, mode, iters, out = sys.argv[2].split(",")
        rank_run(model, int(batch), mode, int(iters), out)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=512, help="global batch (the paper's 512)")
    ap.add_argument("--speed", type=float, default=20.0, help="a worker's compute rate relative to this machine")
    ap.add_argument("--intra", default="10G", help="bytes/s between workers of one machine")
    ap.add_argument("--inter", default="1.25G", help="bytes/s between machines")
    ap.add_argument("--slow_inter", default="0.125G", help="the slow network of the CaffeNet check")
    ap.add_argument("--workers", default="2,4,16")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--search_runs", type=int, default=3, help="timed searches per point (median reported)")
    ap.add_argument("--quick", action="store_true", help="CaffeNet only, W = 2, 16")
    ap.add_argument("--measure", action="store_true", help="also train on MPI ranks of this machine (see above)")
    ap.add_argument("--measure_modes", default="data,owt", help="--measure under these (data, owt, auto; "
                    "LeNet only: spatial, conv, mixed, tailmix and on 4 ranks factored: see lenet_modes)")
    ap.add_argument("--measure_models", default="lenet,caffenet", help="--measure these nets")
    ap.add_argument("--measure_ranks", default="2,4", help="--measure on these rank counts")
    ap.add_argument("--rounds", type=int, default=1, help="--measure every mode this many times, interleaved "
                    "(each point: the median of every round's runs)")
    ap.add_argument("--measure_only", action="store_true", help="--measure without the cost-model table")
    ap.add_argument("--overlap", choices=("on", "off", "both"), default="on",
                    help="per-layer plans with communication overlapped with backward (on), synchronous (off: "
                         "PLAN-sync), or both side by side")
    ap.add_argument("--out", default=None, help="result file name under results/ (default bench_deepa.json)")
    ap.add_argument("--keep-env", action="store_true")
    args = ap.parse_args()
    removed = reexec_clean(keep_env=args.keep_env)
    env = environment_report(removed)
    print_environment(env)
    intra, inter = parse_rate(args.intra, "--intra"), parse_rate(args.inter, "--inter")
    slow = parse_rate(args.slow_inter, "--slow_inter")
    models = ["caffenet"] if args.quick else args.models.split(",")
    workers = [2, 16] if args.quick else [int(w) for w in args.workers.split(",")]
    print("# MODEL: layer times measured on this machine, scaled to workers --speed times as fast; links as given")
    cache = compute_cache()
    rows, checks = [], {}
    for name in [] if args.measure_only else models:
        path, ref_batch = MODELS[name]
        net, _ = planning_net(str(path))
        t = time.perf_counter()
        rates = reference_rates(net, graph_from_net(net, args.batch), ref_batch, cache)
        print(f"# {name}: {len(rates)} nodes measured at {ref_batch} samples in {time.perf_counter() - t:.1f} s "
              f"(or cached)")
        for w in workers:
            cl = cluster_for(w, intra, inter, args.speed)
            res = plan_net(net, cl, ScaledCompute(rates, cl.speed), "auto", args.batch)
            cg = res.priced.cost_graph()
            search = []
            for _ in range(args.search_runs):
                t = time.perf_counter()
                optimal(res.priced)
                search.append(time.perf_counter() - t)
            configs = max(len(s) for s in res.priced.splits)
            for strategy in ("data", "owt", "auto"):
                tot = res.estimates[strategy].totals()
                rows.append({"model": name, "workers": w, "cluster": cl.describe(), "strategy": strategy,
                             "step_ms": tot["seconds"] * 1e3, "compute_ms": tot["compute_s"] * 1e3,
                             "update_ms": tot["update_s"] * 1e3, "xfer_ms": tot["xfer_s"] * 1e3,
                             "bytes_mib": tot["total_bytes"] / 2**20, "activation_mib": tot["xfer_bytes"] / 2**20,
                             "gradient_mib": tot["update_bytes"] / 2**20, "nodes": len(res.priced.graph.nodes),
                             "max_configs": configs, "residual": res.residual,
                             "search_s_median": statistics.median(search), "search_s_runs": search,
                             "edges": len(cg.edges)})
            if w == workers[-1] and name == "caffenet":
                slow_cl = Cluster(w, 1, slow, slow, args.speed)  # every worker its own machine: all links slow
                sres = plan_net(net, slow_cl, ScaledCompute(rates, slow_cl.speed), "auto", args.batch)
                d, a = sres.estimates["data"].totals(), sres.estimates["auto"].totals()
                checks["caffenet_slow_network"] = {
                    "cluster": slow_cl.describe(), "data_bytes_mib": d["total_bytes"] / 2**20,
                    "auto_bytes_mib": a["total_bytes"] / 2**20, "ratio": d["total_bytes"] / a["total_bytes"],
                    "data_step_ms": d["seconds"] * 1e3, "auto_step_ms": a["seconds"] * 1e3,
                    "auto_plan": {k: str(v) for k, v in sres.plan.splits.items()}}
            if w == workers[-1]:
                checks[f"{name}_plan_W{w}"] = {k: str(v) for k, v in res.plan.splits.items()}

    print(f"\n{'model':<13s} {'W':>3s} {'plan':<5s} {'step ms':>9s} {'compute':>9s} {'update':>9s} {'xfer':>9s} "
          f"{'MiB/step':>9s} {'x fewer':>8s} {'nodes':>6s} {'left':>5s} {'search ms':>10s}")
    for r in rows:
        base = next(x for x in rows if x["model"] == r["model"] and x["workers"] == r["workers"]
                    and x["strategy"] == "data")
        ratio = base["bytes_mib"] / r["bytes_mib"] if r["bytes_mib"] else float("inf")
        print(f"{r['model']:<13s} {r['workers']:>3d} {r['strategy']:<5s} {r['step_ms']:>9.1f} {r['compute_ms']:>9.1f} "
              f"{r['update_ms']:>9.1f} {r['xfer_ms']:>9.1f} {r['bytes_mib']:>9.1f} {ratio:>8.2f} {r['nodes']:>6d} "
              f"{r['residual']:>5d} {r['search_s_median'] * 1e3:>10.1f}")
    if "caffenet_slow_network" in checks:
        c = checks["caffenet_slow_network"]
        print(f"\nCaffeNet, slow network ({c['cluster']}): data {c['data_bytes_mib']:.1f} MiB/step, DeePa "
              f"{c['auto_bytes_mib']:.1f} MiB/step: {c['ratio']:.1f}x fewer bytes "
              f"({'meets' if c['ratio'] >= 5 else 'MISSES'} the 5x check); step {c['data_step_ms']:.1f} -> "
              f"{c['auto_step_ms']:.1f} ms")
    measured = measure(args) if args.measure or args.measure_only else None
    name = (args.out or ("bench_deepa_quick.json" if args.quick else "bench_deepa.json")).removesuffix(".json")
    out = write_json(name, {"environment": env, "args": vars(args), "model": "cost model (see docstring)",
                            "rows": rows, "checks": checks, "measured": measured})
    print(f"# wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
