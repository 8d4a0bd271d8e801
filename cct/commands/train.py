"""``cct train``: train or finetune a model from a solver prototxt (Caffe's ``caffe train``), on one process,
under ``mpiexec`` (data parallel, per-layer parallel plans) or in Omnivore mode (``--groups``)."""
from __future__ import annotations

import argparse
import logging

from ..errors import CctError
from ..flags import FlagParser, command_parser
from ..omnivore.train import omnivore_train
from ..parallel_plan.execute import setup_parallel
from ..parallel_plan.inprocess import check_cpu_devices, run_device_workers, worker_config
from ..progress import Progress
from ..proto import caffe_pb2
from ..runsetup import (
    add_common_arguments,
    add_device_arguments,
    engine_config,
    init_logging,
    run_config,
    stages,
    wants_progress,
)
from ..solver import get_solver, read_solver_param, signals
from .mpi import mpi_world

log = logging.getLogger("cct")


def build_parser() -> FlagParser:
    """The flags of ``cct train``."""
    p = command_parser("train", "Train or finetune a model.")
    p.add_argument("solver_pos", nargs="?", metavar="SOLVER", help="the solver prototxt (same as --solver)")
    p.add_argument("--solver", default=None, help="the solver definition prototxt")
    p.add_argument("--weights", default=None,
                   help="comma-separated .caffemodel/.h5 files to initialise (finetune) from")
    p.add_argument("--snapshot", default=None, help="a .solverstate to resume training from")
    p.add_argument("--iterations", type=int, default=None, help="override the solver's max_iter")
    p.add_argument("--sigint_effect", default="stop", help="what SIGINT does: stop, snapshot or none")
    p.add_argument("--sighup_effect", default="snapshot", help="what SIGHUP does: stop, snapshot or none")
    p.add_argument("--groups", default=None,
                   help="Omnivore mode under mpiexec -n N: auto (the optimizer picks the compute groups, momentum "
                        "and rate per epoch), sync, async, or a number of conv compute groups (docs/omnivore.md)")
    p.add_argument("--omnivore_epoch", type=int, default=None,
                   help="with --groups auto: iterations per optimizer epoch (default a quarter of the run)")
    p.add_argument("--omnivore_fail_rank", type=int, default=-1, help=argparse.SUPPRESS)  # tests: this rank fails
    p.add_argument("--omnivore_fail_kill", action="store_true", help=argparse.SUPPRESS)  # tests: ... by SIGKILL
    p.add_argument("--phase_times", action="store_true",
                   help="time each iteration's data wait, forward, backward, update, test and snapshot; "
                        "log the summary at the end")
    p.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="write TensorBoard event files to DIR: train loss and outputs at each display, test outputs, "
                        "lr (root rank only; the [tensorboard] extra)")
    p.add_argument("--tensorboard_histograms", type=int, default=0, metavar="N",
                   help="with --tensorboard: weight and gradient histograms every N iterations (0: none)")
    p.add_argument("--batch_shares", default="equal",
                   help="data parallel under mpiexec -n N: equal (every rank the prototxt's batch, as Caffe), auto "
                        "(shares of the global batch in proportion to each rank's measured speed), or b0,b1,... "
                        "(per-rank batch sizes summing to N x batch_size); the update stays exact")
    p.add_argument("--parallel", default="data",
                   help="under mpiexec -n N, or on N in-process --devices (one worker per device, each at the "
                        "prototxt's batch, as N ranks): data (every layer by sample, Caffe's multi-GPU rule; on "
                        "--devices the scheduler's split of the batch), owt (layers below "
                        "the fully-connected tail by sample, its InnerProduct layers by output channel), auto (the "
                        "tail splits n=a c=N/a and DeePa's optimum, layer by layer, measured on the ranks: data "
                        "unless another is >10%% faster; the cost model's pick logged), or a plan file "
                        "('cct plan --out': any per-layer mix); the update stays exact "
                        "(docs/distributed.md)")
    add_common_arguments(p)
    add_device_arguments(p)
    return p


def batch_shares(flag: str) -> list[int] | str | None:
    """--batch_shares: 'equal' -> None, 'auto', or a list of per-rank batch sizes."""
    if flag in ("equal", "auto"):
        return None if flag == "equal" else flag
    try:
        return [int(x) for x in flag.split(",")]
    except ValueError:
        raise CctError(f"--batch_shares must be equal, auto or comma-separated batch sizes, not '{flag}'") from None


