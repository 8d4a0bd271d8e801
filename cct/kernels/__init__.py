"""Compiled CPU kernels (numba) for the non-GEMM hot loops: pooling, im2col/col2im, LRN, ReLU, SGD update,
direct convolution (:mod:`.conv_simd`'s register-blocked micro-kernels, :mod:`.direct`'s plain ones), and
the Philox draws of the device random streams on the CPU (:mod:`.philox`, for :mod:`cct.device.random`).

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
  use of a kernel compiles it, 0.2-1.7 s per kernel and dtype (LeNet's 14 kernels: 11 s on a 2-core
  Zen 3, which a first calibration shares out over the cores,
  :func:`cct.lowering.calibrate.precompile_kernels`). ``cache=True``: once per machine; later
  processes load the machine code from ``cct/kernels/__pycache__`` (or ``NUMBA_CACHE_DIR``) in
  a few ms per kernel.
* Process-wide state: one explicit object, :data:`RUNTIME` (:class:`KernelRuntime`), holds what the
  kernels keep for the whole process and says why each part is per process; nothing else here changes
  at run time.
* Threads: each kernel is compiled serial (numba's ``parallel=True`` compiled the same kernel about 3x
  slower, most of a first run on a new machine) and takes ``(piece, pieces, ...)``: it runs the
  ``piece``-th of ``pieces`` equal shares of its tasks (batch x channel planes, runs of elements).
  :func:`launch` runs the pieces, one per kernel thread of the calling thread, on a team of
  ``cct-kernels`` threads (the kernels release the GIL). The count is per calling thread:
  :func:`set_num_threads` / :func:`num_threads` (a context manager) (default: all cores, or
  ``NUMBA_NUM_THREADS``); the team's own threads count one, so a piece never launches more.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

import numpy as np

from .. import env

log = logging.getLogger("cct")

ENV_VAR = "CCT_KERNELS"
_OFF = ("numpy", "off", "0", "none", "false", "no")
FLOATS = (np.dtype(np.float32), np.dtype(np.float64))  # the dtypes the kernels are compiled for

#: elements below which a kernel runs on the calling thread alone: handing pieces to the team costs more
#: than it saves (an SGD update of 500 parameters: ~4 us serial, 30-70 us as a 2-thread region; a
#: net's biases and small layers make several such calls per iteration)
SMALL_WORK = 1 << 15


#: elements below which the lowering kernels (im2col, col2im) run on the calling thread alone: what
#: they write is read next by one thread (or a small GEMM), and data written by another core cost
#: more to read than the second thread saved (a 2-core Zen 5 VM: im2col of 0.8M elements and one
#: read of the result, 373 us on two threads against 95 us on one)
LOWERING_SMALL_WORK = 1 << 20


class _Helper:
    """One thread of the kernel team: runs each piece it is handed, then waits for the next. A pair of
    plain locks hands pieces over and back (a 2-piece launch of an empty kernel on a 2-core Zen 3 VM: ~85 us
    through a thread-pool future and its condition, 22-27 us through the locks)."""

    def __init__(self, name: str, local: threading.local) -> None:
        self._go, self._done = threading.Lock(), threading.Lock()
        self._go.acquire()
        self._done.acquire()
        self._task: tuple | None = None
        self._error: BaseException | None = None
        self._local = local
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def _serve(self) -> None:
        self._local.threads = 1  # a piece never launches more pieces
        while True:
            self._go.acquire()
            kernel, args = self._task
            try:
                kernel(*args)
            except BaseException as e:  # noqa: BLE001 - handed back to the launching thread
                self._error = e
            self._task = None
            self._done.release()

    def start(self, kernel: Any, args: tuple) -> None:
        self._task, self._error = (kernel, args), None
        self._go.release()

    def join(self) -> BaseException | None:
        """Wait for the piece to end; its error, if it raised one."""
        self._done.acquire()
        return self._error


class KernelRuntime:
    """What the kernels keep for the whole process, in one object (:data:`RUNTIME`). Each part is per
    process, not per net or config, for a reason of its own:

    * whether numba imports, and the kernel modules loaded: an interpreter imports a module once
      (``sys.modules``) and numba's compiled machine code lives in those modules; the names that failed to
      load are remembered, so that a broken numba cache is not tried again on every call;
    * the team of ``cct-kernels`` threads that run a launch's pieces and the pool of ``cct-twins`` threads
      of the calibration: one thread per core for the whole process (an owner per net would oversubscribe
      the cores); a forked child starts without them (:meth:`forget_threads`);
    * the kernel-thread ceiling: ``NUMBA_NUM_THREADS``, read once, as numba itself does;
    * the calling threads' kernel thread counts (a ``threading.local``: each thread its own);
    * the mode :func:`set_mode` forces: by its contract a switch for the whole process, like ``$CCT_KERNELS``;
    * whether a first calibration has compiled the kernels ahead already
      (:func:`cct.lowering.calibrate.precompile_kernels`): compiled code lives in the process.

    A test that needs a fresh state (numba failing to import, a module failing to load) builds its own
    and puts it in place of :data:`RUNTIME` for the test's duration.
    """

    def __init__(self, import_module: Callable[[str], ModuleType] = importlib.import_module) -> None:
        self._lock = threading.Lock()
        self._import_module = import_module
        self.forced: str | None = None
        self.numba_state: bool | None = None  # None: not tried yet
        self.numba_error: str | None = None
        self.modules: dict[str, ModuleType] = {}
        self.failed: set[str] = set()
        self.precompiled = False
        self.local = threading.local()
        self._max_threads: int | None = None
        self._idle: list[_Helper] = []
        self._helpers = 0
        self._twins: ThreadPoolExecutor | None = None

    def numba_available(self) -> bool:
        """Whether numba imports (tried once; a failure is logged at debug level and remembered)."""
        if self.numba_state is None:
            with self._lock:
                if self.numba_state is None:
                    try:
                        import numba  # noqa: F401
                        self.numba_state = True
                    except Exception as e:  # ImportError, or a broken llvmlite/numpy combination
                        self.numba_error = f"{type(e).__name__}: {e}"
                        log.debug("cct.kernels: numba unavailable (%s); using the numpy code paths", self.numba_error)
                        self.numba_state = False
        return self.numba_state

    def get(self, name: str) -> ModuleType | None:
        """The kernel module ``cct.kernels.<name>`` (imported on first use), or None without numba."""
        mod = self.modules.get(name)  # loaded: numba imported (the common case, first)
        if mod is not None or name in self.failed or not self.numba_available():
            return mod
        try:
            mod = self._import_module(f"{__name__}.{name}")
        except Exception as e:  # e.g. numba finds no writable cache directory: run the numpy path
            self.failed.add(name)
            log.debug("cct.kernels: cannot load kernels %r (%s: %s); using the numpy code path", name,
                      type(e).__name__, e)
            return None
        self.modules[name] = mod
        return mod

    def max_threads(self) -> int:
        """Kernel threads a caller may use: ``NUMBA_NUM_THREADS`` when set (read once, as numba does), else
        the cores."""
        top = self._max_threads
        if top is None:
            value = os.environ.get("NUMBA_NUM_THREADS", "").strip()
            top = self._max_threads = max(1, int(value) if value.isdigit() else (os.cpu_count() or 1))
        return top

    def take_helpers(self, k: int) -> list[_Helper]:
        """Up to ``k`` idle team threads (started on first use, :meth:`max_threads` - 1 in all)."""
        with self._lock:
            while len(self._idle) < k and self._helpers < self.max_threads() - 1:
                self._helpers += 1
                self._idle.append(_Helper(f"cct-kernels-{self._helpers}", self.local))
            if k == 1:  # the common case (two cores)
                return [self._idle.pop()] if self._idle else []
            taken = self._idle[len(self._idle) - min(k, len(self._idle)):]
            del self._idle[len(self._idle) - len(taken):]
        return taken

    def give_back(self, helpers: list[_Helper]) -> None:
        """Team threads whose pieces have ended, idle again."""
        with self._lock:
            self._idle.extend(helpers)

    def forget_threads(self) -> None:
        """In a forked child: the parent's team and twin threads do not exist there."""
        self._lock = threading.Lock()
        self._idle.clear()
        self._helpers = 0
        self._twins = None

    def twins_pool(self) -> ThreadPoolExecutor:
        """The pool of ``cct-twins`` threads (one per core), created on first use."""
        if self._twins is None:
            with self._lock:
                if self._twins is None:
                    self._twins = ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1),
                                                     thread_name_prefix="cct-twins")
        return self._twins


