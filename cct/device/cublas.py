"""GEMMs on a GPU through cuBLAS itself (ctypes on the libcublas CuPy loaded), so they can run inside a CUDA
graph capture -- CuPy's own cuBLAS wrappers refuse to run while a stream captures.

``matmul(a, b, out)`` is ``numpy.matmul`` semantics for CuPy float32/float64/complex64/complex128 arrays (2-D
or stacked, batch dimensions broadcast), ``gemm(a, b, out, trans_a, trans_b, alpha, beta)`` the 2-D BLAS
form. Both issue their work on CuPy's current stream through one handle per device (:class:`CublasHandle`,
with its own workspace so that capture needs no allocation by cuBLAS) and return ``out``. Operands may be
row-major or transposed views (any leading dimension); other layouts are copied to contiguous first. A row-major
product ``C = A @ B`` is issued as the column-major ``C^T = B^T @ A^T``, so no transpose is ever materialised.

:func:`available` says whether the library could be bound (then the GPU path routes every GEMM here);
:func:`set_tf32` switches a device's handle between FP32 (default, Caffe's semantics) and TF32 tensor-core math.
"""
from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

import numpy as np

from ..errors import CctError
from .driver import device_of

_OP_N, _OP_T = 0, 1
_DEFAULT_MATH, _TF32_MATH = 0, 3
_WORKSPACE_BYTES = 32 << 20  # cuBLAS recommends >= 32 MiB on Hopper for its fastest kernels


class _Complex64(ctypes.Structure):
    _fields_ = [("x", ctypes.c_float), ("y", ctypes.c_float)]


class _Complex128(ctypes.Structure):
    _fields_ = [("x", ctypes.c_double), ("y", ctypes.c_double)]


# dtype char -> (routine prefix, ctypes scalar maker)
_SCALARS = {
    "f": ("S", lambda v: ctypes.c_float(float(np.real(v)))),
    "d": ("D", lambda v: ctypes.c_double(float(np.real(v)))),
    "F": ("C", lambda v: _Complex64(float(np.real(v)), float(np.imag(v)))),
    "D": ("Z", lambda v: _Complex128(float(np.real(v)), float(np.imag(v)))),
}


def _loaded_cublas_path() -> str | None:
    """The libcublas this process already mapped (CuPy's), from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                name = os.path.basename(path)
                if name.startswith("libcublas.so"):
                    return path
    except OSError:
        return None
    return None


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The cuBLAS library (the one CuPy uses), or None when it cannot be found. Cached per process: a shared
    library is loaded once per process whoever asks."""
    try:
        import cupy
        from cupy_backends.cuda.libs import cublas as _cupy_cublas  # noqa: F401  (makes CuPy map libcublas)

        cupy.cuda.device.get_cublas_handle()
    except Exception:
        return None
    candidates = [_loaded_cublas_path(), "libcublas.so", "libcublas.so.13", "libcublas.so.12"]
    for path in candidates:
        if not path:
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        _declare(lib)
        return lib
    return None


def _declare(lib: ctypes.CDLL) -> None:
    vp, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    lib.cublasCreate_v2.argtypes = [ctypes.POINTER(vp)]
    lib.cublasSetStream_v2.argtypes = [vp, vp]
    lib.cublasSetWorkspace_v2.argtypes = [vp, vp, ctypes.c_size_t]
    lib.cublasSetMathMode.argtypes = [vp, i]
    for p in "SDCZ":
        fn = getattr(lib, f"cublas{p}gemmStridedBatched")
        fn.argtypes = [vp, i, i, i, i, i, vp, vp, i, ll, vp, i, ll, vp, vp, i, ll, i]
        fn2 = getattr(lib, f"cublas{p}gemm_v2")
        fn2.argtypes = [vp, i, i, i, i, i, vp, vp, i, vp, i, vp, vp, i]
    for name in ("cublasCreate_v2", "cublasSetStream_v2", "cublasSetWorkspace_v2", "cublasSetMathMode",
                 "cublasSgemmStridedBatched", "cublasDgemmStridedBatched", "cublasCgemmStridedBatched",
                 "cublasZgemmStridedBatched", "cublasSgemm_v2", "cublasDgemm_v2", "cublasCgemm_v2", "cublasZgemm_v2"):
        getattr(lib, name).restype = ctypes.c_int


