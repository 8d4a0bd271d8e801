"""Dropout in TRAIN on the CPU: the mask drawn on the host (cct before issue 30) vs the device random stream.

For CaffeNet's fc6/fc7 dropout shapes (batch 64 and 256, float32) this times one forward + backward of
the layer three ways in one process, alternating round by round: ``host`` reproduces the old layer (a
float32 draw from the global numpy generator, compared, converted and scaled, then ``x * mask``; backward
``dy * mask``), ``stream`` is today's layer (its Philox stream drawn by cct.kernels.philox straight into
the mask buffer), ``stream-numpy`` the same layer with ``CCT_KERNELS=numpy`` (the array-module path a GPU
runs). Reports the medians over rounds of each round's median.

    python benchmarks/bench_dropout.py --rounds 5

Writes benchmarks/results/bench_dropout.json (``--out`` to change).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import numpy as np  # noqa: E402

SHAPES = {"fc6/fc7 b64": (64, 4096), "fc6/fc7 b256": (256, 4096)}
RATIO = 0.5


def host_draw_step(x, y, dy, dx, rng) -> None:
    """The pre-issue-30 layer's TRAIN forward and backward (mask from the host generator)."""
    keep = rng.random(x.shape, dtype=np.float32) < np.float32(1.0 - RATIO)
    mask = keep.astype(x.dtype)
    mask *= x.dtype.type(1.0 / (1.0 - RATIO))
    np.multiply(x, mask, out=y)
    dx[...] = dy * mask


def measure(shape: tuple[int, int], rounds: int, repeats: int) -> dict:
    """Per-round medians (seconds) of the three ways for one shape, alternating round by round."""
    from cct import kernels, rng
    from cct.blob import Blob
    from cct.io.prototxt import parse_text
    from cct.layers import create_layer
    from cct.proto import caffe_pb2

    g = np.random.default_rng(0)
    x = g.standard_normal(shape).astype(np.float32)
    dy = g.standard_normal(shape).astype(np.float32)
    y, dx = np.empty_like(x), np.empty_like(x)
    lp = parse_text(f'name: "drop" type: "Dropout" dropout_param {{ dropout_ratio: {RATIO} }}',
                    caffe_pb2.LayerParameter())
    lp.phase = caffe_pb2.TRAIN
    layer = create_layer(lp)
    bottom, top = Blob(shape, dtype=np.float32), Blob(shape, dtype=np.float32)
    bottom.data[...] = x
    rng.set_random_seed(1)
    layer.setup([bottom], [top])
    top.diff[...] = dy
    host_rng = np.random.default_rng(1)

    def stream_step():
        layer.forward([bottom], [top])
        layer.backward([top], [True], [bottom])

    def stream_numpy_step():
        with kernels.forced_mode("numpy"):
            stream_step()

    ways = {"host": lambda: host_draw_step(x, y, dy, dx, host_rng), "stream": stream_step,
            "stream-numpy": stream_numpy_step}
    per_round: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(rounds):
        for k, fn in ways.items():
            per_round[k].append(common.time_call(fn, repeats=repeats)["median"])
    return per_round


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=7, help="calls per round (median taken)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--keep-env", action="store_true")
    args = ap.parse_args()
    removed = common.reexec_clean(keep_env=args.keep_env)
    env = common.environment_report(removed)
    common.print_environment(env)
    rows, results = [], {}
    for label, shape in SHAPES.items():
        per_round = measure(shape, args.rounds, args.repeats)
        med = {k: statistics.median(v) for k, v in per_round.items()}
        results[label] = {"shape": shape, "rounds_s": per_round, "median_s": med}
        rows.append([label, f"{med['host'] * 1e3:.3f}", f"{med['stream'] * 1e3:.3f}",
                     f"{med['stream-numpy'] * 1e3:.3f}", f"{med['host'] / med['stream']:.2f}x"])
    common.print_table(["shape", "host draw ms", "stream ms", "stream (numpy path) ms", "host / stream"], rows)
    path = common.write_json("bench_dropout", {"env": env, "ratio": RATIO, "results": results}, args.out)
    print(f"# wrote {path}")


if __name__ == "__main__":
    main()