#: the process's kernel state (see :class:`KernelRuntime` for why it is per process)
RUNTIME = KernelRuntime()


def _forget_threads_in_child() -> None:
    RUNTIME.forget_threads()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_threads_in_child)


def set_mode(mode: str | None) -> None:
    """Force ``"numpy"`` or ``"auto"`` for this process (``None``: follow ``CCT_KERNELS`` again)."""
    if mode is not None and mode.lower() not in _OFF + ("auto", "numba", "on", "1"):
        raise ValueError(f"kernel mode must be 'numpy' or 'auto', got {mode!r}")
    RUNTIME.forced = None if mode is None else mode.lower()


def mode() -> str:
    """``"numpy"`` when the kernels are switched off (``CCT_KERNELS`` or :func:`set_mode`), else ``"auto"``."""
    forced = RUNTIME.forced
    m = forced if forced is not None else env.text(ENV_VAR).lower()
    return "numpy" if m in _OFF else "auto"


@contextlib.contextmanager
def forced_mode(m: str) -> Iterator[None]:
    """Temporarily :func:`set_mode` (for tests and benchmarks)."""
    runtime = RUNTIME
    old = runtime.forced
    set_mode(m)
    try:
        yield
    finally:
        runtime.forced = old


def numba_available() -> bool:
    """Whether numba imports (tried once; a failure is logged at debug level and remembered)."""
    return RUNTIME.numba_available()


