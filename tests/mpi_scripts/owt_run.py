"""Run by tests/test_parallel_plan_owt.py under mpiexec: train the solver in WORKDIR under OWT
(convolutions by sample, the fully-connected tail by output channel) with every data layer's batch_size
set to BATCH per rank; rank 0 writes the final weights to OUT and the losses and bytes to OUT.json.

python owt_run.py WORKDIR BATCH ITERS OUT [--init W] [--snapshot K]
"""
import argparse
import json
import logging
import os

from cct.distributed import abort_on_error, launcher_rank_size
from cct.io.prototxt import read_net_prototxt
from cct.log import init_log
from cct.parallel_plan.owt import enable_owt
from cct.solver import get_solver, read_solver_param

a = argparse.ArgumentParser()
a.add_argument("workdir")
a.add_argument("batch", type=int)
a.add_argument("iters", type=int)
a.add_argument("out")
a.add_argument("--init", default=None)
a.add_argument("--snapshot", type=int, default=0)
args = a.parse_args()
init_log(logging.INFO if (launcher_rank_size() or (0, 1))[0] == 0 else logging.WARNING)
os.chdir(args.workdir)
param = read_solver_param("solver.prototxt")
net = read_net_prototxt(param.net)
for layer in net.layer:
    for f in ("hdf5_data_param", "data_param", "image_data_param"):
        if layer.HasField(f):
            getattr(layer, f).batch_size = args.batch
param.ClearField("net")
param.net_param.CopyFrom(net)
param.max_iter = args.iters
param.snapshot = args.snapshot
param.snapshot_prefix = "snap"
solver = get_solver(param)
if args.init:
    solver.net.copy_from(args.init)
    solver.parallel.broadcast_weights()
losses = []
solver.add_callback(on_gradients_ready=lambda: losses.append(solver.smoothed_loss))
with abort_on_error(solver.comm):
    owt = enable_owt(solver)
    solver.solve()
    owt.gather_owned(solver.history)
if solver.is_root:
    solver.net.save(args.out)
    with open(args.out + ".json", "w") as f:
        json.dump({"losses": losses, "ranks": solver.parallel.size, "owt_bytes": owt.bytes_moved,
                   "allreduce_bytes": solver.parallel.sync.stats.bytes}, f)
