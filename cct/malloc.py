"""glibc malloc settings for training: keep freed work arrays in the heap instead of unmapping them.

glibc serves allocations above ``M_MMAP_THRESHOLD`` (128 KiB at start; raised dynamically to the
size of the largest mmapped block freed so far, up to 32 MiB) with a fresh ``mmap``, and
returns them to the kernel on ``free``. The lowerings' per-call temporaries (GEMM results,
lowered matrices of a few MiB) then page-fault on every touch of every call: measured on a
2-core Zen 5, cifar10_quick trained at 83 ms an iteration in a fresh process against 47 ms once
some earlier 16 MiB array had been freed (which raises the threshold as a side effect). This
makes that state explicit, once per process, before the first net runs: mmap threshold 32 MiB (the
maximum glibc keeps dynamic) and a trim threshold of 256 MiB, so freed blocks are reused.

``CCT_MALLOC_TUNE=0`` leaves malloc alone; a ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_``
set in the environment wins too. Not glibc (musl, macOS, Windows): nothing happens.
"""
from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading

from . import env

log = logging.getLogger("cct")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 256 << 20

_done = False
_lock = threading.Lock()


def tune_malloc() -> bool:
    """Apply the settings above (once per process); True if they were applied now."""
    global _done
    with _lock:
        if _done:
            return False
        _done = True
        if env.is_off("CCT_MALLOC_TUNE"):
            return False
        if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
            return False
        if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
            return False
        try:
            libc = ctypes.CDLL(None)
            mallopt = libc.mallopt
        except (OSError, AttributeError):
            return False
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
        log.debug("cct.malloc: mmap threshold %d MiB, trim threshold %d MiB (%s)", MMAP_THRESHOLD >> 20,
                  TRIM_THRESHOLD >> 20, "applied" if ok else "mallopt failed")
        return ok