def run(args: argparse.Namespace) -> int:
    """``cct train``: train a model from a solver prototxt (Caffe's ``caffe train``)."""
    if args.solver and args.solver_pos and args.solver != args.solver_pos:
        raise CctError("give the solver once (either --solver=S or a positional S)")
    solver_path = args.solver or args.solver_pos
    if not solver_path:
        raise CctError("Need a solver definition to train (cct train --solver=solver.prototxt).")
    if args.snapshot and args.weights:
        raise CctError("Give a snapshot to resume training or weights to finetune but not both.")

    signals.check_effect(args.sigint_effect)
    signals.check_effect(args.sighup_effect)
    comm = mpi_world()  # under mpiexec: this rank's place in the job (rank 0 logs, tests, snapshots)
    root = comm is None or comm.is_root
    init_logging(args.quiet or not root)
    engine = engine_config(args, calibrate=True)


    param = read_solver_param(solver_path)
    param.train_state.level = args.level
    param.train_state.stage.extend(stages(args.stage))
    config = run_config(args, engine, param)
    # The solver itself must not log the GPU fallback a second time.
    param.solver_mode = caffe_pb2.SolverParameter.CPU
    if args.iterations is not None:
        if args.iterations < 0:
            raise CctError(f"--iterations must be >= 0, not {args.iterations}")
        param.max_iter = args.iterations
    if args.snapshot:
        param.ClearField("weights")
    elif args.weights:
        param.ClearField("weights")
        param.weights.append(args.weights)

    if args.tensorboard_histograms and not args.tensorboard:
        raise CctError("--tensorboard_histograms needs --tensorboard DIR")
    if args.parallel != "data" and args.groups is not None:
        raise CctError(f"--parallel {args.parallel} cannot be combined with Omnivore's --groups (both split the net "
                       "across ranks)")
    if args.groups is not None:
        if args.tensorboard:
            raise CctError("--tensorboard is not supported in Omnivore mode (--groups); use parse_log --tensorboard "
                           "on its log")

        if args.omnivore_epoch is not None and args.omnivore_epoch < 1:
            raise CctError(f"--omnivore_epoch must be >= 1 iteration, not {args.omnivore_epoch}")
        return omnivore_train(param, solver_path, config, args.groups, args.omnivore_epoch, resume=args.snapshot,
                              fail_rank=args.omnivore_fail_rank, fail_kill=args.omnivore_fail_kill)
    handler = signals.SignalHandler(args.sigint_effect, args.sighup_effect)
    devices = config.devices.devices if config.devices is not None else []
    if args.parallel != "data" and len(devices) > 1:
        if comm is not None:
            raise CctError(f"--parallel {args.parallel} with several --devices per MPI rank is not supported: give "
                           "each rank one device (mpiexec -n N*D), or leave out --devices, or use --parallel data")
        return _train_on_device_workers(args, param, solver_path, config, handler, devices)
    solver = get_solver(param, _source=solver_path, config=config, comm=comm, phase_times=args.phase_times,
                        shares=batch_shares(args.batch_shares), tensorboard=args.tensorboard,
                        tensorboard_histograms=args.tensorboard_histograms)
    solver.set_action_function(handler.get_action_function())
    if args.parallel != "data":
        setup_parallel(solver, args.parallel)
    with handler:
        if args.snapshot:
            log.info("Resuming from %s", args.snapshot)
            solver.restore(args.snapshot)
        log.info("Starting Optimization")
        with Progress(param.max_iter, "train", unit="iter", enabled=wants_progress(args) and root,
                      initial=solver.iter) as bar:
            solver.add_callback(on_start=lambda: bar.set(solver.iter))
            solver.solve()
    return 0


def _train_on_device_workers(args: argparse.Namespace, param, solver_path: str, config, handler, devices) -> int:
    """``--devices`` with ``--parallel`` other than data (no mpiexec): one solver per device, each on a worker
    thread, the workers of a ThreadComm running the plan as MPI ranks would (:mod:`cct.parallel_plan.inprocess`)."""
    check_cpu_devices(devices)
    if args.batch_shares != "equal" or getattr(args, "share", None):
        raise CctError(f"--parallel {args.parallel} on --devices: every worker reads the prototxt's batch; "
                       "--batch_shares and --share do not apply")
    log.info("--parallel %s on %d in-process devices (%s): one worker per device, each at the prototxt's batch "
             "(the global batch is %d x it, as mpiexec -n %d); arrays move by in-process copies", args.parallel,
             len(devices), ", ".join(d.name for d in devices), len(devices), len(devices))

    def worker(comm) -> None:
        devices[comm.rank].bind_thread()  # its BLAS backend and thread budget on this thread
        solver = get_solver(param, _source=solver_path, config=worker_config(config, comm.rank), comm=comm,
                            phase_times=args.phase_times, tensorboard=args.tensorboard,
                            tensorboard_histograms=args.tensorboard_histograms)
        solver.set_action_function(handler.get_action_function())
        setup_parallel(solver, args.parallel)
        if args.snapshot:
            log.info("Resuming from %s", args.snapshot)
            solver.restore(args.snapshot)
        log.info("Starting Optimization")
        with Progress(param.max_iter, "train", unit="iter", enabled=wants_progress(args) and comm.is_root,
                      initial=solver.iter) as bar:
            solver.add_callback(on_start=lambda: bar.set(solver.iter))
            solver.solve()

    with handler:
        run_device_workers(len(devices), worker)
    return 0
