"""GEMM on a named backend: ``out = alpha * op(a) @ op(b) + beta * out``.

numpy float32/float64 operands go to the backend named by the caller (MKL through its ``cblas_?gemm``;
OpenBLAS through numpy's ``matmul``, or its own ``cblas_?gemm`` when the result accumulates,
``beta != 0``); other dtypes and cupy arrays use ``xp.matmul`` (cuBLAS). Which backend is selected is
:mod:`.choice`'s job; :mod:`.multiply` multiplies on the selected one.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..device import cublas as device_blas
from ..device.driver import array_module, device_of
from ..errors import CctError
from .mkl import load_mkl
from .openblas import load_openblas

# CBLAS enums.
_ROW_MAJOR = 101
_NO_TRANS = 111
_TRANS = 112

ACC_BLOCK_BYTES = 512 << 10  # row-block size of accumulating (beta = 1) GEMMs into big outputs
#: GEMMs of at most this many multiply-adds (M*N*K) run on the calling thread alone (MKL): ~25-50 us of
#: work, where waking and joining a thread team costs as much as it saves on a quiet machine and many
#: times more on a busy one (LeNet's ip2, 64x500x10: 0.02 ms single-threaded, 2-15 ms as a 2-thread
#: team on a loaded 2-core box). OpenBLAS has the same rule built in (at 2^18).
SMALL_GEMM_MACS = 1 << 20
#: below this many multiply-adds the MKL backend hands the product to numpy's OpenBLAS, which runs
#: it on the calling thread (its own threshold) at a fraction of MKL's per-call cost through ctypes
#: (64x500x10: 0.015 vs 0.1 ms)
TINY_GEMM_MACS = 1 << 19


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
    # anything else (a strided or zero-size view, whose strides may be 0): a C-ordered copy, taken as
    # row-major without a second look (numpy gives empty arrays zero strides: no recursion on them)
    return np.ascontiguousarray(x), trans, max(cols, 1)


def _address(x: np.ndarray) -> int:
    """The data pointer (``x.ctypes.data`` builds a ctypes helper object: ~5x slower)."""
    return x.__array_interface__["data"][0]


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
               _address(A), lda, _address(B), ldb, beta, _address(target), ldc)
    if target is not out:
        out[...] = target
    return out


def mkl_gemm(a, b, out, trans_a, trans_b, alpha, beta) -> np.ndarray:
    """``out = alpha * op(a) @ op(b) + beta * out`` on MKL (float32/float64 host arrays; the tiniest products
    through numpy): the GEMM :func:`gemm_on` runs for the ``mkl`` backend."""
    lib = load_mkl()
    fn = lib.sgemm if a.dtype == np.float32 else lib.dgemm
    k = a.shape[0] if trans_a else a.shape[1]
    if out.size * k <= TINY_GEMM_MACS:
        if beta == 0:
            np.matmul(a.T if trans_a else a, b.T if trans_b else b, out=out)
            if alpha != 1:
                out *= alpha
            return out
        ob = load_openblas()
        if ob is not None:
            return _cblas_gemm(ob.sgemm if a.dtype == np.float32 else ob.dgemm, a, b, out, trans_a, trans_b,
                               alpha, beta)
    if lib.set_local is None or out.size * k > SMALL_GEMM_MACS:
        return _cblas_gemm(fn, a, b, out, trans_a, trans_b, alpha, beta)
    prev = lib.set_local(1)  # per calling thread; 0 (no local limit) restores the global setting
    try:
        return _cblas_gemm(fn, a, b, out, trans_a, trans_b, alpha, beta)
    finally:
        lib.set_local(prev)


def gemm_on(backend: str | None, a: Any, b: Any, out: Any = None, trans_a: bool = False, trans_b: bool = False,
            alpha: float = 1.0, beta: float = 0.0) -> Any:
    """``out = alpha * op(a) @ op(b) + beta * out`` for 2-D float32/float64 arrays on ``backend``.

    numpy float32/float64 go to the CPU backend ``backend`` (``"mkl"``; ``"openblas"`` or None: numpy's
    OpenBLAS); other dtypes and cupy arrays use ``xp.matmul``. ``out`` (if given) must have the result's
    shape and dtype; it is returned. CuPy arrays go to cuBLAS directly (:mod:`cct.device.cublas`: capturable
    in a CUDA graph, ``beta`` inside the GEMM).
    """
    if device_blas.supports(a, b):
        return device_blas.gemm(a, b, out, trans_a, trans_b, alpha, beta)
    xp = array_module(a, b)
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
    on_host = not device_of(out).is_gpu  # (a, b and out live together: xp is their module)
    use_mkl = False
    if on_host and a.dtype == b.dtype == out.dtype and a.dtype in (np.float32, np.float64):
        use_mkl = backend == "mkl"
    if use_mkl:
        return mkl_gemm(a, b, out, trans_a, trans_b, float(alpha), float(beta))
    if beta != 0 and on_host and a.dtype == b.dtype == out.dtype and a.dtype in (np.float32, np.float64):
        ob = load_openblas()  # accumulate inside the GEMM: no temporary, no extra sweep over out
        if ob is not None:
            fn = ob.sgemm if a.dtype == np.float32 else ob.dgemm
            return _cblas_gemm(fn, a, b, out, trans_a, trans_b, float(alpha), float(beta))
    if beta == 0:
        xp.matmul(opa, opb, out=out)
        if alpha != 1:
            out *= alpha
    elif on_host and beta == 1 and out.nbytes > ACC_BLOCK_BYTES and shape[1] > 0:
        # out += alpha * op(a) @ op(b) in row blocks whose product stays in cache: a big accumulated
        # result (an InnerProduct's weight gradient) then makes 2 trips through DRAM instead of 4.
        rows = max(1, ACC_BLOCK_BYTES // (shape[1] * out.itemsize))
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
