"""Per-layer plans on in-process devices: one solver per device, each on a worker thread of this process, the
workers a :class:`~cct.distributed.threadcomm.ThreadComm` group (the "in-process copy" link of :mod:`.links`).

``cct train --devices cpu,cpu:1 --parallel auto|owt|FILE`` (no ``mpiexec``) runs the job exactly as ``mpiexec
-n N`` would, with worker r in the place of rank r: each worker builds its own solver and nets (the prototxt's
batch per worker: N workers at batch b train as one process at batch N*b), the per-layer executor
(:mod:`.perlayer`) and data parallelism exchange arrays by in-process copies, worker 0 alone logs, tests and
snapshots. What one process holds once and several solvers would share is given to each worker apart: its
own :class:`~cct.config.Config` without the scheduler's devices (a worker runs its device's part itself, on
the host), a random source of its own for workers > 0 (data parallelism gives them streams of their own, as
ranks > 0), and the log of workers > 0 is kept to warnings and errors. The BLAS thread count (process-wide
under OpenBLAS) is the devices' budget, which :mod:`cct.scheduler` already set when the devices were made.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ..config import Config
from ..distributed.threadcomm import ThreadComm, run_workers
from ..random_source import RandomSource
from .split import PlanError

log = logging.getLogger("cct")

#: the thread names of the workers (worker 0's log passes, the others' only from WARNING on)
WORKER_PREFIX = "cct-device-worker-"
#: seconds a training worker waits for the others in one operation: long, as the others wait for worker 0's
#: TEST passes and snapshots (a failed worker ends the others at once; the deadline catches one that hangs)
TRAIN_WAIT_S = 4 * 3600.0


class _RootWorkerOnly(logging.Filter):
    """Drop the INFO and DEBUG records of workers > 0 (rank 0 logs, as under MPI)."""

    def filter(self, record: logging.LogRecord) -> bool:
        name = threading.current_thread().name
        return record.levelno >= logging.WARNING or not name.startswith(WORKER_PREFIX) or \
            name == f"{WORKER_PREFIX}0"


@contextmanager
def root_worker_log(logger: logging.Logger = log) -> Iterator[None]:
    """Inside the block, ``logger`` passes the INFO records of worker 0 and of other threads only."""
    keep = _RootWorkerOnly()
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def worker_config(config: Config, rank: int) -> Config:
    """Worker ``rank``'s configuration: ``config`` without the scheduler's devices (the worker runs its part
    itself); workers > 0 draw from a random source of their own."""
    if rank == 0:
        return config.replace(devices=None)
    return config.replace(devices=None, random=RandomSource())


def check_cpu_devices(devices: Sequence[Any]) -> None:
    """Refuse devices a worker cannot run on yet (GPUs: a worker computes on the host)."""
    gpus = [d.name for d in devices if d.memory.is_gpu]
    if gpus:
        raise PlanError(f"--devices with --parallel other than data runs on CPU devices only for now; "
                        f"{', '.join(gpus)} {'is a GPU' if len(gpus) == 1 else 'are GPUs'} (use --parallel data, "
                        "the scheduler's split, or mpiexec with one GPU per rank)")


def run_device_workers(n: int, body: Callable[[ThreadComm], Any], timeout_s: float = TRAIN_WAIT_S) -> list[Any]:
    """``body(comm)`` on ``n`` worker threads of one :class:`ThreadComm` group, worker 0's log alone passing
    INFO; returns the results by worker. A worker's error ends the others and is raised here."""
    if n < 2:
        raise PlanError(f"in-process workers: {n} device(s); a per-layer plan needs at least 2")
    with root_worker_log():
        return run_workers(n, body, timeout_s=timeout_s, names=[f"{WORKER_PREFIX}{r}" for r in range(n)])
