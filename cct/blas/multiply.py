"""GEMM on the selected backend (:func:`cct.blas.get_backend`): ``gemm``, ``matmul``, ``sgemm``.

The products themselves are :mod:`.product`'s; this module resolves which backend a call runs on.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..device import cublas as device_blas
from ..device.driver import array_module, device_of
from ..errors import CctError
from .choice import get_backend
from .product import gemm_on


def _cpu_float(a: Any, b: Any) -> bool:
    """numpy float32/float64 operands of one dtype (what the CPU backends multiply)."""
    return (not device_of(a).is_gpu and not device_of(b).is_gpu and a.dtype == b.dtype
            and a.dtype in (np.float32, np.float64))


def gemm(a: Any, b: Any, out: Any = None, trans_a: bool = False, trans_b: bool = False,
         alpha: float = 1.0, beta: float = 0.0, backend: str | None = None) -> Any:
    """``out = alpha * op(a) @ op(b) + beta * out`` for 2-D float32/float64 arrays.

    numpy float32/float64 go to the selected CPU backend (``backend`` overrides it for this
    call); other dtypes and cupy arrays use ``xp.matmul``. ``out`` (if given) must have the
    result's shape and dtype; it is returned.
    """
    if backend is None and _cpu_float(a, b):
        backend = get_backend()
    return gemm_on(backend, a, b, out, trans_a, trans_b, alpha, beta)


def matmul(a: Any, b: Any, out: Any = None) -> Any:
    """``xp.matmul`` (stacked, broadcasting operands) on the selected backend.

    With MKL selected, numpy float operands are multiplied slice by slice through cblas_sgemm;
    otherwise this is ``xp.matmul`` (numpy's OpenBLAS); CuPy arrays go to cuBLAS directly
    (:mod:`cct.device.cublas`, capturable in a CUDA graph).
    """
    if device_blas.supports(a, b):
        return device_blas.matmul(a, b, out=out)
    if not (_cpu_float(a, b) and a.ndim >= 2 and b.ndim >= 2 and get_backend() == "mkl"):
        return array_module(a, b).matmul(a, b, out=out)
    if a.ndim == 2 and b.ndim == 2:
        return gemm_on("mkl", a, b, out)
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    shape = batch + (a.shape[-2], b.shape[-1])
    if out is None:
        out = np.empty(shape, dtype=a.dtype)
    elif tuple(out.shape) != shape:
        raise CctError(f"matmul: out has shape {tuple(out.shape)}, expected {shape}")
    ab = np.broadcast_to(a, batch + a.shape[-2:])
    bb = np.broadcast_to(b, batch + b.shape[-2:])
    for idx in np.ndindex(*batch):
        gemm_on("mkl", ab[idx], bb[idx], out[idx])
    return out


def sgemm(a: Any, b: Any, out: Any = None, trans_a: bool = False, trans_b: bool = False,
          alpha: float = 1.0, beta: float = 0.0) -> Any:
    """Single-precision GEMM on the selected backend (same contract as :func:`gemm`)."""
    return gemm(a, b, out=out, trans_a=trans_a, trans_b=trans_b, alpha=alpha, beta=beta)
