"""Compiled CPU kernels (numba) for the non-GEMM hot loops: pooling, im2col/col2im, LRN, ReLU, SGD update,
and direct convolution (:mod:`.conv_simd`'s register-blocked micro-kernels, :mod:`.direct`'s plain ones).

The layers keep their array-module (numpy/cupy) code as the general path and as the reference;
for numpy ``float32``/``float64`` arrays they dispatch here when the kernels are enabled
(:mod:`cct.layers.pooling`, :mod:`cct.layers.lrn`, :mod:`cct.lowering.im2col`,
:mod:`cct.layers.activation` (ReLU, :mod:`.elementwise`) and the SGD solver's update
(:mod:`.update`)).
Every kernel gives the same results as the numpy path: bitwise for copies, maxima and argmax
indices, and for sums too, since each kernel adds in the numpy path's order (LRN's ``pow`` is
computed by numpy itself, so LRN is bitwise as well). tests/test_kernels.py checks this.

* Selection: ``CCT_KERNELS=numpy`` (or ``off``/``0``/``none``) forces the numpy path; anything
  else (default ``auto``) uses the kernels when numba imports. :func:`set_mode` overrides the
  environment variable from code (``None`` gives it back). If numba is missing or fails to
  import, the numpy path runs and a debug message is logged once.
* Compilation is lazy: importing :mod:`cct` imports neither numba nor the kernels; the first
  use of a kernel compiles it, about 1 s per kernel and dtype (a LeNet training run compiles
  ~5 s on its first iteration on this 2-core box). ``cache=True``: once per machine; later
  processes load the machine code from ``cct/kernels/__pycache__`` (or ``NUMBA_CACHE_DIR``) in
  a few ms per kernel.
* Threads: the kernels are parallel over batch x channels (numba ``prange``). The count is
  numba's, which is per calling thread: :func:`set_num_threads` / :func:`num_threads` (a
  context manager) set it for the calling thread (default: all cores, ``NUMBA_NUM_THREADS``).
  Several Python threads may call kernels at once with numba's tbb or omp threading layer; with
  only ``workqueue`` available (it aborts on concurrent launches) calls from threads other than
  the main thread take the numpy path.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import numpy as np

log = logging.getLogger("cct")

ENV_VAR = "CCT_KERNELS"
_OFF = ("numpy", "off", "0", "none", "false", "no")
_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))

_lock = threading.Lock()
_numba_state: bool | None = None  # None: not tried yet
_numba_error: str | None = None
_modules: dict[str, ModuleType] = {}
_failed: set[str] = set()
_forced: str | None = None


def set_mode(mode: str | None) -> None:
    """Force ``"numpy"`` or ``"auto"`` for this process (``None``: follow ``CCT_KERNELS`` again)."""
    global _forced
    if mode is not None and mode.lower() not in _OFF + ("auto", "numba", "on", "1"):
        raise ValueError(f"kernel mode must be 'numpy' or 'auto', got {mode!r}")
    _forced = None if mode is None else mode.lower()


def mode() -> str:
    """``"numpy"`` when the kernels are switched off (``CCT_KERNELS`` or :func:`set_mode`), else ``"auto"``."""
    m = _forced if _forced is not None else os.environ.get(ENV_VAR, "auto").strip().lower()
    return "numpy" if m in _OFF else "auto"


@contextlib.contextmanager
def forced_mode(m: str) -> Iterator[None]:
    """Temporarily :func:`set_mode` (for tests and benchmarks)."""
    global _forced
    old = _forced
    set_mode(m)
    try:
        yield
    finally:
        _forced = old


def numba_available() -> bool:
    """Whether numba imports (tried once; a failure is logged at debug level and remembered)."""
    global _numba_state, _numba_error
    if _numba_state is None:
        with _lock:
            if _numba_state is None:
                try:
                    import numba  # noqa: F401
                    _numba_state = True
                except Exception as e:  # ImportError, or a broken llvmlite/numpy combination
                    _numba_error = f"{type(e).__name__}: {e}"
                    log.debug("cct.kernels: numba unavailable (%s); using the numpy code paths", _numba_error)
                    _numba_state = False
    return _numba_state


_threadsafe: bool | None = None


def _threadsafe_layer() -> bool:
    """Whether numba's threading layer will be one that allows concurrent parallel launches (tbb, omp).

    numba's ``workqueue`` layer aborts the process when two threads launch parallel kernels at
    once; it is only chosen when neither TBB nor OpenMP loads (or when asked for).
    """
    global _threadsafe
    if _threadsafe is None:
        import numba

        cfg = str(numba.config.THREADING_LAYER).lower()
        if cfg == "workqueue":
            ok = False
        elif cfg in ("safe", "threadsafe", "tbb", "omp"):
            ok = True
        else:
            ok = False
            for pool in ("tbbpool", "omppool"):
                try:
                    importlib.import_module(f"numba.np.ufunc.{pool}")
                    ok = True
                    break
                except Exception:  # noqa: BLE001 - any failure means the layer is unusable
                    continue
        _threadsafe = ok
        if not ok:
            log.debug("cct.kernels: numba has no thread-safe threading layer; kernels run on the main thread only")
    return _threadsafe


def start_threads() -> None:
    """Start numba's threading layer now, before a library that brings its own OpenMP runtime loads.

    MKL loads Intel's ``libiomp5``; numba's ``omp`` layer started after it binds to that runtime, and
    each parallel region then paid a wake-up that made kernel calls 3-4x slower (measured on a
    2-core Zen 5: a direct convolution call on a trivial layer 140 us against 35 us, an im2col-based
    one 58 against 19). Started first, the layer keeps its own runtime. Does nothing when the kernels
    are off; a failure to start is logged at debug level.
    """
    if not enabled():
        return
    try:
        from numba.np.ufunc import parallel

        parallel._launch_threads()
    except Exception as e:  # noqa: BLE001 - the kernels still run, only the order is not ensured
        log.debug("cct.kernels: could not start numba's threading layer early: %s", e)


def enabled() -> bool:
    """Whether the compiled kernels are in use (mode ``auto`` and numba importable)."""
    return mode() != "numpy" and numba_available()


def usable(*arrays: Any, contiguous: bool = False) -> bool:
    """True when the kernels are enabled and every array is a numpy float32/float64 ndarray of one dtype
    (and, with ``contiguous``, C-contiguous: the layers' blobs are; anything else takes the numpy path
    rather than compiling another variant)."""
    if not arrays or not enabled():
        return False
    if threading.current_thread() is not threading.main_thread() and not _threadsafe_layer():
        return False
    dt = None
    for a in arrays:
        if not isinstance(a, np.ndarray) or a.dtype not in _FLOATS:
            return False
        if contiguous and not a.flags.c_contiguous:
            return False
        if dt is None:
            dt = a.dtype
        elif a.dtype != dt:
            return False
    return True


def get(name: str) -> ModuleType | None:
    """The kernel module ``cct.kernels.<name>`` (imported on first use), or None without numba."""
    if not numba_available():
        return None
    mod = _modules.get(name)
    if mod is not None or name in _failed:
        return mod
    try:
        mod = importlib.import_module(f"{__name__}.{name}")
    except Exception as e:  # e.g. numba finds no writable cache directory: run the numpy path
        _failed.add(name)
        log.debug("cct.kernels: cannot load kernels %r (%s: %s); using the numpy code path", name,
                  type(e).__name__, e)
        return None
    _modules[name] = mod
    return mod


def set_num_threads(n: int | None) -> int:
    """Set the calling thread's kernel thread count (clipped to [1, NUMBA_NUM_THREADS]); returns it.

    ``None`` or ``0`` means all of numba's threads. Without numba this is a no-op returning 1.
    """
    if not numba_available():
        return 1
    import numba

    top = int(numba.config.NUMBA_NUM_THREADS)
    k = top if not n else max(1, min(int(n), top))
    numba.set_num_threads(k)
    return k


def get_num_threads() -> int:
    """The calling thread's kernel thread count (1 without numba)."""
    if not numba_available():
        return 1
    import numba

    return int(numba.get_num_threads())


