"""Compute devices for the data-parallel scheduler: CPU workers and CuPy GPUs.

A :class:`CpuDevice` is a dedicated worker thread that runs its share of each layer with
numpy and one BLAS backend (``openblas`` = numpy's bundled OpenBLAS, ``mkl`` = MKL through
:mod:`cct.blas`) under its own thread budget. numpy and the BLAS libraries release the GIL,
so two CPU devices really compute at the same time on different cores.

How the thread budgets work (measured on the 2-core development box, see benchmarks/README.md):

* OpenBLAS (numpy's pthreads build) has ONE process-wide thread count (threadpoolctl /
  ``openblas_set_num_threads``; the ``_local`` variant is global in that build too). A GEMM called
  with a count of 1 runs in the calling thread, so several 1-thread OpenBLAS devices run in parallel;
  with a count > 1, concurrent callers share (and serialise on) one thread pool. Hence every OpenBLAS
  device of one process must have the same budget; :func:`configure_thread_budgets` sets it.
* MKL has a genuine per-calling-thread limit (``mkl_set_num_threads_local``), set once in the
  device's worker thread.
* Which backend a device's GEMMs use is a per-thread choice in :mod:`cct.blas` when that module
  offers ``set_thread_backend`` (the device calls it in its worker); without it only the process
  backend can be used and asking for another one is an error.

A :class:`GpuDevice` (CuPy + cuBLAS) exists only when CuPy imports and sees the GPU; its worker
thread makes that GPU current. Layers are the same code on both (``xp`` from the blobs).
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from .. import blas
from ..config import submit_in_context
from ..device import cublas as device_blas
from ..device.driver import CupyDevice, HostDevice, cupy_available, gpu_count
from ..device.driver import Device as Memory
from ..errors import CctError

log = logging.getLogger("cct")

_CP_CORES_PER_SM = {  # FP32 lanes per SM by compute capability (for the theoretical peak)
    (3, 0): 192, (3, 5): 192, (3, 7): 192, (5, 0): 128, (5, 2): 128, (6, 0): 64, (6, 1): 128,
    (7, 0): 64, (7, 2): 64, (7, 5): 64, (8, 0): 64, (8, 6): 128, (8, 7): 128, (8, 9): 128,
    (9, 0): 128, (10, 0): 128, (12, 0): 128,
}


def cpu_cores() -> int:
    """Cores this process may run on (affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


def per_thread_blas_supported() -> bool:
    """True when :mod:`cct.blas` can select the backend per calling thread (``set_thread_backend``)."""
    return callable(getattr(blas, "set_thread_backend", None))


class Device:
    """One compute device: a name, its memory (a :class:`cct.device.driver.Device`: array module, copies,
    allocation) and a dedicated worker thread."""

    kind: str = ""

    def __init__(self, index: int, threads: int, memory: Memory):
        self.index = int(index)
        self.threads = int(threads)
        self.memory = memory  # the host's (slices of host blobs are views) or a GPU's
        self._pool: cf.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.index}"

    @property
    def xp(self):
        """The array module of this device's arrays."""
        return self.memory.xp

    def set_tf32(self, on: bool) -> None:
        """TF32 math for float32 GEMMs: a GPU setting; CPU devices always compute in FP32."""

    # -- worker thread -----------------------------------------------------------------
    def _init_thread(self) -> None:
        """Runs once in the worker thread (thread-local library settings)."""

    def bind_thread(self) -> None:
        """Apply this device's thread-local settings (BLAS backend and thread count) to the calling thread: a
        thread of the caller's that computes this device's part itself (an in-process worker)."""
        self._init_thread()

    def _executor(self) -> cf.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"cct-{self.kind}{self.index}",
                                                   initializer=self._init_thread)
            return self._pool

    def submit(self, fn: Callable[..., Any], *args: Any) -> cf.Future:
        """Run ``fn(*args)`` on this device's worker thread, in a copy of the caller's context (so under
        the caller's :func:`cct.config.current`)."""
        return submit_in_context(self._executor().submit, fn, *args)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the worker and wait for its result (exceptions propagate)."""
        return self.submit(fn, *args).result()

    def close(self) -> None:
        """Stop the worker thread (a later submit starts a new one)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def signature(self) -> str:
        """Identifies the device configuration in caches."""
        return self.name

    def info(self) -> dict:
        """Static description (no measurement)."""
        return {"name": self.name, "kind": self.kind, "threads": self.threads}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.signature()}>"


