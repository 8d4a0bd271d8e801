"""Run by the distributed tests, under mpiexec or alone: train the solver in WORKDIR with every
data layer's batch_size set to BATCH (per rank), and write the final weights (root) to OUT.

python train_run.py WORKDIR BATCH ITERS OUT [--init W] [--snapshot K] [--resume STATE] [--iter_size S]
                   [--tensorboard DIR] [--parallel owt] [--test_batch T] [++ WORKDIR BATCH ITERS OUT ...]

Runs separated by ``++`` train one after another in the same processes (one launch, one import of cct:
the tests fold several runs into one ``mpiexec``); before each, rank 0 writes ``RUN_MARK`` and the run's
index to stderr so a test can cut the log into its runs.
"""
import argparse
import json
import logging
import os
import sys

import cct
from cct.distributed import launcher_rank_size
from cct.io.prototxt import read_net_prototxt
from cct.log import init_log
from cct.proto import caffe_pb2
from cct.solver import get_solver, read_solver_param

a = argparse.ArgumentParser()
a.add_argument("workdir")
a.add_argument("batch", type=int)
a.add_argument("iters", type=int)
a.add_argument("out")
a.add_argument("--init", default=None)
a.add_argument("--solver", default="solver.prototxt", help="the solver file in WORKDIR")
a.add_argument("--snapshot", type=int, default=0)
a.add_argument("--resume", default=None)
a.add_argument("--iter_size", type=int, default=1)
a.add_argument("--shares", default=None, help="auto or b0,b1,... (unequal per-rank batch sizes)")
a.add_argument("--die", default=None, help="RANK:ITER:kill|raise - that rank fails at that iteration")
a.add_argument("--devices", default=None, help="split each rank's batch over these devices (cct.set_devices)")
a.add_argument("--tensorboard", default=None, help="TensorBoard event folder (the root rank writes it)")
a.add_argument("--test_batch", type=int, default=None, help="TEST-phase data layers read this batch (default BATCH)")
a.add_argument("--parallel", default="data",
               help="data, owt, owtN (the tail split n=N), conv:L1,L2 (conv layers by output channel), "
                    "spatial:h=2:L1,L2;w=2:L3 (by height/width), measure:L1=h=2;L2=c=2 (auto's measured "
                    "pick with this optimum), auto, FILE")
RUN_MARK = "=== train_run.py run"  # tests/mpirun.py cuts the log at it


def train(args: argparse.Namespace) -> None:
    """One run: train as the arguments say, write OUT (and OUT.json) on the root."""
    if args.devices:
        cct.set_devices(args.devices.split(","), shares=[0.5, 0.5])
    os.chdir(args.workdir)
    param = read_solver_param(args.solver)
    net = read_net_prototxt(param.net)
    for layer in net.layer:
        for f in ("hdf5_data_param", "data_param", "image_data_param"):
            if layer.HasField(f):
                test_only = any(rule.phase == caffe_pb2.TEST for rule in layer.include)
                getattr(layer, f).batch_size = args.test_batch if test_only and args.test_batch else args.batch
    param.ClearField("net")
    param.net_param.CopyFrom(net)
    param.max_iter = args.iters
    param.iter_size = args.iter_size
    param.snapshot = args.snapshot
    param.snapshot_prefix = "snap"
    shares = args.shares if args.shares in (None, "auto") else [int(x) for x in args.shares.split(",")]
    solver = get_solver(param, shares=shares, tensorboard=args.tensorboard)
    if args.init:
        solver.net.copy_from(args.init)
    losses = []
    solver.add_callback(on_gradients_ready=lambda: losses.append(solver.smoothed_loss))
    if args.die:
        import signal

        from cct.errors import CctError

        die_rank, die_iter, how = args.die.split(":")

        def die():
            if solver.comm.rank == int(die_rank) and solver.iter == int(die_iter):
                if how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise CctError(f"injected failure at iteration {solver.iter}")

        solver.add_callback(on_start=die)
    owt, all_bytes = None, None
    if solver.comm is not None and solver.comm.size > 1:
        from cct.distributed import abort_on_error

        with abort_on_error(solver.comm):
            if args.parallel.startswith("owt"):
                from cct.parallel_plan.owt import enable_owt

                owt = enable_owt(solver, int(args.parallel[3:] or 1))
            elif args.parallel.startswith(("conv:", "spatial:")):  # conv:L1,L2 (c=N); spatial:h=2:L1,L2[;w=2:L3]
                from cct.parallel_plan.perlayer import enable_per_layer
                from cct.parallel_plan.split import Split

                kind, _, rest = args.parallel.partition(":")
                groups = ([(f"c={solver.comm.size}", rest)] if kind == "conv"
                          else [g.split(":") for g in rest.split(";")])
                owt = enable_per_layer(solver, {name: Split.parse(how) for how, names in groups
                                                for name in names.split(",")})
            elif args.parallel.startswith("measure:"):  # auto's measured pick with this optimum:
                # measure:conv1=h=2;pool1=h=2;conv2=c=2 (layer=configuration; the other layers by sample)
                from cct.parallel_plan.execute import run_measured
                from cct.parallel_plan.split import Split

                best = {k: Split.parse(v) for k, _, v in (x.partition("=") for x in args.parallel[8:].split(";"))}
                run_measured(solver, best)
                split = solver.net.executor
                owt = split if hasattr(split, "gather_owned") else None
            elif args.parallel != "data":  # auto or a plan file
                from cct.parallel_plan.execute import setup_parallel

                setup_parallel(solver, args.parallel)
                split = solver.net.executor  # a split executor, else data parallelism was kept
                owt = split if hasattr(split, "gather_owned") else None
            solver.solve(args.resume)
            if owt is not None:
                owt.gather_owned(solver.history)
                all_bytes = solver.comm.allgather_obj(owt.bytes_moved)
    else:
        solver.solve(args.resume)
    if solver.is_root:
        solver.net.save(args.out)
        with open(args.out + ".json", "w") as f:
            json.dump({"losses": losses, "ranks": 1 if solver.parallel is None else solver.parallel.size,
                       "shares": None if solver.parallel is None else solver.parallel.shares,
                       "stats": None if solver.parallel is None else solver.parallel.sync.stats.as_dict(),
                       "owt_bytes": None if owt is None else owt.bytes_moved, "split_bytes_all": all_bytes,
                       "flat_params_intact": solver.net.flat_params.intact()}, f)
    if args.devices:
        cct.set_devices(None)  # the next run starts on the plain single-device path


init_log(logging.INFO if (launcher_rank_size() or (0, 1))[0] == 0 else logging.WARNING)  # rank 0 logs, as cct train
runs, run = [], []
for word in sys.argv[1:] + ["++"]:
    if word == "++":
        runs.append(a.parse_args(run))
        run = []
    else:
        run.append(word)
for index, args in enumerate(runs):
    if (launcher_rank_size() or (0, 1))[0] == 0:
        print(f"{RUN_MARK} {index}", file=sys.stderr, flush=True)
    train(args)
