"""Selectable BLAS backend for the GEMMs of the convolution lowerings.

Two backends compute float32 (and float64) matrix products on the CPU:

* ``"openblas"``: numpy's bundled OpenBLAS, through ``np.matmul(..., out=)``.
* ``"mkl"``: Intel MKL's single dynamic library ``libmkl_rt`` (the PyPI ``mkl`` package),
  called through ctypes (``cblas_sgemm`` / ``cblas_dgemm``).

Selection, highest priority first: :func:`set_backend` (programmatic), the ``CCT_BLAS``
environment variable (``openblas`` | ``mkl`` | ``auto``), and ``auto`` otherwise. ``auto``
is resolved lazily by :func:`choose_backend`: a one-time micro-benchmark of a few
convolution-shaped GEMMs on both libraries (well under 2 s), cached as JSON in the user cache
dir (:func:`cache_dir`); :func:`calibrate` with ``force=True`` re-measures.

Threads: :func:`blas_threads` is a context manager limiting the BLAS threads of the current
backend. For OpenBLAS (pthreads build, as shipped with numpy) every limit is *process-wide*
(threadpoolctl's ``threadpool_limits``; OpenBLAS's ``openblas_set_num_threads_local`` is also
global in that build). For MKL, ``mkl_set_num_threads_local`` is genuinely per calling thread.
:func:`supports_thread_local_limits` says which applies. cupy arrays are multiplied with
``cupy.matmul`` whatever the backend.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import glob
import hashlib
import json
import os
import platform
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .backend import get_array_module
from .errors import CctError

BACKENDS = ("openblas", "mkl")
_VALID_REQUESTS = BACKENDS + ("auto",)

_lock = threading.RLock()
_thread = threading.local()  # per-thread backend of a device's worker thread (set_thread_backend)
_explicit: str | None = None  # set by set_backend()
_resolved_auto: str | None = None  # result of choose_backend(), memoised per process
_mkl: _MKL | None = None
_mkl_error: str | None = None

# CBLAS enums.
_ROW_MAJOR = 101
_NO_TRANS = 111
_TRANS = 112


class BlasUnavailable(CctError):
    """The requested BLAS library cannot be loaded."""


# ----------------------------------------------------------------------------------------------
# cache directory / machine identity (shared with cct.lowering.calibrate)
# ----------------------------------------------------------------------------------------------
def cache_dir() -> Path:
    """The per-user cache dir: $CCT_CACHE_DIR, else $XDG_CACHE_HOME/cct, else ~/.cache/cct."""
    if os.environ.get("CCT_CACHE_DIR"):
        d = Path(os.environ["CCT_CACHE_DIR"])
    elif os.environ.get("XDG_CACHE_HOME"):
        d = Path(os.environ["XDG_CACHE_HOME"]) / "cct"
    else:
        d = Path.home() / ".cache" / "cct"
    return d


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key() -> str:
    """A short hash identifying this machine + BLAS setup (host, CPU, cores, library kernels)."""
    parts = [
        platform.node(),
        _cpu_model(),
        str(os.cpu_count()),
        np.__version__,
        os.environ.get("OPENBLAS_CORETYPE", ""),
        os.environ.get("OPENBLAS_L2_SIZE", ""),
        os.environ.get("OPENBLAS_NUM_THREADS", ""),
        os.environ.get("OMP_NUM_THREADS", ""),
        os.environ.get("MKL_NUM_THREADS", ""),
    ]
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:12]


def read_cache(name: str) -> dict | None:
    """Load ``<cache_dir>/<name>`` as JSON, or None if absent/corrupt."""
    p = cache_dir() / name
    try:
        with open(p) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_cache(name: str, obj: dict) -> Path:
    """Atomically write ``obj`` as JSON to ``<cache_dir>/<name>``; returns the path."""
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    p = d / name
    tmp = p.with_name(p.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
    os.replace(tmp, p)
    return p


# ----------------------------------------------------------------------------------------------
# MKL through ctypes
# ----------------------------------------------------------------------------------------------
def _find_mkl_rt() -> str | None:
    cands: list[str] = []
    for prefix in {sys.prefix, sys.base_prefix, os.environ.get("CONDA_PREFIX", "")}:
        if prefix:
            cands += sorted(glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so*")))
            cands += sorted(glob.glob(os.path.join(prefix, "Library", "bin", "mkl_rt*.dll")))
    found = ctypes.util.find_library("mkl_rt")
    if found:
        cands.append(found)
    return cands[0] if cands else None


class _MKL:
    """Thin ctypes binding of the few MKL entry points cct uses."""

    def __init__(self, path: str):
        self.path = path
        self.lib = ctypes.CDLL(path)
        P = ctypes.c_void_p
        i = ctypes.c_int
        for fn, real in (("cblas_sgemm", ctypes.c_float), ("cblas_dgemm", ctypes.c_double)):
            f = getattr(self.lib, fn)
            f.restype = None
            f.argtypes = [i, i, i, i, i, i, real, P, i, P, i, real, P, i]
        self.sgemm = self.lib.cblas_sgemm
        self.dgemm = self.lib.cblas_dgemm
        # The C entry points are the MixedCase ones (mkl_service.h #defines the lowercase names
        # to them); the lowercase library symbols are the Fortran interface (int by reference).
        self.set_local = getattr(self.lib, "MKL_Set_Num_Threads_Local", None)
        if self.set_local is not None:
            self.set_local.restype = ctypes.c_int
            self.set_local.argtypes = [ctypes.c_int]
        self.set_global = getattr(self.lib, "MKL_Set_Num_Threads", None)
        if self.set_global is not None:
            self.set_global.restype = None
            self.set_global.argtypes = [ctypes.c_int]
        self.get_max = getattr(self.lib, "MKL_Get_Max_Threads", None)
        if self.get_max is not None:
            self.get_max.restype = ctypes.c_int
            self.get_max.argtypes = []

    def version(self) -> str:
        buf = ctypes.create_string_buffer(256)
        try:
            self.lib.mkl_get_version_string(buf, 256)
        except AttributeError:  # pragma: no cover
            return "unknown"
        return buf.value.decode(errors="replace").strip()

    def max_threads(self) -> int:
        return int(self.get_max()) if self.get_max is not None else 1


def _load_mkl() -> _MKL:
    global _mkl, _mkl_error
    with _lock:
        if _mkl is not None:
            return _mkl
        if _mkl_error is not None:
            raise BlasUnavailable(_mkl_error)
        path = _find_mkl_rt()
        if path is None:
            _mkl_error = ("MKL backend requested but libmkl_rt was not found under sys.prefix/lib or on the "
                          "library path; install it with `pip install mkl` or use CCT_BLAS=openblas")
            raise BlasUnavailable(_mkl_error)
        try:
            _mkl = _MKL(path)
        except (OSError, AttributeError) as e:
            _mkl_error = f"MKL backend: could not load {path}: {e}"
            raise BlasUnavailable(_mkl_error) from e
        return _mkl


def mkl_available() -> bool:
    """True when libmkl_rt can be loaded."""
    try:
        _load_mkl()
        return True
    except BlasUnavailable:
        return False


# ----------------------------------------------------------------------------------------------
# backend selection
# ----------------------------------------------------------------------------------------------
def _requested() -> str:
    if _explicit is not None:
        return _explicit
    req = os.environ.get("CCT_BLAS", "auto").strip().lower() or "auto"
    if req not in _VALID_REQUESTS:
        raise CctError(f"CCT_BLAS={req!r}: expected one of {', '.join(_VALID_REQUESTS)}")
    return req


def set_backend(name: str) -> None:
    """Select ``"openblas"``, ``"mkl"`` or ``"auto"`` for this process (overrides CCT_BLAS)."""
    global _explicit
    name = name.strip().lower()
    if name not in _VALID_REQUESTS:
        raise CctError(f"unknown BLAS backend {name!r}: expected one of {', '.join(_VALID_REQUESTS)}")
    if name == "mkl":
        _load_mkl()  # fail now, with a clean message
    _explicit = name


def set_thread_backend(name: str | None) -> None:
    """Make GEMMs issued from the calling thread use ``name`` (a device's worker); None clears it."""
    if name is not None:
        if name not in BACKENDS:
            raise CctError(f"unknown BLAS backend '{name}' (use one of {', '.join(BACKENDS)})")
        if name == "mkl":
            _load_mkl()
    _thread.backend = name


def get_backend() -> str:
    """The backend GEMMs use now: the calling thread's, else the process-wide one (``auto`` resolved
    via :func:`choose_backend`)."""
    local = getattr(_thread, "backend", None)
    if local is not None:
        return local
    req = _requested()
    if req == "auto":
        return choose_backend()
    if req == "mkl":
        _load_mkl()
    return req


# Convolution-shaped GEMMs (M, N, K) = (out channels, batch*pixels, C*k*k) used by the
# backend micro-benchmark: CaffeNet conv1/conv2/conv5 at a small batch.
_BENCH_SHAPES = ((96, 3025 * 2, 363), (128, 729 * 4, 1200), (128, 169 * 8, 1728))


def _time_backend(name: str, shapes=_BENCH_SHAPES, repeats: int = 3) -> float:
    """Best-of-``repeats`` GFLOPS summed over ``shapes`` (total flops / total time)."""
    rng = np.random.default_rng(0)
    flops = 0.0
    secs = 0.0
    for (m, n, k) in shapes:
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        c = np.empty((m, n), np.float32)
        gemm(a, b, out=c, backend=name)  # warm-up
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            gemm(a, b, out=c, backend=name)
            best = min(best, time.perf_counter() - t0)
        flops += 2.0 * m * n * k
        secs += best
    return flops / secs / 1e9


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
        results[name] = _time_backend(name)
    best = max(results, key=results.get)
    info = {"key": key, "gflops": results, "best": best, "measured_at": time.time(),
            "shapes": [list(s) for s in _BENCH_SHAPES]}
    try:
        write_cache(fname, info)
    except OSError:  # read-only home: keep the in-process result
        pass
    return info


def choose_backend(force: bool = False) -> str:
    """The faster backend on this machine (one-time micro-benchmark, cached on disk)."""
    global _resolved_auto
    with _lock:
        if _resolved_auto is not None and not force:
            return _resolved_auto
        _resolved_auto = calibrate(force=force)["best"]
        return _resolved_auto


# ----------------------------------------------------------------------------------------------
# GEMM
# ----------------------------------------------------------------------------------------------
def _as_cblas_operand(x: np.ndarray, trans: bool) -> tuple[np.ndarray, bool, int]:
    """Express op(x) as a row-major buffer + transpose flag + leading dimension."""
    if x.ndim != 2:
        raise CctError(f"gemm: expected 2-D operands, got shape {x.shape}")
    isz = x.itemsize
    s0, s1 = x.strides
    rows, cols = x.shape
    if (s1 == isz or cols == 1) and s0 >= max(cols, 1) * isz and s0 % isz == 0:
        return x, trans, max(s0 // isz, cols, 1)
    if (s0 == isz or rows == 1) and s1 >= max(rows, 1) * isz and s1 % isz == 0:
        # column-major: its transpose is row-major
        return x.T, not trans, max(s1 // isz, rows, 1)
    return _as_cblas_operand(np.ascontiguousarray(x), trans)


def _cblas_gemm(fn: Any, a, b, out, trans_a, trans_b, alpha, beta) -> np.ndarray:
    """``out = alpha * op(a) @ op(b) + beta * out`` through a ctypes ``cblas_?gemm`` (row-major)."""
    m = a.shape[1] if trans_a else a.shape[0]
    k = a.shape[0] if trans_a else a.shape[1]
    n = b.shape[0] if trans_b else b.shape[1]
    A, ta, lda = _as_cblas_operand(a, trans_a)
    B, tb, ldb = _as_cblas_operand(b, trans_b)
    target = out
    direct = (out.flags.c_contiguous or (out.strides[1] == out.itemsize and out.strides[0] >= n * out.itemsize))
    if not direct:
        target = np.ascontiguousarray(out) if beta != 0 else np.empty((m, n), out.dtype)
    ldc = max(target.strides[0] // target.itemsize, n, 1)
    if m and n:
        if k == 0:
            target *= beta
        else:
            fn(_ROW_MAJOR, _TRANS if ta else _NO_TRANS, _TRANS if tb else _NO_TRANS, m, n, k, alpha,
               A.ctypes.data, lda, B.ctypes.data, ldb, beta, target.ctypes.data, ldc)
    if target is not out:
        out[...] = target
    return out


def _mkl_gemm(a, b, out, trans_a, trans_b, alpha, beta) -> np.ndarray:
    lib = _load_mkl()
    return _cblas_gemm(lib.sgemm if a.dtype == np.float32 else lib.dgemm, a, b, out, trans_a, trans_b,
                       alpha, beta)


class _OpenBLAS:
    """ctypes binding of numpy's bundled OpenBLAS ``cblas_?gemm`` (numpy's matmul has no ``beta``)."""

    # (sgemm, dgemm, 64-bit integers): scipy-openblas (numpy >= 2), openblas64_ (older wheels), plain
    SYMBOLS = (("scipy_cblas_sgemm64_", "scipy_cblas_dgemm64_", True), ("cblas_sgemm64_", "cblas_dgemm64_", True),
               ("scipy_cblas_sgemm", "scipy_cblas_dgemm", False), ("cblas_sgemm", "cblas_dgemm", False))

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        for sname, dname, wide in self.SYMBOLS:
            if hasattr(self.lib, sname) and hasattr(self.lib, dname):
                i, P = (ctypes.c_int64 if wide else ctypes.c_int), ctypes.c_void_p
                self.sgemm, self.dgemm = getattr(self.lib, sname), getattr(self.lib, dname)
                for f, real in ((self.sgemm, ctypes.c_float), (self.dgemm, ctypes.c_double)):
                    f.restype = None
                    f.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, i, i, i, real, P, i, P, i, real, P, i]
                return
        raise AttributeError(f"no cblas_sgemm entry point in {getattr(lib, '_name', lib)}")


_openblas: _OpenBLAS | None | bool = None


def _load_openblas() -> _OpenBLAS | None:
    """numpy's OpenBLAS through ctypes, or None when it cannot be found (then numpy's matmul is used)."""
    global _openblas
    if _openblas is None:
        with _lock:
            if _openblas is None:
                lib = _numpy_openblas_cdll()
                try:
                    _openblas = _OpenBLAS(lib) if lib is not None else False
                except (AttributeError, TypeError):
                    _openblas = False
    return _openblas or None


_ob_cdll: ctypes.CDLL | None | bool = None


def _numpy_openblas_cdll() -> ctypes.CDLL | None:
    """numpy's OpenBLAS library as a ctypes handle (loaded once; call under ``_lock``), or None when it
    cannot be found."""
    global _ob_cdll
    if _ob_cdll is None:
        ctls = _openblas_controllers()
        path = getattr(ctls[0], "filepath", None) if ctls else None
        try:
            _ob_cdll = ctypes.CDLL(path) if path else False
        except (OSError, TypeError):
            _ob_cdll = False
    return _ob_cdll or None


_ACC_BLOCK_BYTES = 512 << 10  # row-block size of accumulating (beta = 1) GEMMs into big outputs


def gemm(a: Any, b: Any, out: Any = None, trans_a: bool = False, trans_b: bool = False,
         alpha: float = 1.0, beta: float = 0.0, backend: str | None = None) -> Any:
    """``out = alpha * op(a) @ op(b) + beta * out`` for 2-D float32/float64 arrays.

    numpy float32/float64 go to the selected CPU backend (``backend`` overrides it for this
    call); other dtypes and cupy arrays use ``xp.matmul``. ``out`` (if given) must have the
    result's shape and dtype; it is returned.
    """
    xp = get_array_module(a, b)
    opa = a.T if trans_a else a
    opb = b.T if trans_b else b
    if opa.shape[-1] != opb.shape[0]:
        raise CctError(f"gemm: shapes {opa.shape} and {opb.shape} do not align")
    shape = (opa.shape[0], opb.shape[1])
    if out is None:
        out = xp.empty(shape, dtype=np.result_type(a.dtype, b.dtype))
        beta = 0.0
    elif tuple(out.shape) != shape:
        raise CctError(f"gemm: out has shape {tuple(out.shape)}, expected {shape}")
    use_mkl = False
    if xp is np and a.dtype == b.dtype == out.dtype and a.dtype in (np.float32, np.float64):
        name = backend if backend is not None else get_backend()
        use_mkl = name == "mkl"
    if use_mkl:
        return _mkl_gemm(a, b, out, trans_a, trans_b, float(alpha), float(beta))
    if beta != 0 and xp is np and a.dtype == b.dtype == out.dtype and a.dtype in (np.float32, np.float64):
        ob = _load_openblas()  # accumulate inside the GEMM: no temporary, no extra sweep over out
        if ob is not None:
            fn = ob.sgemm if a.dtype == np.float32 else ob.dgemm
            return _cblas_gemm(fn, a, b, out, trans_a, trans_b, float(alpha), float(beta))
    if beta == 0:
        xp.matmul(opa, opb, out=out)
        if alpha != 1:
            out *= alpha
    elif xp is np and beta == 1 and out.nbytes > _ACC_BLOCK_BYTES and shape[1] > 0:
        # out += alpha * op(a) @ op(b) in row blocks whose product stays in cache: a big accumulated
        # result (an InnerProduct's weight gradient) then makes 2 trips through DRAM instead of 4.
        rows = max(1, _ACC_BLOCK_BYTES // (shape[1] * out.itemsize))
        tmp = np.empty((min(rows, shape[0]), shape[1]), dtype=out.dtype)
        for s0 in range(0, shape[0], rows):
            s1 = min(shape[0], s0 + rows)
            t = tmp[: s1 - s0]
            np.matmul(opa[s0:s1], opb, out=t)
            if alpha != 1:
                t *= alpha
            out[s0:s1] += t
    else:
        tmp = xp.matmul(opa, opb)
        if beta != 1:
            out *= beta
        if alpha != 1:
            tmp *= alpha
        out += tmp
    return out


def matmul(a: Any, b: Any, out: Any = None) -> Any:
    """``xp.matmul`` (stacked, broadcasting operands) on the selected backend.

    With MKL selected, numpy float operands are multiplied slice by slice through cblas_sgemm;
    otherwise this is ``xp.matmul`` (numpy's OpenBLAS, or cuBLAS for cupy).
    """
    xp = get_array_module(a, b)
    if not (xp is np and a.dtype == b.dtype and a.dtype in (np.float32, np.float64) and a.ndim >= 2
            and b.ndim >= 2 and get_backend() == "mkl"):
        return xp.matmul(a, b, out=out)
    if a.ndim == 2 and b.ndim == 2:
        return gemm(a, b, out=out)
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    shape = batch + (a.shape[-2], b.shape[-1])
    if out is None:
        out = np.empty(shape, dtype=a.dtype)
    elif tuple(out.shape) != shape:
        raise CctError(f"matmul: out has shape {tuple(out.shape)}, expected {shape}")
    ab = np.broadcast_to(a, batch + a.shape[-2:])
    bb = np.broadcast_to(b, batch + b.shape[-2:])
    for idx in np.ndindex(*batch):
        gemm(ab[idx], bb[idx], out=out[idx])
    return out


def sgemm(a: Any, b: Any, out: Any = None, trans_a: bool = False, trans_b: bool = False,
          alpha: float = 1.0, beta: float = 0.0) -> Any:
    """Single-precision GEMM on the selected backend (same contract as :func:`gemm`)."""
    return gemm(a, b, out=out, trans_a=trans_a, trans_b=trans_b, alpha=alpha, beta=beta)


# ----------------------------------------------------------------------------------------------
# threads and introspection
# ----------------------------------------------------------------------------------------------
def supports_thread_local_limits(backend: str | None = None) -> bool:
    """True when :func:`blas_threads` only affects the calling thread (MKL); False for
    OpenBLAS, whose limits are process-wide."""
    name = backend or get_backend()
    if name == "mkl":
        lib = _load_mkl()
        return lib.set_local is not None
    return False


@contextlib.contextmanager
def blas_threads(n: int | None, backend: str | None = None) -> Iterator[None]:
    """Limit the current backend's BLAS threads to ``n`` inside the block (None: no change).

    MKL: per calling thread (``mkl_set_num_threads_local``). OpenBLAS: process-wide
    (threadpoolctl), so concurrent partitions must all use the same ``n``.
    """
    if n is None:
        yield
        return
    n = max(1, int(n))
    name = backend or get_backend()
    if name == "mkl":
        lib = _load_mkl()
        if lib.set_local is not None:
            prev = lib.set_local(n)
            try:
                yield
            finally:
                lib.set_local(prev)
            return
    ctls = _openblas_controllers()
    if ctls:
        prev = [c.get_num_threads() for c in ctls]
        if all(p == n for p in prev):
            yield
            return
        for c in ctls:
            c.set_num_threads(n)
        try:
            yield
        finally:
            for c, p in zip(ctls, prev):
                c.set_num_threads(p)
        return
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=n, user_api="blas"):
        yield


_ob_ctls: list | None = None


def _openblas_controllers() -> list:
    """threadpoolctl's controllers of the loaded OpenBLAS libraries (numpy's first), looked up once.

    Setting/reading a thread count through them is a plain C call (~0.1 us), while
    ``threadpool_limits``/``threadpool_info`` rescan every loaded library (~0.2 ms a call).
    """
    global _ob_ctls
    if _ob_ctls is None:
        with _lock:
            if _ob_ctls is None:
                try:
                    from threadpoolctl import ThreadpoolController

                    ctl = ThreadpoolController().select(internal_api="openblas")
                    libs = list(ctl.lib_controllers)
                except Exception:  # noqa: BLE001 - threadpoolctl missing or failing: use the slow path
                    libs = []
                libs.sort(key=lambda c: "numpy" not in str(getattr(c, "filepath", "")))
                _ob_ctls = libs
    return _ob_ctls


DEFAULT_THREAD_TIMEOUT = 16  # 2**16 cycles (~20 us) of spinning before an idle OpenBLAS worker sleeps
_spin_done = False


def limit_openblas_spin(exponent: int | None = None) -> bool:
    """Make numpy's OpenBLAS workers sleep after ``2**exponent`` idle cycles (once per process).

    OpenBLAS (pthreads build) keeps its worker threads spinning for ``2**28`` cycles (~0.1 s)
    after every multi-threaded GEMM unless ``OPENBLAS_THREAD_TIMEOUT`` was set before it loaded.
    On a machine with few cores that spinning steals the cores from everything that runs next
    (numba kernels, concurrent batch partitions, other processes): measured on a 2-core box, cct's
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
        if threading.current_thread() is not threading.main_thread() or any(
                t.name.startswith("cct-") and t.is_alive() for t in threading.enumerate()):
            return False
        _spin_done = True
        env = os.environ.get("CCT_BLAS_THREAD_TIMEOUT", "").strip().lower()
        if env in ("0", "off", "no", "false") or "OPENBLAS_THREAD_TIMEOUT" in os.environ:
            return False
        if exponent is None:
            exponent = int(env) if env.isdigit() else DEFAULT_THREAD_TIMEOUT
        lib = _numpy_openblas_cdll()
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


def set_num_threads(n: int, backend: str | None = None) -> None:
    """Set the process-wide BLAS thread count of a backend."""
    name = backend or get_backend()
    if name == "mkl":
        lib = _load_mkl()
        if lib.set_global is not None:
            lib.set_global(int(n))
        return
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=int(n), user_api="blas")


def get_num_threads(backend: str | None = None) -> int:
    """The BLAS thread count the backend would use now (in this thread)."""
    name = backend or get_backend()
    if name == "mkl":
        return _load_mkl().max_threads()
    ctls = _openblas_controllers()
    if ctls:
        return int(ctls[0].get_num_threads())
    from threadpoolctl import threadpool_info

    for info in threadpool_info():
        if info.get("internal_api") == "openblas" and "numpy" in info.get("filepath", ""):
            return int(info.get("num_threads", 1))
    for info in threadpool_info():
        if info.get("internal_api") == "openblas":
            return int(info.get("num_threads", 1))
    return 1


def blas_info() -> dict:
    """What GEMMs run on: backend, library file, kernel (e.g. SkylakeX/Haswell), threads.

    Also reports the OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE environment overrides, which change
    OpenBLAS's kernel choice.
    """
    from threadpoolctl import threadpool_info

    name = get_backend()
    libs = []
    for info in threadpool_info():
        if info.get("user_api") == "blas":
            libs.append({k: info.get(k) for k in ("internal_api", "architecture", "num_threads", "version",
                                                   "filepath", "threading_layer")})
    out: dict[str, Any] = {"backend": name, "libraries": libs,
                           "env": {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
                                                              "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                                                              "MKL_NUM_THREADS", "CCT_BLAS") if k in os.environ}}
    active = None
    for lib in libs:
        if lib["internal_api"] == name or (name == "openblas" and lib["internal_api"] == "openblas"
                                            and "numpy" in (lib["filepath"] or "")):
            active = lib
            break
    if name == "mkl" and _mkl is not None:
        out["mkl_version"] = _mkl.version()
        out["mkl_path"] = _mkl.path
    if active is not None:
        out["internal_api"] = active["internal_api"]
        out["architecture"] = active.get("architecture")
        out["num_threads"] = active.get("num_threads")
        out["filepath"] = active.get("filepath")
    return out


def describe() -> str:
    """One line naming the backend, its kernel and thread count (for logs and benchmarks)."""
    info = blas_info()
    arch = info.get("architecture") or "-"
    s = (f"BLAS {info['backend']} ({info.get('internal_api', '?')}, kernel {arch}, "
         f"{info.get('num_threads', '?')} threads)")
    if info["env"]:
        s += " env " + " ".join(f"{k}={v}" for k, v in info["env"].items())
    return s
