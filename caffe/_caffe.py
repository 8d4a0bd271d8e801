"""pycaffe's module-level functions (modes, seeds, logging, Timer), adapting cct."""
from __future__ import annotations

import logging
import time

import cct
from cct.device.driver import cupy_available
from cct.errors import CctError

__version__ = "1.0.0"  # the Caffe API version this shim implements (cct's own is cct.__version__)

_state = {"mode": "cpu", "device": 0}


def set_mode_cpu() -> None:
    """Run on the CPU."""
    _state["mode"] = "cpu"


def set_mode_gpu() -> None:
    """Run on the GPU (needs CuPy and a GPU: ``pip install cct[gpu]``)."""
    if not cupy_available():
        raise CctError("caffe.set_mode_gpu(): no GPU available (CuPy missing or no CUDA device); "
                       "install cct[gpu] on a machine with a GPU, or use caffe.set_mode_cpu()")
    _state["mode"] = "gpu"
    logging.getLogger("cct").warning("caffe.set_mode_gpu(): GPU %d requested: cct runs nets on the CPU for now; "
                                     "using CPU (as `cct train --gpu`).", _state["device"])


def set_device(device_id: int) -> None:
    """Select the GPU used by set_mode_gpu()."""
    _state["device"] = int(device_id)


def mode() -> str:
    return _state["mode"]


def set_random_seed(seed: int) -> None:
    """Seed cct's random generator (fillers, dropout, shuffling)."""
    cct.set_random_seed(seed)


def layer_type_list() -> list[str]:
    return cct.layer_type_list()


def init_log(level: int = 0, stderr: bool = True) -> None:
    """Log in glog format; ``level`` as glog's minloglevel (0 INFO, 1 WARNING, 2 ERROR)."""
    levels = {0: logging.INFO, 1: logging.WARNING, 2: logging.ERROR, 3: logging.CRITICAL}
    cct.init_log(levels.get(int(level), logging.INFO))


def log(message: str) -> None:
    """Write one INFO line to cct's log."""
    logging.getLogger("cct").info(message)


def solver_count() -> int:
    return 1


def set_solver_count(count: int) -> None:
    if count != 1:
        raise CctError("cct runs one solver per process; split batches across devices with cct.set_devices")


def solver_rank() -> int:
    return 0


def set_solver_rank(rank: int) -> None:
    if rank != 0:
        raise CctError("cct runs one solver per process (rank 0)")


def set_multiprocess(multiprocess: bool) -> None:
    if multiprocess:
        raise CctError("cct does not run Caffe's multi-process NCCL mode; use cct's device scheduler")


def has_nccl() -> bool:
    return False


class Timer:
    """pycaffe's Timer: start(), stop(), ms."""

    def __init__(self):
        self._start = None
        self._elapsed = 0.0

    def start(self) -> None:
        self._start = time.perf_counter()

    def stop(self) -> None:
        if self._start is not None:
            self._elapsed = time.perf_counter() - self._start
            self._start = None

    @property
    def ms(self) -> float:
        if self._start is not None:
            return (time.perf_counter() - self._start) * 1e3
        return self._elapsed * 1e3
