"""numpy's bundled OpenBLAS: its threadpoolctl controllers, a ctypes handle, its ``cblas_?gemm``.

numpy's ``matmul`` has no ``beta``; accumulating GEMMs call the library's own ``cblas_sgemm``
through the handle, and the spin control (:mod:`cct.blas.spin`) calls its thread-pool entry
points. Everything is looked up once per process.
"""
from __future__ import annotations

import ctypes
import threading

_lock = threading.Lock()
_ob_ctls: list | None = None
_ob_cdll: ctypes.CDLL | None | bool = None
_openblas: CblasOpenBLAS | None | bool = None


def openblas_controllers() -> list:
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


def numpy_openblas_cdll() -> ctypes.CDLL | None:
    """numpy's OpenBLAS library as a ctypes handle (loaded once), or None when it cannot be found."""
    global _ob_cdll
    if _ob_cdll is None:
        ctls = openblas_controllers()
        with _lock:
            if _ob_cdll is None:
                path = getattr(ctls[0], "filepath", None) if ctls else None
                try:
                    _ob_cdll = ctypes.CDLL(path) if path else False
                except (OSError, TypeError):
                    _ob_cdll = False
    return _ob_cdll or None


class CblasOpenBLAS:
    """ctypes binding of numpy's bundled OpenBLAS ``cblas_?gemm``."""

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


def load_openblas() -> CblasOpenBLAS | None:
    """numpy's OpenBLAS ``cblas_?gemm`` binding, or None when it cannot be found (then numpy's matmul
    is used)."""
    global _openblas
    if _openblas is None:
        lib = numpy_openblas_cdll()
        with _lock:
            if _openblas is None:
                try:
                    _openblas = CblasOpenBLAS(lib) if lib is not None else False
                except (AttributeError, TypeError):
                    _openblas = False
    return _openblas or None
