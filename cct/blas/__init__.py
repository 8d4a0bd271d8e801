"""Selectable BLAS backend for cct's GEMMs (convolution lowerings, InnerProduct, the probes).

Two backends compute float32 (and float64) matrix products on the CPU:

* ``"openblas"``: numpy's bundled OpenBLAS, through ``np.matmul(..., out=)`` (and its own
  ``cblas_?gemm`` for accumulating products);
* ``"mkl"``: Intel MKL's single dynamic library ``libmkl_rt`` (the PyPI ``mkl`` package),
  called through ctypes (``cblas_sgemm`` / ``cblas_dgemm``).

cupy arrays are multiplied with ``cupy.matmul`` whatever the backend. The choice is part of the
run configuration (:class:`cct.config.BlasConfig`; ``set_backend`` changes the process default,
``CCT_BLAS`` the fallback). One module per job:

* :mod:`.choice` which backend a GEMM uses (``get_backend``, ``set_backend``, ``auto``'s measurement);
* :mod:`.multiply` the GEMM on the selected backend (``gemm``, ``matmul``, ``sgemm``);
* :mod:`.product` the GEMM on a named backend (``gemm_on``; MKL's and OpenBLAS's ``cblas_?gemm``);
* :mod:`.timing` the one GEMM timer (``gemm_gflops``, ``best_time``) every measurement uses;
* :mod:`.threads` thread limits (``blas_threads``, ``get_num_threads``, ``set_num_threads``);
* :mod:`.spin` idle-worker spinning of OpenBLAS (``limit_openblas_spin``) and OpenMP (``set_openmp_spin_defaults``);
* :mod:`.mkl`, :mod:`.openblas` the library bindings; :mod:`.cache` the cache dir and machine key;
  :mod:`.info` what runs (``blas_info``, ``describe``).
"""
from .cache import cache_dir, cpu_model, machine_key, read_cache, write_cache
from .choice import BACKENDS, calibrate, choose_backend, get_backend, set_backend, set_thread_backend
from .info import blas_info, describe
from .mkl import BlasUnavailable, load_mkl, mkl_available
from .multiply import gemm, matmul, sgemm
from .spin import DEFAULT_THREAD_TIMEOUT, limit_openblas_spin
from .threads import blas_threads, get_num_threads, set_num_threads, supports_thread_local_limits
from .timing import OperandPool, best_time, gemm_gflops

_cpu_model = cpu_model  # the name earlier code (cct.cli, benchmarks/common.py) calls

__all__ = [
    "cache_dir", "cpu_model", "machine_key", "read_cache", "write_cache", "BACKENDS", "calibrate",
    "choose_backend", "get_backend", "set_backend", "set_thread_backend", "blas_info", "describe",
    "BlasUnavailable", "load_mkl", "mkl_available", "gemm", "matmul", "sgemm", "DEFAULT_THREAD_TIMEOUT",
    "limit_openblas_spin", "blas_threads", "get_num_threads", "set_num_threads", "supports_thread_local_limits",
    "OperandPool", "best_time", "gemm_gflops",
]
