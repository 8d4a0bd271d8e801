"""Run by tests/test_parallel_plan_overlap.py under mpiexec: train the solver in WORKDIR (Caffe's LeNet case)
ITERS iterations at BATCH samples per rank from its init weights under each per-layer PLAN, once per MODE:

* ``sync``: ``overlap=False`` (each slice's sum waited inside its layer's backward, data parallelism's buckets
  started after the whole backward);
* ``late0`` / ``late1``: overlapped (sums completed in finish_backward, buckets in the solver's update) with
  rank 0 (1) sleeping in the backward hook of every layer that started a sum, so the sums complete in the two
  orders (the sleeper's peers wait for them in finish_backward, the sleeper finds them done).

The root writes OUT/PLAN-MODE.npz (every learnable parameter after the slices are gathered, as p0, p1, ...) and
OUT/PLAN-MODE.json (losses, bytes exchanged, bytes summed, bytes all-reduced, the slices' sums).

python overlap_check.py WORKDIR BATCH ITERS OUT PLAN=L1:SPLIT,L2:SPLIT [PLAN=...]
"""
import json
import os
import sys
import time

import numpy as np

from cct.distributed import abort_on_error
from cct.io.prototxt import read_net_prototxt
from cct.parallel_plan.perlayer import enable_per_layer
from cct.parallel_plan.split import Split
from cct.solver import get_solver, read_solver_param

MODES = ("sync", "late0", "late1")
workdir, batch, iters, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), os.path.abspath(sys.argv[4])
plans = {name: {k: Split.parse(v) for k, _, v in (x.partition(":") for x in rest.split(","))}
         for name, _, rest in (a.partition("=") for a in sys.argv[5:])}
os.chdir(workdir)


def solver_at(batch: int):
    param = read_solver_param("solver.prototxt")
    net = read_net_prototxt(param.net)
    for layer in net.layer:
        if layer.HasField("hdf5_data_param"):
            layer.hdf5_data_param.batch_size = batch
    param.ClearField("net")
    param.net_param.CopyFrom(net)
    param.max_iter, param.display, param.snapshot = iters, 0, 0
    param.snapshot_after_train = False
    solver = get_solver(param)
    solver.net.copy_from("init.caffemodel")
    return solver


def run(name: str, splits: dict, mode: str) -> None:
    """Train under ``splits`` in ``mode``; the root writes the weights and the counts."""
    solver = solver_at(batch)
    comm = solver.comm
    with abort_on_error(comm):
        ex = enable_per_layer(solver, splits, overlap=mode != "sync")
        sums = sorted(ex._sums)
        if mode.startswith("late") and comm.rank == int(mode[-1]):
            solver.net.backward_hooks.append(lambda i: time.sleep(0.005) if i in sums else None)
        losses = []
        solver.add_callback(on_gradients_ready=lambda: losses.append(float(solver.smoothed_loss)))
        solver.solve()
        ex.gather_owned(solver.history)
        moved = comm.allgather_obj((ex.bytes_moved, ex.update_bytes))
    if comm.is_root:
        params = {f"p{k}": np.array(p.data) for k, p in enumerate(solver.net.learnable_params)}
        np.savez(os.path.join(out, f"{name}-{mode}.npz"), **params)
        info = {"losses": losses, "bytes_moved": [m[0] for m in moved], "update_bytes": [m[1] for m in moved],
                "allreduced": solver.parallel.sync.stats.bytes, "sums": [solver.net.layer_names[i] for i in sums],
                "layer_diffs_final": solver.parallel.sync.layer_diffs_final}
        with open(os.path.join(out, f"{name}-{mode}.json"), "w") as f:
            json.dump(info, f)
    ex.release()


for name, splits in plans.items():
    for mode in MODES:
        run(name, splits, mode)
