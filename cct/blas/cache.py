"""The per-user cache directory and the machine identity its measurements are keyed by.

Every one-time measurement of cct (BLAS backend choice, device FLOPS probe, cost-model
calibration, partition choices) is a small JSON file in :func:`cache_dir`, named with
:func:`machine_key` so that a different host, CPU, numpy build or OpenBLAS environment re-measures.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

import numpy as np

from .. import env


def cache_dir() -> Path:
    """The per-user cache dir: $CCT_CACHE_DIR, else $XDG_CACHE_HOME/cct, else ~/.cache/cct."""
    if env.is_set("CCT_CACHE_DIR"):
        return Path(env.text("CCT_CACHE_DIR"))
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "cct"
    return Path.home() / ".cache" / "cct"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` knows."""
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
        cpu_model(),
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
    try:
        with open(cache_dir() / name) as f:
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