class CpuDevice(Device):
    """A CPU worker: numpy + one BLAS backend with ``threads`` BLAS threads (see module docstring).

    ``index`` must be below the number of usable cores; ``blas_backend`` defaults to the backend
    the layers' GEMMs really use; ``query_only`` skips that check (``device_query`` lists every
    backend).
    """

    kind = "cpu"

    def __init__(self, index: int = 0, threads: int | None = None, blas_backend: str | None = None,
                 query_only: bool = False):
        ncores = cpu_cores()
        if index < 0 or index >= ncores:
            raise CctError(f"CPU device cpu:{index} does not exist: this machine lets cct use {ncores} core(s), "
                           f"so at most {ncores} CPU devices (cpu:0 .. cpu:{ncores - 1})")
        if threads is None:
            threads = 1
        if threads < 1:
            raise CctError(f"cpu:{index}: threads must be >= 1, got {threads}")
        super().__init__(index, threads, HostDevice())
        per_thread = per_thread_blas_supported()
        # Without per-thread selection in cct.blas, the layers' GEMMs run on numpy's OpenBLAS.
        default = blas.get_backend() if per_thread else "openblas"
        name = (blas_backend or default).strip().lower()
        if name == "auto":
            name = blas.choose_backend() if per_thread else "openblas"
        if name not in blas.BACKENDS:
            raise CctError(f"cpu:{index}: unknown BLAS backend '{name}' (use one of {', '.join(blas.BACKENDS)})")
        if name == "mkl":
            blas.load_mkl()  # clear BlasUnavailable (a CctError) when MKL is missing
        if name != default and not per_thread and not query_only:
            raise CctError(
                f"cpu:{index}: BLAS backend '{name}' cannot be used by a device yet: cct.blas cannot select the "
                "backend per thread (no set_thread_backend), so the layers' GEMMs run on numpy's OpenBLAS")
        self.blas = name

    def _init_thread(self) -> None:
        set_tb = getattr(blas, "set_thread_backend", None)
        if set_tb is not None:
            set_tb(self.blas)
        if self.blas == "mkl":
            lib = blas.load_mkl()
            if lib.set_local is not None:
                lib.set_local(self.threads)

    def signature(self) -> str:
        return f"cpu:{self.index}:blas={self.blas}:threads={self.threads}"

    def kernel(self) -> str:
        """The BLAS kernel this device's GEMMs run (threadpoolctl's architecture / MKL version)."""
        if self.blas == "mkl":
            try:
                return blas.load_mkl().version()
            except CctError:  # pragma: no cover
                return "?"
        from threadpoolctl import threadpool_info

        for info in threadpool_info():
            if info.get("internal_api") == "openblas" and "numpy" in (info.get("filepath") or ""):
                return str(info.get("architecture"))
        return "?"

    def info(self) -> dict:
        return {"name": self.name, "kind": "cpu", "blas": self.blas, "kernel": self.kernel(),
                "threads": self.threads, "memory_bytes": _host_memory()}


class GpuDevice(Device):
    """A CUDA GPU through CuPy (cuBLAS GEMMs); its worker thread makes the GPU current."""

    kind = "gpu"

    def __init__(self, index: int = 0):
        if not cupy_available():
            try:
                import cupy  # type: ignore # noqa: F401
                why = "CuPy imports but sees no GPU"
            except Exception:
                why = "CuPy is not installed (pip install cct[gpu])"
            raise CctError(f"GPU device gpu:{index} requested but {why}")
        n = gpu_count()
        if index < 0 or index >= n:
            raise CctError(f"GPU device gpu:{index} does not exist ({n} GPU(s) visible)")
        super().__init__(index, threads=1, memory=CupyDevice(index))
        self.blas = "cublas"

    def _init_thread(self) -> None:
        self.make_current()

    def make_current(self) -> None:
        """Make this GPU CuPy's current device in the calling thread."""
        self.memory.use()

    def set_tf32(self, on: bool) -> None:
        """float32 GEMMs on this GPU in TF32 tensor-core math (on) or FP32 (off); logged when it changes."""
        if device_blas.available() and device_blas.handle(self.index).tf32 != bool(on):
            device_blas.set_tf32(self.index, on)
            log.info("GPU %d: float32 GEMMs (convolutions, inner products) use %s", self.index,
                     "TF32 tensor cores (--tf32)" if on else "FP32")

    def signature(self) -> str:
        return f"gpu:{self.index}"

    def properties(self) -> dict:
        """CUDA device properties (name, memory, SMs, clock, compute capability)."""
        rt = self.xp.cuda.runtime
        p = rt.getDeviceProperties(self.index)
        name = p.get("name", b"")
        return {"gpu_name": name.decode() if isinstance(name, bytes) else str(name),
                "memory_bytes": int(p.get("totalGlobalMem", 0)), "sm_count": int(p.get("multiProcessorCount", 0)),
                "clock_khz": int(p.get("clockRate", 0)), "cc": (int(p.get("major", 0)), int(p.get("minor", 0)))}

    def info(self) -> dict:
        d = {"name": self.name, "kind": "gpu", "blas": "cublas", "kernel": "cuBLAS", "threads": 1}
        props = self.properties()
        d.update(gpu_name=props["gpu_name"], memory_bytes=props["memory_bytes"])
        return d


