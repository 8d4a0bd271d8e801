"""The ``cct`` command (also ``python -m cct``): Caffe's ``caffe`` tool plus the dataset tools.

    cct train --solver=S [--weights=W1,W2 | --snapshot=S.solverstate] [--iterations=N] [--gpu=0|all]
              [--sigint_effect=stop|snapshot|none] [--sighup_effect=...] [--level=L] [--stage=a,b]
    cct test  --model=M --weights=W [--iterations=50] [--phase=TEST]
    cct time  --model=M [--iterations=50] [--phase=TRAIN]
    cct device_query
    cct convert_imageset | compute_image_mean | convert_mnist | convert_cifar | make_digits | calibrate ...

Flags may be written as in Caffe (``-solver S``, ``-solver=S``) or GNU style (``--solver S``,
``--solver=S``); booleans as ``--flag``, ``--noflag`` or ``--flag=false`` (see :mod:`cct.flags`);
``cct train S`` also works. Each command has a ``build_<cmd>_parser()`` (or a tool module's
``build_parser()``) and a ``run`` function, listed in :data:`COMMANDS`. Logging goes to stderr in glog
format; errors exit with status 1 and a one-line message (no traceback).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .errors import CctError, LayerError
from .flags import FlagParser, command_parser
from .progress import Progress
from .runsetup import (
    add_common_arguments,
    add_device_arguments,
    engine_config,
    init_logging,
    phase,
    run_config,
    select_gpus,
    stages,
    wants_progress,
)

log = logging.getLogger("cct")


@dataclass(frozen=True)
class Command:
    """One ``cct`` command: ``module.<parser>()`` builds its :class:`FlagParser`, ``module.<run>(args)`` runs it."""

    summary: str
    module: str
    parser: str = "build_parser"
    run: str = "run"

    def load(self) -> tuple[Callable[[], FlagParser], Callable[[argparse.Namespace], int]]:
        """The parser builder and the run function (imports the module)."""
        import importlib

        try:
            mod = importlib.import_module(self.module)
        except ImportError as e:
            raise CctError(f"this command is not available: cannot import {self.module} ({e})") from None
        return getattr(mod, self.parser), getattr(mod, self.run)


def _builtin(summary: str, name: str) -> Command:
    return Command(summary, __name__, f"build_{name}_parser", f"run_{name}")


COMMANDS: dict[str, Command] = {
    "train": _builtin("train or finetune a model", "train"),
    "test": _builtin("score a model", "test"),
    "time": _builtin("benchmark model execution time", "time"),
    "device_query": _builtin("show CPU/BLAS/GPU information", "device_query"),
    "convert_imageset": Command("convert a list of images into an LMDB/LevelDB", "cct.tools.convert_imageset"),
    "compute_image_mean": Command("compute the mean image of a database", "cct.tools.compute_image_mean"),
    "convert_mnist": Command("convert the MNIST files into LMDBs", "cct.tools.convert_mnist"),
    "convert_cifar": Command("convert the CIFAR-10 binaries into LMDBs", "cct.tools.convert_cifar"),
    "make_digits": Command("generate the synthetic digit dataset (LMDBs)", "cct.tools.make_digits"),
    "calibrate": Command("calibrate the CcT lowering cost model for this machine", "cct.lowering.calibrate"),
    "extract_features": Command("save the values of blobs of a trained net as Datum records",
                                "cct.tools.extract_features"),
    "upgrade_net_proto_text": Command("upgrade a legacy net prototxt to the current format", "cct.tools.upgrade_proto",
                                      "build_net_text_parser", "run_net_text"),
    "upgrade_net_proto_binary": Command("upgrade a legacy binary net (.caffemodel)", "cct.tools.upgrade_proto",
                                        "build_net_binary_parser", "run_net_binary"),
    "upgrade_solver_proto_text": Command("upgrade a legacy solver prototxt", "cct.tools.upgrade_proto",
                                         "build_solver_text_parser", "run_solver_text"),
    "parse_log": Command("parse a training log into LOG.train / LOG.test CSV files", "cct.tools.parse_log"),
    "plot": Command("plot training curves of one or more logs (PNG; the [plot] extra)", "cct.tools.plot"),
    "draw": Command("draw a net as a graph (PNG/SVG/...; the [draw] extra)", "cct.tools.draw"),
    "export_onnx": Command("export a net and its weights to ONNX (the [onnx] extra)", "cct.onnx.cli",
                           "build_export_parser", "run_export"),
    "import_onnx": Command("convert an ONNX model into a prototxt and caffemodel (the [onnx] extra)", "cct.onnx.cli",
                           "build_import_parser", "run_import"),
    "plan": Command("choose each layer's parallelism over workers (DeePa) and write the plan",
                    "cct.parallel_plan.command"),
    "infer": Command("dense sliding-window inference of a 2-D/3-D net over a large image", "cct.infer.cli"),
}


def usage() -> str:
    """The top-level help: every command with its one-line summary, aligned."""
    width = max(len(n) for n in COMMANDS) + 2
    lines = ["usage: cct <command> [flags] [args]", "", "commands:"]
    lines += [f"  {name:<{width}}{c.summary}" for name, c in COMMANDS.items()]
    lines += ["", "Flags are written as in Caffe's tools: -flag value, --flag=value, boolean --flag / --noflag.",
              "Run 'cct <command> --help' for the flags of a command.", ""]
    return "\n".join(lines)


def build_train_parser() -> FlagParser:
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
                   help="under mpiexec -n N: data (every layer by sample, Caffe's multi-GPU rule), owt (layers below "
                        "the fully-connected tail by sample, its InnerProduct layers by output channel), auto (the "
                        "executed plans -- the tail split n=a c=N/a -- measured on the ranks: data unless another "
                        "is >10%% faster; the cost model's pick logged), or a plan file "
                        "('cct plan --out') of that form; the update stays exact (docs/distributed.md)")
    add_common_arguments(p)
    add_device_arguments(p)
    return p


def _batch_shares(flag: str):
    """--batch_shares: 'equal' -> None, 'auto', or a list of per-rank batch sizes."""
    if flag in ("equal", "auto"):
        return None if flag == "equal" else flag
    try:
        return [int(x) for x in flag.split(",")]
    except ValueError:
        raise CctError(f"--batch_shares must be equal, auto or comma-separated batch sizes, not '{flag}'") from None


def run_train(args: argparse.Namespace) -> int:
    """``cct train``: train a model from a solver prototxt (Caffe's ``caffe train``)."""
    if args.solver and args.solver_pos and args.solver != args.solver_pos:
        raise CctError("give the solver once (either --solver=S or a positional S)")
    solver_path = args.solver or args.solver_pos
    if not solver_path:
        raise CctError("Need a solver definition to train (cct train --solver=solver.prototxt).")
    if args.snapshot and args.weights:
        raise CctError("Give a snapshot to resume training or weights to finetune but not both.")
    from .solver import signals

    signals.check_effect(args.sigint_effect)
    signals.check_effect(args.sighup_effect)
    comm = _mpi_world()  # under mpiexec: this rank's place in the job (rank 0 logs, tests, snapshots)
    root = comm is None or comm.is_root
    init_logging(args.quiet or not root)
    engine = engine_config(args, calibrate=True)

    from .proto import caffe_pb2
    from .solver import get_solver, read_solver_param

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
        from .omnivore.train import omnivore_train

        if args.tensorboard:
            raise CctError("--tensorboard is not supported in Omnivore mode (--groups); use parse_log --tensorboard "
                           "on its log")

        if args.omnivore_epoch is not None and args.omnivore_epoch < 1:
            raise CctError(f"--omnivore_epoch must be >= 1 iteration, not {args.omnivore_epoch}")
        return omnivore_train(param, solver_path, config, args.groups, args.omnivore_epoch, resume=args.snapshot,
                              fail_rank=args.omnivore_fail_rank, fail_kill=args.omnivore_fail_kill)
    handler = signals.SignalHandler(args.sigint_effect, args.sighup_effect)
    solver = get_solver(param, _source=solver_path, config=config, comm=comm, phase_times=args.phase_times,
                        shares=_batch_shares(args.batch_shares), tensorboard=args.tensorboard,
                        tensorboard_histograms=args.tensorboard_histograms)
    solver.set_action_function(handler.get_action_function())
    if args.parallel != "data":
        from .parallel_plan.execute import setup_parallel

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


# -- test --------------------------------------------------------------------------------------
def _load_weights(net, weights: str) -> None:
    for w in (x.strip() for x in weights.split(",")):
        if w:
            net.copy_from(w)


def build_test_parser() -> FlagParser:
    """The flags of ``cct test``."""
    p = command_parser("test", "Score a model: run N batches and print per-batch and mean outputs.")
    p.add_argument("--model", default=None, help="the model definition prototxt")
    p.add_argument("--weights", default=None, help="the trained weights (.caffemodel or .h5; comma-separated)")
    p.add_argument("--iterations", type=int, default=50, help="the number of batches to run")
    p.add_argument("--phase", default="TEST", help="net phase (TEST or TRAIN)")
    add_common_arguments(p)
    add_device_arguments(p)
    return p


def run_test(args: argparse.Namespace) -> int:
    """``cct test``: run a model's TEST phase for N batches and report each output's mean."""
    import numpy as np

    from .net import Net

    if not args.model:
        raise CctError("Need a model definition to score (--model).")
    if not args.weights:
        raise CctError("Need model weights to score (--weights).")
    if args.iterations < 1:
        raise CctError(f"--iterations must be >= 1, not {args.iterations}")
    init_logging(args.quiet)
    config = run_config(args, engine_config(args, calibrate=False))
    net = Net(args.model, phase(args.phase), level=args.level, stages=stages(args.stage), config=config)
    _load_weights(net, args.weights)
    log.info("Running for %d iterations.", args.iterations)
    scores: list[np.float32] = []
    names: list[str] = []
    loss = np.float32(0)
    with Progress(args.iterations, "test", unit="batch", enabled=wants_progress(args)) as bar:
        for i in range(args.iterations):
            try:
                loss += np.float32(net.forward())
            except LayerError as e:
                raise e.in_context(f"batch {i}") from e
            for idx, (name, v) in enumerate(net.output_values()):
                if i == 0:
                    scores.append(v)
                    names.append(name)
                else:
                    scores[idx] += v
                log.info("Batch %d, %s = %g", i, name, v)
            bar.update()
    loss /= np.float32(args.iterations)
    log.info("Loss: %g", loss)
    for name, s in zip(names, scores):
        mean = np.float32(s) / np.float32(args.iterations)
        w = net.blob_loss_weights.get(name, 0.0)
        extra = f" (* {w:g} = {np.float32(w) * mean:g} loss)" if w else ""
        log.info("%s = %g%s", name, mean, extra)
    return 0


# -- time --------------------------------------------------------------------------------------
def build_time_parser() -> FlagParser:
    """The flags of ``cct time``."""
    p = command_parser("time", "Benchmark the execution time of a model, layer by layer.")
    p.add_argument("--model", default=None, help="the model definition prototxt")
    p.add_argument("--iterations", type=int, default=50, help="the number of forward-backward passes to time")
    p.add_argument("--phase", default="TRAIN", help="net phase (TRAIN or TEST)")
    p.add_argument("--weights", default=None, help="optional weights to load first")
    add_common_arguments(p)
    add_device_arguments(p)
    return p


def run_time(args: argparse.Namespace) -> int:
    """``cct time``: per-layer forward/backward timings (Caffe's ``caffe time``)."""
    from .net import Net

    if not args.model:
        raise CctError("Need a model definition to time (--model).")
    if args.iterations < 1:
        raise CctError(f"--iterations must be >= 1, not {args.iterations}")
    init_logging(args.quiet)
    config = run_config(args, engine_config(args, calibrate=True))
    net = Net(args.model, phase(args.phase), level=args.level, stages=stages(args.stage), config=config)
    if args.weights:
        _load_weights(net, args.weights)
    log.info("Performing Forward")
    initial_loss = net.forward()
    log.info("Initial loss: %g", initial_loss)
    log.info("Performing Backward")
    net.backward()
    n_layers = len(net.layers)
    fwd = [0.0] * n_layers
    bwd = [0.0] * n_layers
    fwd_samples: list[list[float]] = [[] for _ in range(n_layers)]
    forward_time = backward_time = 0.0
    log.info("*** Benchmark begins ***")
    log.info("Testing for %d iterations.", args.iterations)
    clock = time.perf_counter
    total_start = clock()
    with Progress(args.iterations, "time", unit="iter", enabled=wants_progress(args)) as bar:
        for j in range(args.iterations):
            iter_start = clock()
            for i, layer in enumerate(net.layers):
                t = clock()
                layer.reshape(net.bottom_vecs[i], net.top_vecs[i])
                layer.forward(net.bottom_vecs[i], net.top_vecs[i])
                dt = clock() - t
                fwd[i] += dt
                fwd_samples[i].append(dt)
            f_end = clock()
            forward_time += f_end - iter_start
            for i in range(n_layers - 1, -1, -1):
                if not net.layer_need_backward[i]:
                    continue
                t = clock()
                net.layers[i].backward(net.top_vecs[i], net.bottom_need_backward[i], net.bottom_vecs[i])
                bwd[i] += clock() - t
            backward_time += clock() - f_end
            log.info("Iteration: %d forward-backward time: %g ms.", j + 1, (clock() - iter_start) * 1e3)
            bar.update()
    total = clock() - total_start
    n = args.iterations
    log.info("Average time per layer: ")
    for i, name in enumerate(net.layer_names):
        log.info("%10s\tforward: %g ms.", name, fwd[i] * 1e3 / n)
        log.info("%10s\tbackward: %g ms.", name, bwd[i] * 1e3 / n)
    log.info("Average Forward pass: %g ms.", forward_time * 1e3 / n)
    log.info("Average Backward pass: %g ms.", backward_time * 1e3 / n)
    log.info("Average Forward-Backward: %g ms.", total * 1e3 / n)
    log.info("Total Time: %g ms.", total * 1e3)
    for i, layer in enumerate(net.layers):  # the engine's plan per conv layer, next to its measured time
        report = getattr(layer, "plan_report", None)
        if report:
            log.info("Plan %s; measured %g ms", report, (fwd[i] + bwd[i]) * 1e3 / n)
    log.info("*** Benchmark ends ***")
    from .net.overhead import gemm_overhead, log_gemm_overhead

    log_gemm_overhead(gemm_overhead(net, fwd_samples, repeats=max(20, n)))
    return 0


# -- device_query ------------------------------------------------------------------------------
def build_device_query_parser() -> FlagParser:
    """The flags of ``cct device_query``."""
    p = command_parser("device_query", "Show the CPU, the BLAS backend and any GPUs.")
    p.add_argument("--gpu", default=None, help="only query these GPU ids ('all' or a comma list)")
    return p


def run_device_query(args: argparse.Namespace) -> int:
    """``cct device_query``: CPU, BLAS backend and (when CuPy sees any) GPU information; under
    mpiexec every rank's, printed by rank 0 in rank order."""
    comm = _mpi_world()
    if comm is None:
        return _device_query_report(args, sys.stdout)
    import io
    import platform

    buf = io.StringIO()
    try:
        rc = _device_query_report(args, buf)
    except CctError as e:
        buf.write(f"error: {e}\n")
        rc = 1
    reports = comm.gather_obj((platform.node(), buf.getvalue(), rc))
    if comm.is_root:
        for r, (host, text, _) in enumerate(reports):
            sys.stdout.write(f"=== MPI rank {r} of {comm.size} (host {host}) ===\n{text}")
        sys.stdout.flush()
    return max(x[2] for x in reports) if comm.is_root else rc


def _device_query_report(args: argparse.Namespace, out) -> int:
    import platform

    import numpy as np

    from . import blas

    try:
        cpu = blas._cpu_model()
    except Exception:  # pragma: no cover - informational only
        cpu = platform.processor() or "unknown"
    print(f"CPU: {cpu}", file=out)
    print(f"CPU cores: {os.cpu_count()}", file=out)
    print(f"Platform: {platform.platform()}", file=out)
    print(f"Python: {platform.python_version()}; numpy {np.__version__}", file=out)
    try:
        backend = blas.get_backend()
    except CctError as e:
        backend = f"unavailable ({e})"
    print(f"BLAS backend: {backend}", file=out)
    try:
        print(f"BLAS threads: {blas.get_num_threads()}", file=out)
    except Exception:  # pragma: no cover - informational only
        pass
    from .scheduler import device_query, format_device_query

    print("Devices (measured SGEMM rate, cached):", file=out)
    print(format_device_query(device_query()), file=out)
    from .backend import cupy_available

    if not cupy_available():
        if args.gpu:
            raise CctError(f"--gpu={args.gpu} given but no GPU is available (CuPy not installed or no CUDA device)")
        print("GPUs: none (CuPy not installed or no CUDA device visible)", file=out)
        return 0
    import cupy  # type: ignore

    count = cupy.cuda.runtime.getDeviceCount()
    ids = select_gpus(args.gpu) if args.gpu else list(range(count))
    print(f"GPUs: {count} (CuPy {cupy.__version__})", file=out)
    for i in ids:
        props = cupy.cuda.runtime.getDeviceProperties(i)
        name = props.get("name", b"?")
        name = name.decode() if isinstance(name, bytes) else str(name)
        print(f"Device id: {i}", file=out)
        print(f"  Name: {name}", file=out)
        print(f"  Compute capability: {props.get('major')}.{props.get('minor')}", file=out)
        print(f"  Total global memory: {props.get('totalGlobalMem')}", file=out)
        print(f"  Multiprocessors: {props.get('multiProcessorCount')}", file=out)
    return 0


# -- dispatch ----------------------------------------------------------------------------------
def build_parser(command: str) -> FlagParser:
    """The parser of ``cct <command>`` (raises CctError for an unknown or unavailable command)."""
    if command not in COMMANDS:
        raise CctError(f"unknown command '{command}'")
    return COMMANDS[command].load()[0]()


def _mpi_world():
    """The job's communicator when started by mpiexec with more than one rank, else None (mpi4py is
    then not imported)."""
    from .distributed.launch import under_mpi

    if not under_mpi():
        return None
    from .distributed import world

    comm = world()
    return comm if comm.size > 1 else None


def _abort_job(cmd: str, comm, message: str, code: int) -> int:
    """A rank of an MPI job failed: end every rank now (no rank may wait in a collective), naming it."""
    comm.abort(f"cct {cmd}: MPI rank {comm.rank} of {comm.size} failed, ending the job: {message}", code)
    return code  # pragma: no cover - abort does not return


def run(command: str, argv: Sequence[str]) -> int:
    """Parse ``argv`` with the command's parser and run it; returns the exit status (errors raise)."""
    build, body = COMMANDS[command].load()
    args = build().parse_args(list(argv))
    if not hasattr(args, "quiet"):
        init_logging(False)
    return int(body(args) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``cct`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "-help", "help"):
        sys.stdout.write(usage()) if argv else sys.stderr.write(usage())
        return 0 if argv else 1
    if argv[0] in ("--version", "-version", "version"):
        from . import __version__

        print(f"cct {__version__}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        sys.stderr.write(f"cct: unknown command '{cmd}'\n\n{usage()}")
        return 1
    comm = _mpi_world() if cmd in ("train", "device_query", "infer") else None
    try:
        return run(cmd, rest)
    except CctError as e:
        if comm is not None:
            return _abort_job(cmd, comm, f"error: {e}", 1)
        sys.stderr.write(f"cct {cmd}: error: {e}\n")
        return 1
    except OSError as e:
        where = f" '{e.filename}'" if getattr(e, "filename", None) else ""
        if comm is not None:
            return _abort_job(cmd, comm, f"error:{where} {e.strerror or e}", 1)
        sys.stderr.write(f"cct {cmd}: error:{where} {e.strerror or e}\n")
        return 1
    except KeyboardInterrupt:
        if comm is not None:
            return _abort_job(cmd, comm, "interrupted", 130)
        sys.stderr.write(f"cct {cmd}: interrupted\n")
        return 130
    except BaseException as e:
        if comm is None or isinstance(e, SystemExit) and not e.code:
            raise
        import traceback

        traceback.print_exc()
        return _abort_job(cmd, comm, f"{type(e).__name__}: {e}", 1)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