def enabled() -> bool:
    """Whether the compiled kernels are in use (mode ``auto`` and numba importable)."""
    return mode() != "numpy" and numba_available()


def get(name: str) -> ModuleType | None:
    """The kernel module ``cct.kernels.<name>`` (imported on first use), or None without numba."""
    return RUNTIME.get(name)


def max_threads() -> int:
    """Kernel threads a caller may use: ``NUMBA_NUM_THREADS`` when set (read once, as numba does), else
    the cores."""
    return RUNTIME.max_threads()


def set_num_threads(n: int | None) -> int:
    """Set the calling thread's kernel thread count (clipped to [1, :func:`max_threads`]); returns it.
    ``None`` or ``0`` means all of them."""
    runtime = RUNTIME
    top = runtime.max_threads()
    k = top if not n else max(1, min(int(n), top))
    runtime.local.threads = k
    return k


def get_num_threads() -> int:
    """The calling thread's kernel thread count."""
    runtime = RUNTIME
    k = getattr(runtime.local, "threads", None)
    return runtime.max_threads() if k is None else k


def launch(kernel: Any, *args: Any, work: int | None = None, limit: int = SMALL_WORK) -> None:
    """``kernel(piece, pieces, *args)`` for every piece, ``pieces`` being the calling thread's kernel
    thread count (1 when ``work``, the elements the call touches, is below ``limit``): the caller runs
    piece 0, idle team threads the others (the caller runs those no team thread is free for, as when
    several threads launch at once). Returns when every piece has; the first error raised by a piece
    is raised again."""
    pieces = get_num_threads() if work is None or work >= limit else 1
    if pieces <= 1:
        kernel(0, 1, *args)
        return
    runtime = RUNTIME
    helpers = runtime.take_helpers(pieces - 1)
    for i, h in enumerate(helpers, 1):
        h.start(kernel, (i, pieces) + args)
    error: BaseException | None = None
    try:
        kernel(0, pieces, *args)
        for i in range(len(helpers) + 1, pieces):
            kernel(i, pieces, *args)
    except BaseException as e:  # noqa: BLE001 - raised below, once every piece has ended
        error = e
    for h in helpers:  # every piece must end before the caller reuses the arrays
        e = h.join()
        error = error or e
    runtime.give_back(helpers)
    if error is not None:
        raise error


@contextlib.contextmanager
def num_threads(n: int | None) -> Iterator[int]:
    """Context manager: run the kernels of the calling thread on ``n`` threads, then restore."""
    local = RUNTIME.local
    old = getattr(local, "threads", None)
    k = set_num_threads(n)
    try:
        yield k
    finally:
        local.threads = old


def info() -> dict:
    """Mode, numba version and the calling thread's kernel threads (for benchmark reports)."""
    d: dict[str, Any] = {"mode": mode(), "numba": None, "enabled": enabled()}
    if numba_available():
        import numba

        d["numba"] = numba.__version__
        d["threads"] = get_num_threads()
    else:
        d["error"] = RUNTIME.numba_error
    return d


def worker_pool() -> ThreadPoolExecutor:
    """The process's pool of ``cct-twins`` threads (one per core) that run the calibration's twin kernel
    calls (:func:`cct.lowering.rates.loaded_best_time`: whole calls side by side, not the pieces of one
    call, which :func:`launch` hands to the kernel team); created on first use."""
    return RUNTIME.twins_pool()