def available() -> bool:
    """True when cuBLAS could be bound (CuPy imports, a GPU is visible, libcublas found)."""
    return _library() is not None


def supports(a: Any, b: Any) -> bool:
    """True when ``a`` and ``b`` are CuPy arrays this module multiplies (one float/complex dtype, >= 2-D) and
    cuBLAS is bound: the GPU path then routes the product here."""
    return (device_of(a).is_gpu and device_of(b).is_gpu and a.dtype == b.dtype and a.dtype.char in _SCALARS
            and a.ndim >= 2 and b.ndim >= 2 and available())


class CublasHandle:
    """One cuBLAS handle of one device with its own workspace; remembers the stream it was last set to."""

    def __init__(self, device_id: int):
        import cupy

        lib = _library()
        if lib is None:
            raise CctError("cuBLAS is not available (CuPy, a GPU and libcublas are needed)")
        self.lib = lib
        self.device_id = device_id
        with cupy.cuda.Device(device_id):
            h = ctypes.c_void_p()
            _check(lib.cublasCreate_v2(ctypes.byref(h)), "cublasCreate")
            self.handle = h
            self.workspace = cupy.empty(_WORKSPACE_BYTES, dtype=np.uint8)
            _check(lib.cublasSetWorkspace_v2(h, ctypes.c_void_p(self.workspace.data.ptr), _WORKSPACE_BYTES),
                   "cublasSetWorkspace")
        self.stream_ptr: int | None = None
        self.tf32 = False

    def bind(self, stream_ptr: int) -> ctypes.c_void_p:
        """The handle, set to issue on ``stream_ptr``."""
        if stream_ptr != self.stream_ptr:
            _check(self.lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(stream_ptr)), "cublasSetStream")
            self.stream_ptr = stream_ptr
        return self.handle

    def set_tf32(self, on: bool) -> None:
        """TF32 tensor-core math for float32 GEMMs (on) or strict FP32 (off, the default)."""
        _check(self.lib.cublasSetMathMode(self.handle, _TF32_MATH if on else _DEFAULT_MATH), "cublasSetMathMode")
        self.tf32 = bool(on)


@functools.cache
def handle(device_id: int) -> CublasHandle:
    """The process's handle for GPU ``device_id`` (created on first use; a device resource, like CuPy's own)."""
    return CublasHandle(device_id)


def set_tf32(device_id: int, on: bool) -> None:
    """Switch GPU ``device_id``'s float32 GEMMs to TF32 (on) or FP32 (off)."""
    handle(device_id).set_tf32(on)


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CctError(f"{what} failed with cuBLAS status {status}")


def _operand(x: Any) -> tuple[int, int] | None:
    """(op flag, leading dimension) under which cuBLAS reads the 2-D view ``x`` as the column-major ``x^T``,
    or None when ``x``'s layout is neither row- nor column-major."""
    rows, cols = x.shape[-2], x.shape[-1]
    item = x.itemsize
    s0, s1 = x.strides[-2] // item, x.strides[-1] // item
    if x.strides[-2] % item or x.strides[-1] % item:
        return None
    if s1 == 1 or cols == 1:
        ld = s0 if rows > 1 else cols
        if ld >= max(cols, 1):
            return _OP_N, ld
    if s0 == 1 or rows == 1:
        ld = s1 if cols > 1 else rows
        if ld >= max(rows, 1):
            return _OP_T, ld
    return None


def _batch_plan(shape: tuple[int, ...], strides: list[tuple[int, ...]]) -> tuple[tuple[int, ...], list[tuple[int, ...]],
                                                                                  int, list[int]] | None:
    """Collapse the batch dimensions: returns (outer shape, outer strides per operand, inner count, inner stride
    per operand) where the inner dimension is the longest run of batch dimensions every operand can walk with
    one stride (in elements)."""
    if not shape:
        return (), [() for _ in strides], 1, [0 for _ in strides]
    # merge from the innermost batch dimension outwards while every operand stays one-stride
    inner = shape[-1]
    inner_strides = [s[-1] for s in strides]
    k = len(shape) - 1
    while k > 0:
        d = shape[k - 1]
        if d == 1:
            k -= 1
            continue
        if all(s[k - 1] == inner * st or (inner == 1) for s, st in zip(strides, inner_strides)):
            if inner == 1:
                inner_strides = [s[k - 1] for s in strides]
            inner *= d
            k -= 1
        else:
            break
    outer = shape[:k]
    return outer, [s[:k] for s in strides], inner, inner_strides