def peak_gflops(device: Device) -> float | None:
    """Theoretical FP32 peak of the device (None when unknown).

    CPU: threads x FP32 FLOPs/cycle (64 with AVX-512, 32 with AVX2+FMA, 16 with AVX, 8 otherwise;
    two FMA ports assumed) x the nominal clock from the CPU model name (else the current MHz).
    GPU: 2 x FP32 lanes per SM x SMs x clock.
    """
    if isinstance(device, GpuDevice):
        p = device.properties()
        cores = _CP_CORES_PER_SM.get(p["cc"])
        if cores is None or not p["clock_khz"]:
            return None
        return 2.0 * cores * p["sm_count"] * p["clock_khz"] * 1e3 / 1e9
    flags, ghz = _cpu_flags_and_ghz()
    if ghz is None:
        return None
    if "avx512f" in flags:
        per_cycle = 64
    elif "avx2" in flags and "fma" in flags:
        per_cycle = 32
    elif "avx" in flags:
        per_cycle = 16
    else:
        per_cycle = 8
    return float(device.threads * per_cycle * ghz)


def _cpu_flags_and_ghz() -> tuple[set[str], float | None]:
    flags: set[str] = set()
    ghz = None
    mhz = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
                elif line.startswith("model name") and ghz is None and "GHz" in line:
                    tail = line.rsplit("@", 1)[-1].strip().replace("GHz", "")
                    try:
                        ghz = float(tail)
                    except ValueError:
                        pass
                elif line.startswith("cpu MHz") and mhz is None:
                    try:
                        mhz = float(line.split(":", 1)[1])
                    except ValueError:
                        pass
    except OSError:  # pragma: no cover
        pass
    if ghz is None and mhz:
        ghz = mhz / 1000.0
    return flags, ghz


def _host_memory() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return None


class ThreadBudget:
    """The process-wide OpenBLAS thread count set for a group of devices (undo with :meth:`restore`)."""

    def __init__(self, limiter: Any, threads: int | None):
        self._limiter = limiter
        self.openblas_threads = threads

    def restore(self) -> None:
        if self._limiter is not None:
            self._limiter.restore_original_limits()
            self._limiter = None


def configure_thread_budgets(devices: list[Device]) -> ThreadBudget:
    """Apply the devices' BLAS thread budgets that are process-wide (OpenBLAS).

    All OpenBLAS CPU devices must share one budget (OpenBLAS has a single global thread count);
    MKL devices set theirs per worker thread. Warns when the budgets exceed the cores.
    """
    ob = sorted({d.threads for d in devices if isinstance(d, CpuDevice) and d.blas == "openblas"})
    if len(ob) > 1:
        raise CctError(f"OpenBLAS CPU devices must all have the same thread count (got {ob}): numpy's OpenBLAS has "
                       "one process-wide thread count; use MKL for a device with a different budget")
    total = sum(d.threads for d in devices if isinstance(d, CpuDevice))
    if total > cpu_cores():
        log.warning("CPU devices use %d BLAS threads in all on %d core(s): they will compete for cores",
                    total, cpu_cores())
    if not ob:
        return ThreadBudget(None, None)
    from threadpoolctl import threadpool_limits

    limiter = threadpool_limits(limits=ob[0], user_api="blas")
    return ThreadBudget(limiter, ob[0])
