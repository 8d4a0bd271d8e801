"""Intel MKL's single dynamic library ``libmkl_rt`` (the PyPI ``mkl`` package) through ctypes.

Loaded once per process on first use; :func:`load_mkl` raises :class:`BlasUnavailable` (a
:class:`cct.CctError`) with an install hint when it is missing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
import threading

from ..errors import CctError

_lock = threading.Lock()
_mkl: MKL | None = None
_mkl_error: str | None = None


class BlasUnavailable(CctError):
    """The requested BLAS library cannot be loaded."""


def find_mkl_rt() -> str | None:
    """Path of ``libmkl_rt`` under the Python prefixes or on the library path (None: not found)."""
    cands: list[str] = []
    for prefix in {sys.prefix, sys.base_prefix, os.environ.get("CONDA_PREFIX", "")}:
        if prefix:
            cands += sorted(glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so*")))
            cands += sorted(glob.glob(os.path.join(prefix, "Library", "bin", "mkl_rt*.dll")))
    found = ctypes.util.find_library("mkl_rt")
    if found:
        cands.append(found)
    return cands[0] if cands else None


class MKL:
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
        """MKL's version string."""
        buf = ctypes.create_string_buffer(256)
        try:
            self.lib.mkl_get_version_string(buf, 256)
        except AttributeError:  # pragma: no cover
            return "unknown"
        return buf.value.decode(errors="replace").strip()

    def max_threads(self) -> int:
        """The thread count MKL would use now in the calling thread."""
        return int(self.get_max()) if self.get_max is not None else 1


def load_mkl() -> MKL:
    """The loaded MKL binding (loaded on first call); :class:`BlasUnavailable` when it cannot be."""
    global _mkl, _mkl_error
    with _lock:
        if _mkl is not None:
            return _mkl
        if _mkl_error is not None:
            raise BlasUnavailable(_mkl_error)
        path = find_mkl_rt()
        if path is None:
            _mkl_error = ("MKL backend requested but libmkl_rt was not found under sys.prefix/lib or on the "
                          "library path; install it with `pip install mkl` or use CCT_BLAS=openblas")
            raise BlasUnavailable(_mkl_error)
        try:
            _mkl = MKL(path)
        except (OSError, AttributeError) as e:
            _mkl_error = f"MKL backend: could not load {path}: {e}"
            raise BlasUnavailable(_mkl_error) from e
        return _mkl


def mkl_available() -> bool:
    """True when libmkl_rt can be loaded."""
    try:
        load_mkl()
        return True
    except BlasUnavailable:
        return False
