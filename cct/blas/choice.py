"""Which BLAS library a GEMM runs on: the request, its resolution and the one-time ``auto`` measurement.

Precedence, highest first: the calling thread's device backend (:func:`set_thread_backend`, set in a
device's worker), the current configuration's :class:`cct.config.BlasConfig` (``using_config``,
the config a net was given, or :func:`set_backend` on the process default), ``$CCT_BLAS``, then
``auto``. ``auto`` is the faster library on this machine: a one-time micro-benchmark of a few
convolution-shaped GEMMs on each (well under 2 s), cached as JSON in the user cache dir;
:func:`calibrate` with ``force=True`` re-measures.
"""
from __future__ import annotations

import threading
import time

from .. import config as _config
from .. import env
from ..errors import CctError
from .cache import machine_key, read_cache, write_cache
from .mkl import load_mkl, mkl_available
from .timing import gemm_gflops

BACKENDS = ("openblas", "mkl")
_VALID_REQUESTS = BACKENDS + ("auto",)

_lock = threading.Lock()
_thread = threading.local()  # per-thread backend of a device's worker thread (set_thread_backend)

# Convolution-shaped GEMMs (M, N, K) = (out channels, batch*pixels, C*k*k) used by the
# backend micro-benchmark: CaffeNet conv1/conv2/conv5 at a small batch.
_BENCH_SHAPES = ((96, 3025 * 2, 363), (128, 729 * 4, 1200), (128, 169 * 8, 1728))


def _requested() -> str:
    req = _config.current().blas.backend
    if req is not None:
        return req
    req = env.text("CCT_BLAS").lower()
    if req not in _VALID_REQUESTS:
        raise CctError(f"CCT_BLAS={req!r}: expected one of {', '.join(_VALID_REQUESTS)}")
    return req


def set_backend(name: str) -> None:
    """Select ``"openblas"``, ``"mkl"`` or ``"auto"`` in the process default configuration (overrides
    CCT_BLAS; a scoped :func:`cct.config.using_config` or a net's own config still wins)."""
    blas = _config.BlasConfig(name)  # validates
    if blas.backend == "mkl":
        load_mkl()  # fail now, with a clean message
    _config.update_default(blas=blas)


def set_thread_backend(name: str | None) -> None:
    """Make GEMMs issued from the calling thread use ``name`` (a device's worker); None clears it."""
    if name is not None:
        if name not in BACKENDS:
            raise CctError(f"unknown BLAS backend '{name}' (use one of {', '.join(BACKENDS)})")
        if name == "mkl":
            load_mkl()
    _thread.backend = name


def get_backend() -> str:
    """The backend GEMMs issued now use (see module docstring; ``auto`` resolved by :func:`choose_backend`)."""
    local = getattr(_thread, "backend", None)
    if local is not None:
        return local
    req = _requested()
    if req == "auto":
        return choose_backend()
    if req == "mkl":
        load_mkl()
    return req


def time_backend(name: str) -> float:
    """GFLOPS of ``name`` on the micro-benchmark shapes."""
    return gemm_gflops(_BENCH_SHAPES, repeats=3, backend=name)


def calibrate(force: bool = False) -> dict:
    """Measure (or load from cache) the GEMM speed of each available backend.

    Returns ``{"gflops": {backend: GFLOPS}, "best": name, "key": machine_key(), ...}``.
    """
    key = machine_key()
    fname = f"blas-{key}.json"
    if not force:
        cached = read_cache(fname)
        if cached and cached.get("key") == key and cached.get("best") in BACKENDS:
            return cached
    results: dict[str, float] = {}
    for name in BACKENDS:
        if name == "mkl" and not mkl_available():
            continue
        results[name] = time_backend(name)
    best = max(results, key=results.get)
    info = {"key": key, "gflops": results, "best": best, "measured_at": time.time(),
            "shapes": [list(s) for s in _BENCH_SHAPES]}
    try:
        write_cache(fname, info)
    except OSError:  # read-only home: keep the in-process result
        pass
    return info


def choose_backend(force: bool = False) -> str:
    """The faster backend on this machine (one-time micro-benchmark, cached on disk; the answer is kept
    in the current configuration's :class:`~cct.config.PlanningCaches`)."""
    caches = _config.current().caches
    if caches.blas_auto is not None and not force:
        return caches.blas_auto
    with _lock:
        if caches.blas_auto is None or force:
            caches.blas_auto = calibrate(force=force)["best"]
        return caches.blas_auto
