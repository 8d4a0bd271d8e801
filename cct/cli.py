"""The ``cct`` command (also ``python -m cct``): Caffe's ``caffe`` tool plus the dataset tools.

    cct train --solver=S [--weights=W1,W2 | --snapshot=S.solverstate] [--iterations=N] [--gpu=0|all]
              [--sigint_effect=stop|snapshot|none] [--sighup_effect=...] [--level=L] [--stage=a,b]
    cct test  --model=M --weights=W [--iterations=50] [--phase=TEST]
    cct time  --model=M [--iterations=50] [--phase=TRAIN]
    cct device_query
    cct convert_imageset | compute_image_mean | convert_mnist | convert_cifar | make_digits | calibrate ...

Flags may be written as in Caffe (``-solver S``, ``-solver=S``) or GNU style (``--solver S``,
``--solver=S``); booleans as ``--flag``, ``--noflag`` or ``--flag=false`` (see :mod:`cct.flags`);
``cct train S`` also works. Each command is a module (cct's own in :mod:`cct.commands`, the tools' in
:mod:`cct.tools` and the feature packages) with a ``build_parser()`` and a ``run`` function, listed in
:data:`COMMANDS`; this module only registers and dispatches them. Logging goes to stderr in glog
format; errors exit with status 1 and a one-line message (no traceback).
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from . import __version__
from .commands.mpi import mpi_world
from .errors import CctError
from .flags import FlagParser
from .runsetup import init_logging

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
        try:
            mod = importlib.import_module(self.module)
        except ImportError as e:
            raise CctError(f"this command is not available: cannot import {self.module} ({e})") from None
        return getattr(mod, self.parser), getattr(mod, self.run)


COMMANDS: dict[str, Command] = {
    "train": Command("train or finetune a model", "cct.commands.train"),
    "test": Command("score a model", "cct.commands.score"),
    "time": Command("benchmark model execution time", "cct.commands.timing"),
    "device_query": Command("show CPU/BLAS/GPU information", "cct.commands.device_query"),
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


# -- dispatch ----------------------------------------------------------------------------------
def build_parser(command: str) -> FlagParser:
    """The parser of ``cct <command>`` (raises CctError for an unknown or unavailable command)."""
    if command not in COMMANDS:
        raise CctError(f"unknown command '{command}'")
    return COMMANDS[command].load()[0]()


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
        print(f"cct {__version__}")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        sys.stderr.write(f"cct: unknown command '{cmd}'\n\n{usage()}")
        return 1
    comm = mpi_world() if cmd in ("train", "device_query", "infer") else None
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

        traceback.print_exc()
        return _abort_job(cmd, comm, f"{type(e).__name__}: {e}", 1)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