#: elements below which a kernel runs on the calling thread alone: waking the OpenMP team costs more
#: than it saves (an SGD update of 500 parameters: ~4 us serial, 30-70 us as a 2-thread region; a
#: net's biases and small layers make several such calls per iteration)
SMALL_WORK = 1 << 15


#: elements below which the lowering kernels (im2col, col2im) run on the calling thread alone: what
#: they write is read next by one thread (or a small GEMM), and data written by another core cost
#: more to read than the second thread saved (a 2-core Zen 5 VM: im2col of 0.8M elements and one
#: read of the result, 373 us on two threads against 95 us on one)
LOWERING_SMALL_WORK = 1 << 20


def serial_if_small(n: int, fn, *args, limit: int = SMALL_WORK):
    """``fn(*args)``, on one kernel thread when ``n`` (the elements it touches) is below ``limit``;
    the calling thread's thread count is restored afterwards."""
    if n >= limit:
        return fn(*args)
    import numba

    old = numba.get_num_threads()
    if old == 1:
        return fn(*args)
    numba.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        numba.set_num_threads(old)


@contextlib.contextmanager
def num_threads(n: int | None) -> Iterator[int]:
    """Context manager: run the kernels of the calling thread on ``n`` threads, then restore."""
    if not numba_available():
        yield 1
        return
    old = get_num_threads()
    k = set_num_threads(n)
    try:
        yield k
    finally:
        set_num_threads(old)


def info() -> dict:
    """Mode, numba version/threading layer/threads (for benchmark reports)."""
    d: dict[str, Any] = {"mode": mode(), "numba": None, "enabled": enabled()}
    if numba_available():
        import numba

        d["numba"] = numba.__version__
        d["threads"] = get_num_threads()
        try:
            d["threading_layer"] = numba.threading_layer()
        except ValueError:  # no parallel function has run yet
            d["threading_layer"] = None
    else:
        d["error"] = _numba_error
    return d


_pool: Any = None


def worker_pool() -> Any:
    """The process's pool of ``cct-kernels`` threads (one per core) for work that releases the GIL and
    never calls BLAS (LRN's element-wise power chunks, the calibration's twin kernel calls); created
    on first use."""
    global _pool
    if _pool is None:
        with _lock:
            if _pool is None:
                from concurrent.futures import ThreadPoolExecutor

                _pool = ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1), thread_name_prefix="cct-kernels")
    return _pool
