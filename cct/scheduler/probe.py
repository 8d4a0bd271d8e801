"""FLOPS probe: the measured SGEMM rate of each device on convolution-shaped products.

The rate is measured on the device's own worker thread (so with its BLAS backend and thread
budget), for a fixed wall time (``duration`` seconds, default 0.25), cycling through GEMMs shaped
like CaffeNet's lowered convolutions at a small batch. Devices that will work together are
measured *concurrently* (started on a barrier), so the rates include the contention between
them (shared memory bandwidth, turbo) that the split will see. Results are cached as JSON in
:func:`cct.blas.cache_dir` (``$CCT_CACHE_DIR`` or ``~/.cache/cct``), keyed by the machine
(:func:`cct.blas.machine_key`) and the device signatures; ``force=True`` re-measures.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from .. import blas
from .devices import CpuDevice, Device

# (M, N, K) = (output channels, batch * output pixels, C * k * k): conv1/conv2/conv5-like.
PROBE_SHAPES: tuple[tuple[int, int, int], ...] = ((96, 3025, 363), (128, 729 * 2, 1200), (128, 169 * 4, 1728))
_CACHE_VERSION = 1


def _cache_name() -> str:
    return f"devices-{blas.machine_key()}.json"


def _measure(device: Device, shapes: Sequence[tuple[int, int, int]], duration: float,
             barrier: threading.Barrier | None) -> float:
    """Runs in the device's worker: GFLOPS over ``duration`` seconds of GEMMs (the one GEMM timer)."""
    return blas.gemm_gflops(shapes, duration=duration, backend=device.blas if isinstance(device, CpuDevice) else None,
                            asarray=device.memory.upload, synchronize=device.memory.synchronize, barrier=barrier)


def measure_gflops(devices: Sequence[Device], duration: float = 0.25, concurrent: bool = True,
                   shapes: Sequence[tuple[int, int, int]] = PROBE_SHAPES) -> list[float]:
    """Measure (no cache) each device's SGEMM GFLOPS; all at once when ``concurrent``."""
    devices = list(devices)
    if concurrent and len(devices) > 1:
        barrier = threading.Barrier(len(devices))
        futs = [d.submit(_measure, d, shapes, duration, barrier) for d in devices]
        return [f.result() for f in futs]
    return [d.run(_measure, d, shapes, duration, None) for d in devices]


def probe(devices: Sequence[Device], force: bool = False, duration: float = 0.25,
          concurrent: bool = True) -> list[float]:
    """Measured GFLOPS of each device (cached; see module docstring)."""
    devices = list(devices)
    key = ("concurrent|" if concurrent and len(devices) > 1 else "alone|") + "|".join(d.signature() for d in devices)
    name = _cache_name()
    cache = blas.read_cache(name) or {}
    if cache.get("version") != _CACHE_VERSION:
        cache = {"version": _CACHE_VERSION, "entries": {}}
    entry = cache["entries"].get(key)
    if entry is not None and not force and len(entry.get("gflops", [])) == len(devices):
        return [float(g) for g in entry["gflops"]]
    gflops = measure_gflops(devices, duration=duration, concurrent=concurrent)
    cache["entries"][key] = {"gflops": gflops, "measured_at": time.time(), "duration_s": duration,
                             "shapes": [list(s) for s in PROBE_SHAPES]}
    try:
        blas.write_cache(name, cache)
    except OSError:  # read-only cache dir: keep the in-process result
        pass
    return gflops
