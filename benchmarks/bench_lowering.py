"""Figure 8 of the CcT paper: the convolution strategies as the input (d) and output (o) channels vary.

For each point of two sweeps -- (a) d varies at fixed o, (b) o varies at fixed d, with n, k,
batch fixed -- this measures each lowering's time per pass, predicts it with the calibrated
cost model, and records the cost model's pick. As in the paper each type lowers the whole batch
in one call, and the pick is the type with the least whole-batch prediction. ``--chunked`` runs
each type as the engine's optimizer prices it instead: in the chunks of ``b_p`` images the cost
model picks for it (``BatchedLowering``, one partition), compared by chunked predictions (types 2
and 3 have no per-chunk entry points, so their chunks pay a copy the model does not price). ``--engine``
scores what a net runs: the optimizer's plan (:func:`cct.lowering.optimizer.plan_convolution`) of a layer
running the pass, against each type measured in the batch partitions and chunks the cost model gives
it (on this 2-core machine: two partitions of one thread, no cross-core hand-offs inside a pass). It reports the
fraction of points where the pick is the measured-fastest type (target >= 90%) and the worst
slowdown of the pick over the measured-fastest (target <= 10%), plus the same with a 5% tie
tolerance. The strategies are lowering types 1-3, direct and FFT convolution (``--types``);
``--extended`` adds thin-channel, 1x1 and large-kernel (k = 7, 11) points (issue 12's Figure 8
extension). ``--tune`` (with ``--engine``) also scores the plan as ``cct train`` makes it, its close
calls measured on the layer (:mod:`cct.lowering.tune`); ``--remeasure`` measures every point a second
time and scores that measurement's fastest like a pick: how often a re-measurement agrees with the
first on this machine, the ceiling of the score its timing noise allows.

    python benchmarks/bench_lowering.py --quick        # smoke run (~1 min on 2 cores)
    python benchmarks/bench_lowering.py                # full sweep (quiet machine)
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402


def _machine_at(level: str, threads: int, machines: dict):
    """The level's Machine for ``threads`` BLAS threads: the measured one at its own count, the cached
    calibration otherwise (``cct calibrate --threads N``)."""
    from cct.lowering import calibrate as cal

    m = machines[level]
    return m if threads == m.threads else cal.load_machine(measure_if_missing=False, threads=threads)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small smoke sweep")
    ap.add_argument("--n", type=int, default=13, help="input size n (n x n)")
    ap.add_argument("--k", type=int, default=3, help="kernel size k")
    ap.add_argument("--pad", type=int, default=0)
    ap.add_argument("--batch", type=int, default=None, help="images per batch (default 32, quick 8)")
    ap.add_argument("--chunked", action="store_true",
                    help="run each type in its cost-model chunks and pick by chunked predictions")
    ap.add_argument("--engine", action="store_true",
                    help="score the optimizer's own plan (plan_convolution) of a layer running the pass against each "
                         "type measured as the engine would run it: the partition count and chunk size the cost "
                         "model picks for that type (chunking.choose_chunking), each partition on threads // p")
    ap.add_argument("--tune", action="store_true",
                    help="with --engine: also score the plan with its close calls measured on the layer "
                         "(cct.lowering.tune, as cct train runs it; measured now, not read from the cache)")
    ap.add_argument("--remeasure", action="store_true",
                    help="measure every point twice and score the second measurement's fastest as a pick: the "
                         "agreement a re-measurement reaches on this machine (the noise ceiling of the score)")
    ap.add_argument("--fixed", type=int, default=None, help="the channel count held fixed (default 256, quick 128)")
    ap.add_argument("--values", default=None, help="comma-separated channel counts to sweep")
    ap.add_argument("--passes", default="fwd", help="fwd,bwd_data,bwd_weights or 'all'")
    ap.add_argument("--threads", type=int, default=None,
                    help="BLAS threads (default: the library default; 1 with --quick)")
    ap.add_argument("--blas", choices=("auto", "openblas", "mkl"), default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--keep-env", action="store_true", help="keep OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE")
    ap.add_argument("--recalibrate", action="store_true", help="re-measure the cost-model constants")
    ap.add_argument("--types", default="type1,type2,type3,direct,fft",
                    help="comma-separated strategies to measure and pick among")
    ap.add_argument("--extended", action="store_true",
                    help="add thin-channel, 1x1 and large-kernel (k = 7, 11) points to the d/o sweeps")
    ap.add_argument("--levels", default=None,
                    help="comma-separated calibration levels (first,full) to measure now and score side by side "
                         "(default: the cached calibration)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/lowering[_quick].json)")
    args = ap.parse_args(argv)
    removed = common.reexec_clean(keep_env=args.keep_env)
    from cct import blas as _blas

    _blas.limit_openblas_spin()  # as the engine does in a net: idle GEMM workers must not steal the cores

    import numpy as np

    from cct import blas
    from cct.lowering import calibrate as cal
    from cct.lowering import get_strategy
    from cct.lowering import optimizer as opt
    from cct.lowering.chunking import choose_chunking
    from cct.lowering.cost_model import predict_seconds
    from cct.lowering.partition import BatchedLowering
    from cct.lowering.tune import TuneCache, measure, run_pass

    if args.blas:
        blas.set_backend(args.blas)
    # quick runs are smoke tests on possibly shared machines: one BLAS thread is far less
    # sensitive to other processes (spinning OpenBLAS threads collapse under oversubscription)
    common.set_threads(args.threads or (1 if args.quick else None))
    rep = common.environment_report(removed)
    common.print_environment(rep)

    batch = args.batch or (8 if args.quick else 32)
    fixed = args.fixed or (128 if args.quick else 256)
    values = ([int(v) for v in args.values.split(",")] if args.values
              else ([16, 64, 256, 1024] if args.quick else [16, 32, 64, 128, 256, 512, 1024, 2048]))
    passes = ["fwd", "bwd_data", "bwd_weights"] if args.passes == "all" else args.passes.split(",")
    repeats = args.repeats or (3 if args.quick else 7)
    from cct.malloc import tune_malloc
    tune_malloc()
    if args.levels:  # each level measured now, not cached: picks scored side by side on the same timings
        machines = {lv: cal.calibrate(level=lv, save=False) for lv in args.levels.split(",")}
        for lv, m in machines.items():
            print(f"# calibration level {lv}: {m.info['seconds']:.1f} s")
    else:
        machines = {"cached": cal.calibrate() if args.recalibrate else cal.load_machine()}
    machine = next(iter(machines.values()))
    print(f"# cost model: machine {machine.key} threads {machine.threads} "
          f"({'nominal' if machine.nominal else 'calibrated'})")
    types = args.types.split(",")
    rng = np.random.default_rng(0)
    points = []
    cases = [(sweep, args.n, args.k, args.pad, *((v, fixed) if var == "d" else (fixed, v)))
             for sweep, var in (("a: vary d", "d"), ("b: vary o", "o")) for v in values]
    if args.extended:  # Figure 8 extended: thin channels, 1x1, large kernels
        thin = [4, 8] if args.quick else [3, 4, 8, 16]
        cases += [("thin", args.n, args.k, args.pad, c, c) for c in thin]
        cases += [("1x1", args.n, 1, 0, d, o) for d, o in ((fixed, fixed // 2), (fixed // 2, fixed))]
        cases += [(f"k{k}", max(args.n, k + 2), k, k // 2, d, o) for k in (7, 11) for d, o in ((16, 32), (64, 64))]
    for sweep, n_in, k, pad, d, o in cases:
        geom = common.conv_geom(n_in, k, d, o, pad=pad)
        x = rng.standard_normal((batch, d, n_in, n_in), dtype=np.float32)
        w = (rng.standard_normal(geom.weight_shape, dtype=np.float32) * 0.01).astype(np.float32)
        b = np.zeros(o, np.float32)
        dy = rng.standard_normal((batch, o) + geom.out_shape, dtype=np.float32)
        for p in passes:
            if args.engine:  # (partitions, b_p, predicted seconds) per type, as plan_convolution decides them
                chunking = {t: choose_chunking({p: t}, geom, batch, blas.get_num_threads(), None, None,
                                               opt.machine_for_threads) for t in types}
                strategies = {t: BatchedLowering(get_strategy(t), batch_partition=chunking[t][1],
                                                 partitions=chunking[t][0]) for t in types}
            else:
                strategies = {t: BatchedLowering(get_strategy(t), batch_partition="auto", partitions=1,
                                                 machine_for=opt.machine_for_threads)
                              if args.chunked else get_strategy(t) for t in types}
            fns = {t: functools.partial(run_pass, strategies[t], p, x, w, b, dy, geom) for t in types}
            for fn in fns.values():  # warm-up
                fn()
            # round-robin repeats, best of each: load bursts from other processes hit all types alike. Each
            # timed call follows an untimed one of the same type, so that it runs on warm caches as the
            # cost model's calibration does (a large FFT before it would otherwise leave them cold, and
            # charge the next type for it); each round starts one type later.
            meas = measure(fns, repeats)
            fastest = min(meas, key=meas.get)
            by_level = {}
            if args.remeasure:  # the same measurement again: how often the measured fastest is itself again
                again = measure(fns, repeats)
                by_level["remeasured"] = {"predicted": {}, "pick": min(again, key=again.get), "measured": again}
                by_level["remeasured"]["slowdown"] = meas[by_level["remeasured"]["pick"]] / meas[fastest] - 1.0
            for lv, m in machines.items():
                if args.engine:  # the optimizer's own plan of a layer running this pass, and its predictions
                    plan = opt.plan_convolution(geom, batch, m, passes=(p,), names=types,
                                                machine_for=lambda n, lv=lv: _machine_at(lv, n, machines))
                    pred = {t: plan.predictions[p].get(t, float("inf")) for t in types}
                    by_level[lv] = {"predicted": pred, "pick": plan.names[p], "partitions": plan.partitions,
                                    "b_p": plan.b_p, "slowdown": meas[plan.names[p]] / meas[fastest] - 1.0}
                    if args.tune:
                        tuned = opt.plan_convolution(geom, batch, m, passes=(p,), names=types,
                                                     machine_for=lambda n, lv=lv: _machine_at(lv, n, machines),
                                                     tune=TuneCache(m, persist=False))
                        by_level[f"{lv}+tuned"] = {"predicted": pred, "pick": tuned.names[p],
                                                   "tuned": tuned.measured,
                                                   "slowdown": meas[tuned.names[p]] / meas[fastest] - 1.0}
                    continue
                if args.chunked:  # what the engine's optimizer compares: each type in its cost-model chunks
                    pred = opt.predictions(geom, batch, m, p, names=types)
                else:
                    pred = {t: predict_seconds(t, geom, batch, m, p) for t in types}
                pick = min(pred, key=lambda t: (pred[t], t))
                by_level[lv] = {"predicted": pred, "pick": pick, "slowdown": meas[pick] / meas[fastest] - 1.0}
            first = by_level[next(iter(machines))]
            points.append({"sweep": sweep, "n": n_in, "k": k, "d": d, "o": o, "pass": p, "measured": meas,
                           "predicted": first["predicted"], "pick": first["pick"], "fastest": fastest,
                           "slowdown": first["slowdown"], "levels": by_level})

    rows = []
    for pt in points:
        rows.append([pt["sweep"].split(":")[0], pt["k"], pt["d"], pt["o"], f"{pt['d'] / pt['o']:.3g}", pt["pass"]]
                    + [f"{pt['measured'][t] * 1e3:.2f}/{pt['predicted'][t] * 1e3:.2f}" for t in types]
                    + [pt["pick"], pt["fastest"], f"{pt['slowdown'] * 100:.1f}%"])
    mode = ("as the engine runs it (partitions and chunks by the cost model)" if args.engine else
            "cost-model chunks (BatchedLowering, 1 partition)" if args.chunked else "whole batch per call")
    print(f"\nFigure 8: n={args.n} k={args.k} pad={args.pad} batch={batch} fixed={fixed}, {mode}; "
          "times in ms, measured/predicted")
    common.print_table(["fig", "k", "d", "o", "d/o", "pass"] + [f"{t} ms" for t in types]
                       + ["pick", "fastest", "slowdown"], rows)
    def score(level: str) -> dict:
        picks = [pt["levels"][level] for pt in points]
        n = len(picks)
        hits = sum(pk["pick"] == pt["fastest"] for pk, pt in zip(picks, points))
        near = sum(pk["slowdown"] <= 0.05 for pk in picks)
        worst = max((pk["slowdown"] for pk in picks), default=0.0)
        out = {"points": n, "pick_is_fastest": hits / n if n else 1.0, "pick_within_5pct": near / n if n else 1.0,
               "worst_slowdown": worst, "targets": {"pick_is_fastest": 0.9, "worst_slowdown": 0.10},
               "calibration_seconds": machines[level.split("+")[0]].info.get("seconds")
               if level.split("+")[0] in machines else None}
        out["meets_targets"] = out["pick_is_fastest"] >= 0.9 and worst <= 0.10
        print(f"\n[{level}] pick == measured fastest: {hits}/{n} = {out['pick_is_fastest']:.0%} (target >= 90%); "
              f"within 5%: {out['pick_within_5pct']:.0%}; worst slowdown {worst:.1%} (target <= 10%)")
        return out

    by_level = {lv: score(lv) for lv in (points[0]["levels"] if points else machines)}
    summary = dict(by_level[next(iter(machines))], levels=by_level)
    path = common.write_json("lowering_quick" if args.quick else "lowering",
                             {"config": {"n": args.n, "k": args.k, "pad": args.pad, "batch": batch, "fixed": fixed,
                                         "values": values, "passes": passes, "repeats": repeats,
                                         "chunked": bool(args.chunked), "engine": bool(args.engine), "types": types,
                                         "extended": bool(args.extended), "levels": list(machines)},
                              "environment": rep, "machine": machine.to_json(), "points": points,
                              "summary": summary}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
