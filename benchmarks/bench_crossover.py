"""Crossover map of the convolution strategies (GEMM lowerings, direct, FFT) and a ZNNi-style 3-D net.

``map`` (default): for 2-D and 3-D layers over a grid of kernel sizes and channel counts (input =
output channels), measures each strategy's forward + both backward passes on one batch, and the
optimizer's predictions for the same; prints which strategy is measured fastest per cell, the
optimizer's pick, and the pick's slowdown over the fastest.

``net3d``: forward throughput (output voxels/s) of a small 3-D ConvNet in the spirit of ZNNi's n337
-- four 3x3x3 convolutions, a 2x2x2 max pooling after the first two -- against the input patch
size, per strategy (every conv layer forced to it) and with the optimizer free to choose, under a
memory budget (``--budget``, the engine's one budget field); a strategy whose workspace exceeds the
budget is skipped, as the optimizer would.

    python benchmarks/bench_crossover.py --quick            # smoke run (~1-2 min on 2 cores)
    python benchmarks/bench_crossover.py --mode net3d --quick
    python benchmarks/bench_crossover.py --gpu 0 --batch 64 --n2 32   # the map on a GPU (CuPy), measured only

With ``--gpu`` every strategy runs its array-module path on CuPy arrays (the GPU synchronized after
each timed fwd+bwd); the cost model prices CPUs only, so the GPU map has no predictions or pick.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

STRATEGIES = ("type1", "type2", "type3", "direct", "fft")


def geom_nd(nd: int, n: int, k: int, c: int, m: int, pad: int = 0):
    """A cubic (``nd``-D) ConvGeometry with input size ``n`` and kernel ``k``."""
    from cct.lowering import ConvGeometry

    o = n + 2 * pad - k + 1
    return ConvGeometry(c, m, 1, (n,) * nd, (k,) * nd, (pad,) * nd, (1,) * nd, (1,) * nd, (o,) * nd, True)


def measure_strategy(name, geom, batch, repeats, rng, xp=None):
    """Best seconds of forward + data gradient + weight gradient of ``name`` on one batch (arrays in
    ``xp``'s memory: numpy by default, cupy for a GPU)."""
    import numpy as np

    from cct.lowering import get_strategy

    xp = xp or np
    s = get_strategy(name)
    x = xp.asarray(rng.standard_normal((batch, geom.channels_in) + geom.in_shape, dtype=np.float32))
    w = xp.asarray(rng.standard_normal(geom.weight_shape, dtype=np.float32) * np.float32(0.1))
    dy = xp.asarray(rng.standard_normal((batch, geom.channels_out) + geom.out_shape, dtype=np.float32))
    sync = xp.cuda.Device().synchronize if xp is not np else (lambda: None)

    def run():
        s.forward(x, w, None, geom)
        s.backward_data(dy, w, geom)
        s.backward_weights(dy, x, geom)
        sync()

    return common.time_call(run, repeats=repeats, warmup=1)["best"]


def crossover_map(args, machine, rep) -> dict:
    import numpy as np

    from cct.lowering import optimizer as opt

    rng = np.random.default_rng(0)
    xp = None
    if args.gpu is not None:
        import cupy

        cupy.cuda.Device(args.gpu).use()
        xp = cupy
    grids = {2: dict(n=args.n2, ks=[1, 3, 5, 7, 11] if not args.quick else [1, 3, 7],
                     chans=[4, 16, 64] if not args.quick else [4, 32]),
             3: dict(n=args.n3, ks=[1, 3, 5] if not args.quick else [1, 3, 5],
                     chans=[4, 16, 32] if not args.quick else [4, 16])}
    points = []
    for nd, grid in grids.items():
        for k in grid["ks"]:
            for c in grid["chans"]:
                g = geom_nd(nd, grid["n"], k, c, c, pad=k // 2)
                names = [n for n in STRATEGIES if n in opt.candidates(g)]
                meas = {n: measure_strategy(n, g, args.batch, args.repeats, rng, xp) for n in names}
                fastest = min(meas, key=meas.get)
                point = {"nd": nd, "n": grid["n"], "k": k, "channels": c, "measured": meas, "fastest": fastest}
                if xp is None:
                    plan = opt.choose_plan(g, args.batch, machine, per_pass=False, names=names)
                    point.update(predicted={n: sum(plan.predictions[p][n] for p in ("fwd", "bwd_data", "bwd_weights"))
                                            for n in names},
                                 pick=plan.single, slowdown=meas[plan.single] / meas[fastest] - 1.0)
                points.append(point)
                picked = f", pick {point['pick']} ({point['slowdown']:.0%} slower)" if "pick" in point else ""
                print(f"  {nd}-D k={k} c={c}: fastest {fastest}{picked}", flush=True)
    if xp is not None:
        rows = [[f"{p['nd']}-D", p["n"], p["k"], p["channels"]]
                + [f"{p['measured'][s] * 1e3:.2f}" if s in p["measured"] else "-" for s in STRATEGIES]
                + [p["fastest"]] for p in points]
        print(f"\nCrossover map on the GPU, batch {args.batch}: fwd+bwd ms measured")
        common.print_table(["dims", "n", "k", "c=m"] + list(STRATEGIES) + ["fastest"], rows)
        wins = {s: sum(p["fastest"] == s for p in points) for s in STRATEGIES}
        from cct.lowering.tune import device_name

        gpu = {"name": device_name(xp), "cupy": xp.__version__}  # the device made current above
        print(f"GPU: {gpu['name']} (CuPy {gpu['cupy']}); fastest counts {wins}")
        return {"points": points, "gpu": gpu, "summary": {"points": len(points), "fastest_counts": wins}}
    rows = [[f"{p['nd']}-D", p["n"], p["k"], p["channels"]]
            + [f"{p['measured'][s] * 1e3:.2f}/{p['predicted'][s] * 1e3:.2f}" if s in p["measured"] else "-"
               for s in STRATEGIES] + [p["fastest"], p["pick"], f"{p['slowdown']:.0%}"] for p in points]
    print(f"\nCrossover map, batch {args.batch}: fwd+bwd ms measured/predicted")
    common.print_table(["dims", "n", "k", "c=m"] + list(STRATEGIES) + ["fastest", "pick", "slowdown"], rows)
    hits = sum(p["pick"] == p["fastest"] for p in points)
    worst = max((p["slowdown"] for p in points), default=0.0)
    print(f"pick == measured fastest: {hits}/{len(points)}; worst slowdown {worst:.0%}")
    return {"points": points, "summary": {"points": len(points), "pick_is_fastest": hits / max(1, len(points)),
                                          "worst_slowdown": worst}}


NET3D = """name: "n337" layer { name: "data" type: "Input" top: "data"
  input_param { shape { dim: %(b)d dim: 1 dim: %(s)d dim: %(s)d dim: %(s)d } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: %(f)d kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
  convolution_param { num_output: %(f)d kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv3" type: "Convolution" bottom: "pool2" top: "conv3"
  convolution_param { num_output: %(f)d kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "relu3" type: "ReLU" bottom: "conv3" top: "conv3" }
layer { name: "conv4" type: "Convolution" bottom: "conv3" top: "conv4"
  convolution_param { num_output: 3 kernel_size: 3 weight_filler { type: "xavier" } } }
"""


def net3d(args, machine, rep) -> dict:
    import numpy as np

    import cct
    from cct.config import using_config
    from cct.io.prototxt import parse_text
    from cct.lowering.budget import memory_budget
    from cct.proto import caffe_pb2

    if args.budget:  # the engine's budget (until Config.memory_budget: $CCT_LOWERING_MEMORY)
        os.environ["CCT_LOWERING_MEMORY"] = str(args.budget)
    budget = memory_budget(args.budget)
    sizes = [int(v) for v in (args.sizes or ("26,34" if args.quick else "26,34,50,66")).split(",")]
    rows, points = [], []
    for s in sizes:
        param = parse_text(NET3D % {"b": 1, "s": s, "f": args.filters}, caffe_pb2.NetParameter())
        for name in ("optimizer",) + STRATEGIES:
            overrides = {} if name == "optimizer" else {"*": name}
            try:
                with using_config(engine={"overrides": overrides}):
                    net = cct.Net(param, cct.TEST)
                    ws = [lay.plan.chosen_workspace() for lay in net.layers if getattr(lay, "plan", None) is not None]
                    if name != "optimizer" and max(ws, default=0) > budget:
                        points.append({"size": s, "strategy": name, "skipped": "over budget"})
                        continue
                    net.blobs["data"].data[...] = np.random.default_rng(0).standard_normal(net.blobs["data"].shape)
                    net.forward()
                    best = float("inf")
                    for _ in range(args.repeats):
                        t0 = time.perf_counter()
                        net.forward()
                        best = min(best, time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - a strategy that cannot run a size is reported, not fatal
                points.append({"size": s, "strategy": name, "skipped": f"{type(e).__name__}: {e}"})
                continue
            out = net.blobs["conv4"].shape
            voxels = int(np.prod(out[2:]))
            picks = {lay.name: lay.lowering.name for lay in net.layers if lay.type == "Convolution"}
            points.append({"size": s, "strategy": name, "seconds": best, "output_voxels": voxels,
                           "voxels_per_s": voxels / best, "workspace_bytes": max(ws, default=0), "picks": picks})
            rows.append([s, name, f"{best * 1e3:.1f}", voxels, f"{voxels / best:.3g}",
                         f"{max(ws, default=0) / 2**20:.1f}", ",".join(picks.values()) if name == "optimizer" else ""])
            print(f"  patch {s}^3 {name}: {voxels / best:.3g} voxels/s", flush=True)
    print(f"\n3-D ConvNet (n337-like, {args.filters} filters), forward, budget {budget / 2**20:.0f} MiB")
    common.print_table(["patch", "strategy", "ms", "out voxels", "voxels/s", "workspace MiB", "picks"], rows)
    return {"points": points, "budget": budget, "filters": args.filters}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("map", "net3d"), default="map")
    ap.add_argument("--quick", action="store_true", help="small smoke grid")
    ap.add_argument("--batch", type=int, default=None, help="images per batch (default 16, quick 4)")
    ap.add_argument("--n2", type=int, default=24, help="2-D input size")
    ap.add_argument("--n3", type=int, default=12, help="3-D input size")
    ap.add_argument("--sizes", default=None, help="net3d: comma-separated input patch sizes")
    ap.add_argument("--filters", type=int, default=16, help="net3d: feature maps per layer")
    ap.add_argument("--budget", default=None, help="net3d: memory budget (e.g. 256M; default the engine's)")
    ap.add_argument("--threads", type=int, default=None, help="BLAS threads (default: library default; quick 1)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--keep-env", action="store_true", help="keep OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE")
    ap.add_argument("--gpu", type=int, default=None, help="map: measure on this GPU (CuPy) instead of the CPU")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.gpu is not None and args.mode != "map":
        ap.error("--gpu measures the map only")
    removed = common.reexec_clean(keep_env=args.keep_env)
    from cct import blas as _blas

    _blas.limit_openblas_spin()  # as the engine does in a net: idle GEMM workers must not steal the cores
    from cct import kernels
    from cct.lowering import calibrate as cal

    threads = args.threads or (1 if args.quick else None)
    common.set_threads(threads)
    if threads:
        kernels.set_num_threads(threads)
    args.batch = args.batch or (4 if args.quick else 16)
    args.repeats = args.repeats or (2 if args.quick else 5)
    rep = common.environment_report(removed)
    common.print_environment(rep)
    machine = cal.load_machine(measure_if_missing=args.gpu is None)  # the GPU map uses no CPU model
    print(f"# cost model: machine {machine.key} threads {machine.threads} direct {machine.direct_gflops:.3g} "
          f"fft {machine.fft_gflops:.3g} GFLOPS")
    result = crossover_map(args, machine, rep) if args.mode == "map" else net3d(args, machine, rep)
    name = f"crossover_{args.mode}" + ("_gpu" if args.gpu is not None else "") + ("_quick" if args.quick else "")
    path = common.write_json(name, dict(result, environment=rep, machine=machine.to_json(),
                                        config={k: v for k, v in vars(args).items()}), args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
