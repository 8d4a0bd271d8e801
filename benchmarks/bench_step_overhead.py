"""The solver's host overhead per training iteration, two source trees side by side in one run.

A tiny net (a 5-input InnerProduct of 3 outputs, SoftmaxWithLoss and Accuracy on batch 4) keeps the
arithmetic negligible, so what ``Solver.step`` spends per iteration is the bookkeeping around the layers:
the loss, the checks, the smoothed loss, the update loop. Each round times ``--iters`` iterations of
every tree in turn, in a fresh single-threaded process (``PYTHONPATH`` set to the tree), as ten blocks
timed in process CPU time of which the fastest counts (the least disturbed by other load on the host);
the table gives each tree's median over the rounds, in CPU microseconds per iteration.

    python benchmarks/bench_step_overhead.py --trees base=/path/to/old/checkout,new=. --rounds 5
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from common import ROOT, print_table, write_json

CHILD = r"""
import sys, time
import numpy as np
from cct.io.prototxt import parse_text
from cct.proto import caffe_pb2
from cct.solver import get_solver
NET = '''
layer { name: "x" type: "DummyData" top: "x" top: "label"
        dummy_data_param { shape { dim: 4 dim: 5 } shape { dim: 4 }
                           data_filler { type: "gaussian" } data_filler { type: "constant" value: 1 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "y" bottom: "label" top: "loss" }
layer { name: "acc" type: "Accuracy" bottom: "y" bottom: "label" top: "acc" }
'''
p = parse_text('base_lr: 0.01 lr_policy: "fixed" momentum: 0.9 average_loss: 10', caffe_pb2.SolverParameter())
parse_text(NET, p.net_param)
p.solver_mode = caffe_pb2.SolverParameter.CPU
s = get_solver(p)
s.step(200)
n = int(sys.argv[1]) // 10
best = float("inf")
for _ in range(10):
    t = time.process_time()
    s.step(n)
    best = min(best, (time.process_time() - t) / n * 1e6)
print(best)
"""


def time_tree(path: str, iters: int) -> float:
    """Microseconds per iteration of the tree at ``path`` (a fresh process)."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(path), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", CHILD, str(iters)], env=env, check=True, capture_output=True,
                         text=True, cwd=os.path.abspath(path))
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", default=f"this={ROOT}", help="name=path,... source trees to compare")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    trees = dict(item.split("=", 1) for item in args.trees.split(","))
    times: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, path in trees.items():
            times[name].append(time_tree(path, args.iters))
    first = next(iter(trees))
    base = statistics.median(times[first])
    rows = [[name, " / ".join(f"{t:.1f}" for t in ts), f"{statistics.median(ts):.1f}",
             f"{statistics.median(ts) / base:.3f}"] for name, ts in times.items()]
    print_table(["tree", "us/iteration per round", "median", f"/ {first}"], rows)
    path = write_json("bench_step_overhead", {"iters": args.iters, "trees": list(trees), "us_per_iteration": times},
                      args.out)
    print(json.dumps({"written": str(path)}))


if __name__ == "__main__":
    main()
