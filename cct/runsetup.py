"""What the commands and tools share to set up a run from their flags: the common flags, the engine settings,
the devices and the run's :class:`cct.config.Config`, logging, net state stages and phase."""
from __future__ import annotations

import argparse
import logging

from . import env
from .config import EngineConfig, GpuConfig, python_layers_from_env, update_default
from .device.driver import gpu_count
from .errors import CctError
from .flags import add_progress_flag
from .log import init_log
from .lowering.base import check_names
from .proto import caffe_pb2
from .scheduler import add_device_arguments as _add_scheduler_arguments
from .scheduler import devices_from_args, set_devices

log = logging.getLogger("cct")


def add_device_arguments(p: argparse.ArgumentParser) -> None:
    """The scheduler's device flags (``--devices``, ``--share``)."""
    _add_scheduler_arguments(p)


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    """The flags ``train``, ``test``, ``time`` and the tools that build nets share."""
    p.add_argument("--gpu", default=None,
                   help="GPU device id(s) ('0', '0,1' or 'all'); an error when no GPU is available")
    p.add_argument("--nograph", action="store_true",
                   help="on a GPU, run each training iteration eagerly instead of replaying it as CUDA graphs")
    p.add_argument("--tf32", action="store_true",
                   help="on a GPU, float32 convolutions and inner products on TF32 tensor cores (default: FP32)")
    p.add_argument("--level", type=int, default=0, help="net state level (NetState.level)")
    p.add_argument("--stage", default="", help="comma-separated net state stages")
    p.add_argument("--quiet", "-q", action="store_true", help="log warnings and errors only (and no progress bar)")
    add_progress_flag(p)
    p.add_argument("--no_python_layers", action="store_true",
                   help="refuse type: \"Python\" layers (they run code named by the prototxt); "
                        "also CCT_PYTHON_LAYERS=0")
    p.add_argument("--lowering", default=None,
                   help="override the conv lowering choice: 'type1'|'type2'|'type3' for all layers, or per "
                        "layer 'conv1=type3,conv2=type1'")
    p.add_argument("--lowering_mode", default="cct", choices=["cct", "caffe"],
                   help="cct: cost-model choice + whole-batch lowering; caffe: type 1, one image per GEMM")
    p.add_argument("--partitions", default="model",
                   help="batch partitions run in parallel per conv layer: 'model' (the cost model's choice "
                        "per layer), 'auto' (measured on each conv layer when the net is set up) or an int")


def wants_progress(args: argparse.Namespace) -> bool:
    """Whether the command should draw a progress bar (``--progress`` and not ``--quiet``)."""
    return bool(getattr(args, "progress", True)) and not getattr(args, "quiet", False)


def engine_config(args, calibrate: bool):
    """The engine settings of the lowering flags; calibrate the machine once (cached) unless CCT_CALIBRATE=0,
    and settle the cost model's close calls by measuring them (cached) unless CCT_TUNE=0."""
    parts = args.partitions if args.partitions in ("auto", "model") else positive_int(args.partitions,
                                                                                        "--partitions")
    overrides = None
    if args.lowering:
        overrides = args.lowering if "=" in args.lowering else {"*": args.lowering}
    try:
        calibrate = calibrate and not env.is_off("CCT_CALIBRATE")
        cfg = EngineConfig(mode=args.lowering_mode, partitions=parts, overrides=overrides or {},
                           calibrate=calibrate, tune=calibrate and not env.is_off("CCT_TUNE"))
        check_names(cfg.overrides.values())
        return cfg
    except (KeyError, ValueError) as e:
        raise CctError(f"--lowering/--partitions: {e}") from None


def positive_int(s: str, flag: str) -> int:
    """``s`` as an integer >= 1 (a clean error naming ``flag`` otherwise)."""
    try:
        v = int(s)
    except ValueError:
        v = 0
    if v < 1:
        raise CctError(f"{flag} must be a positive integer, 'model' or 'auto', not '{s}'")
    return v


def stages(s: str) -> list[str]:
    """``--stage a,b`` as a list of stage names."""
    return [x for x in (t.strip() for t in s.split(",")) if x]


def phase(s: str) -> int:
    """``TRAIN``/``TEST`` (any case) as the NetState phase."""
    u = s.upper()
    if u not in ("TRAIN", "TEST"):
        raise CctError(f"phase must be TRAIN or TEST, not '{s}'")
    return caffe_pb2.TRAIN if u == "TRAIN" else caffe_pb2.TEST


def select_gpus(flag: str | None) -> list[int]:
    """Caffe's get_gpus: '' -> CPU; 'all' or a comma list -> those devices (which must exist)."""
    if flag is None or flag == "":
        return []


    count = gpu_count()
    if not count:
        raise CctError(f"--gpu={flag} given but no GPU is available (CuPy is not installed or sees no CUDA device); "
                       "leave out --gpu to run on the CPU")
    if flag == "all":
        return list(range(count))
    try:
        ids = [int(x) for x in flag.split(",") if x.strip()]
    except ValueError:
        raise CctError(f"--gpu must be 'all' or comma-separated device ids, not '{flag}'") from None
    for i in ids:
        if not 0 <= i < count:
            raise CctError(f"--gpu: there is no GPU {i} (this machine has {count})")
    return ids


def run_config(args, engine, solver_param=None):
    """This run's :class:`cct.config.Config`: the engine settings and the devices (--devices/--share, --gpu,
    or the solver's solver_mode). It becomes the process default too (so a later run in the same process
    closes these devices) and is handed to the solver or net."""
    cfg = devices_from_args(args, solver_param)
    if cfg is None:
        log.info("Use CPU.")
    set_devices(cfg)
    python_layers = python_layers_from_env() and not getattr(args, "no_python_layers", False)
    gpu = GpuConfig(graphs=not getattr(args, "nograph", False), tf32=bool(getattr(args, "tf32", False)))
    return update_default(engine=engine, python_layers=python_layers, gpu=gpu)


def init_logging(quiet: bool, stream=None) -> None:
    """glog-format logging to stderr (warnings and errors only with ``quiet``)."""
    init_log(logging.WARNING if quiet else logging.INFO, stream=stream)


# -- train -------------------------------------------------------------------------------------


def load_weights(net, weights: str) -> None:
    """Copy the trained weights named by a ``--weights`` flag (comma-separated .caffemodel/.h5 files, in
    order) into ``net``."""
    for w in (x.strip() for x in weights.split(",")):
        if w:
            net.copy_from(w)
