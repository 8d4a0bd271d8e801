"""What GEMMs run on, for logs and benchmarks: backend, library file, kernel, threads, environment."""
from __future__ import annotations

import os
from typing import Any

from .choice import get_backend
from .mkl import load_mkl


def blas_info() -> dict:
    """What GEMMs run on: backend, library file, kernel (e.g. SkylakeX/Haswell), threads.

    Also reports the OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE environment overrides, which change
    OpenBLAS's kernel choice.
    """
    from threadpoolctl import threadpool_info

    name = get_backend()
    mkl = load_mkl() if name == "mkl" else None  # loaded before threadpoolctl looks, so that it sees it
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
    if mkl is not None:
        out["mkl_version"] = mkl.version()
        out["mkl_path"] = mkl.path
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