def _batch_strides(x: Any, batch: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of ``x``'s batch dimensions broadcast to ``batch`` (0 where broadcast)."""
    nb = x.ndim - 2
    out = []
    for j in range(len(batch)):
        xi = j - (len(batch) - nb)
        if xi < 0 or x.shape[xi] == 1:
            out.append(0)
        else:
            out.append(x.strides[xi] // x.itemsize)
    return tuple(out)


def matmul(a: Any, b: Any, out: Any = None, alpha: float = 1.0, beta: float = 0.0) -> Any:
    """``out = alpha * a @ b + beta * out`` with numpy.matmul's broadcasting, on CuPy arrays of one float or
    complex dtype (``a``, ``b`` at least 2-D). Allocates ``out`` when not given."""
    import cupy

    if a.ndim < 2 or b.ndim < 2:
        raise CctError(f"matmul: operands must be at least 2-D (got {a.ndim}-D and {b.ndim}-D)")
    if a.dtype != b.dtype or a.dtype.char not in _SCALARS:
        raise CctError(f"matmul: unsupported dtypes {a.dtype} and {b.dtype}")
    m, k = a.shape[-2:]
    k2, n = b.shape[-2:]
    if k != k2:
        raise CctError(f"matmul: shapes {a.shape} and {b.shape} do not align")
    batch = tuple(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    shape = batch + (m, n)
    if out is None:
        out = cupy.empty(shape, dtype=a.dtype)
        beta = 0.0
    elif tuple(out.shape) != shape or out.dtype != a.dtype:
        raise CctError(f"matmul: out has shape {tuple(out.shape)} {out.dtype}, expected {shape} {a.dtype}")
    if out.size == 0:
        return out
    if k == 0:
        if beta == 0:
            out.fill(0)
        else:
            out *= beta
        return out
    if _operand(a) is None:
        a = cupy.ascontiguousarray(a)
    if _operand(b) is None:
        b = cupy.ascontiguousarray(b)
    target = out
    if not (out.strides[-1] == out.itemsize and _operand(out) is not None and _operand(out)[0] == _OP_N):
        target = cupy.ascontiguousarray(out) if beta != 0 else cupy.empty(shape, dtype=out.dtype)
    plan = _batch_plan(batch, [_batch_strides(a, batch), _batch_strides(b, batch), _batch_strides(target, batch)])
    outer, outer_strides, count, inner_strides = plan
    h = handle(cupy.cuda.Device().id)
    hd = h.bind(cupy.cuda.get_current_stream().ptr)
    prefix, scalar = _SCALARS[a.dtype.char]
    fn = getattr(h.lib, f"cublas{prefix}gemmStridedBatched")
    al, be = scalar(alpha), scalar(beta)
    op_a, lda = _operand(a)
    op_b, ldb = _operand(b)
    ldc = _operand(target)[1]
    item = a.itemsize
    sa, sb, sc = inner_strides
    for idx in np.ndindex(*outer) if outer else [()]:
        offa = sum(i * s for i, s in zip(idx, outer_strides[0]))
        offb = sum(i * s for i, s in zip(idx, outer_strides[1]))
        offc = sum(i * s for i, s in zip(idx, outer_strides[2]))
        # column-major C^T (n x m) = B^T (n x k) @ A^T (k x m)
        _check(fn(hd, op_b, op_a, n, m, k, ctypes.byref(al), ctypes.c_void_p(b.data.ptr + offb * item), ldb, sb,
                  ctypes.c_void_p(a.data.ptr + offa * item), lda, sa, ctypes.byref(be),
                  ctypes.c_void_p(target.data.ptr + offc * item), ldc, sc, count), f"cublas{prefix}gemmStridedBatched")
    if target is not out:
        out[...] = target
    return out


def gemm(a: Any, b: Any, out: Any = None, trans_a: bool = False, trans_b: bool = False,
         alpha: float = 1.0, beta: float = 0.0) -> Any:
    """``out = alpha * op(a) @ op(b) + beta * out`` for 2-D CuPy arrays (BLAS's GEMM)."""
    return matmul(a.T if trans_a else a, b.T if trans_b else b, out=out, alpha=alpha, beta=beta)
