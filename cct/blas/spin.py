"""OpenBLAS spin control: idle OpenBLAS workers must not keep the cores busy after each GEMM."""
from __future__ import annotations

import os
import threading
from collections.abc import MutableMapping

from .. import env
from .openblas import numpy_openblas_cdll

DEFAULT_THREAD_TIMEOUT = 16  # 2**16 cycles (~20 us) of spinning before an idle OpenBLAS worker sleeps
#: name prefixes of cct's threads that never run a GEMM (data prefetch, image decoding, the compiled
#: kernels' team and the calibration's twin-call pool)
BLAS_FREE_THREADS = ("cct-data-", "cct-decode", "cct-prefetch", "cct-kernels", "cct-twins")
_lock = threading.Lock()
_spin_done = False


def limit_openblas_spin(exponent: int | None = None) -> bool:
    """Make numpy's OpenBLAS workers sleep after ``2**exponent`` idle cycles (once per process).

    OpenBLAS (pthreads build) keeps its worker threads spinning for ``2**28`` cycles (~0.1 s)
    after every multi-threaded GEMM unless ``OPENBLAS_THREAD_TIMEOUT`` was set before it loaded.
    On a machine with few cores that spinning steals the cores from everything that runs next
    (compiled kernels, concurrent batch partitions, other processes): measured on a 2-core box, cct's
    cifar10_quick iteration ran ~1.3-1.5x faster with a short timeout. The timeout is only read when
    the thread pool starts, so this sets the variable, re-reads OpenBLAS's environment and restarts
    its (idle) pool. Call it when no GEMM is running (cct does at conv-layer setup).

    ``exponent``: default ``$CCT_BLAS_THREAD_TIMEOUT`` or 16; ``0``/``off`` in that variable keeps
    OpenBLAS as it is, and so does a user-set ``OPENBLAS_THREAD_TIMEOUT``. Returns True if applied.
    """
    global _spin_done
    with _lock:
        if _spin_done:
            return False
        # Restarting the pool is only safe while no other thread can be inside a GEMM: require the
        # main thread and no live cct worker threads (devices, partitions); else try again later.
        # Data prefetch and decode threads never call BLAS: they may run (a data layer is set up
        # before the first conv layer, so its thread is always alive by then).
        if threading.current_thread() is not threading.main_thread() or any(
                t.name.startswith("cct-") and not t.name.startswith(BLAS_FREE_THREADS) and t.is_alive()
                for t in threading.enumerate()):
            return False
        _spin_done = True
        setting = env.text("CCT_BLAS_THREAD_TIMEOUT").lower()
        if setting in ("0", "off", "no", "false") or "OPENBLAS_THREAD_TIMEOUT" in os.environ:
            return False
        if exponent is None:
            exponent = int(setting) if setting.isdigit() else DEFAULT_THREAD_TIMEOUT
        lib = numpy_openblas_cdll()
        if lib is None:
            return False
        try:
            read_env = lib.openblas_read_env
            shutdown = lib.blas_thread_shutdown_
            init = lib.blas_thread_init
        except (OSError, AttributeError, TypeError):
            return False
        os.environ["OPENBLAS_THREAD_TIMEOUT"] = str(max(4, min(30, int(exponent))))
        try:
            read_env()
            shutdown()
            init()
        finally:
            os.environ.pop("OPENBLAS_THREAD_TIMEOUT", None)
            read_env()  # forget it again; the restarted pool keeps the timeout it read
        return True


DEFAULT_OMP_SPINCOUNT = 1000  # spins before an idle libgomp worker sleeps (libgomp's own default: 300000)
_OFF = ("off", "no", "false", "default")


def set_openmp_spin_defaults(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Short idle spinning for the OpenMP runtimes under MKL (and any library that loads libgomp);
    returns what was set.

    MKL's GNU threading runs on libgomp, whose idle workers spin
    for ``GOMP_SPINCOUNT`` (300000 by default, ~0.1-1 ms) after every parallel region; Intel's
    OpenMP (MKL's ``intel_thread``) spins for ``KMP_BLOCKTIME`` (200 ms). A training iteration of a
    small net runs dozens of short regions from the main thread, the batch-partition threads and
    OpenBLAS's own pool, and the data prefetch thread runs beside them: on a machine with few cores
    the spinners take the cores the next region or the prefetch thread needs. Both runtimes read
    these variables once, when they are loaded, so cct sets them at import (before it loads MKL):
    ``GOMP_SPINCOUNT = $CCT_OMP_SPINCOUNT`` (default 1000) and ``KMP_BLOCKTIME = 0``.

    Nothing is changed where the user set ``GOMP_SPINCOUNT``, ``OMP_WAIT_POLICY`` or
    ``KMP_BLOCKTIME`` already, or with ``CCT_OMP_SPINCOUNT=off``. A runtime that another library
    loaded before cct (e.g. PyTorch's own libgomp) keeps what it read.
    """
    environ = os.environ if environ is None else environ
    done: dict[str, str] = {}
    req = environ.get("CCT_OMP_SPINCOUNT", "").strip().lower()
    if req in _OFF:
        return done
    if "GOMP_SPINCOUNT" not in environ and "OMP_WAIT_POLICY" not in environ:
        count = int(req) if req.isdigit() else DEFAULT_OMP_SPINCOUNT
        environ["GOMP_SPINCOUNT"] = done["GOMP_SPINCOUNT"] = str(count)
    if "KMP_BLOCKTIME" not in environ:
        environ["KMP_BLOCKTIME"] = done["KMP_BLOCKTIME"] = "0"
    return done
