"""BLAS thread counts: a scoped limit (:func:`blas_threads`), the process-wide setting, the current count.

For OpenBLAS (the pthreads build shipped with numpy) every limit is *process-wide* (its
``openblas_set_num_threads_local`` is global in that build too), so concurrent callers must agree
on one count. MKL's ``mkl_set_num_threads_local`` is genuinely per calling thread;
:func:`supports_thread_local_limits` says which applies.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .choice import get_backend
from .mkl import load_mkl
from .openblas import openblas_controllers


def supports_thread_local_limits(backend: str | None = None) -> bool:
    """True when :func:`blas_threads` only affects the calling thread (MKL); False for
    OpenBLAS, whose limits are process-wide."""
    name = backend or get_backend()
    if name == "mkl":
        return load_mkl().set_local is not None
    return False


@contextlib.contextmanager
def blas_threads(n: int | None, backend: str | None = None) -> Iterator[None]:
    """Limit the current backend's BLAS threads to ``n`` inside the block (None: no change).

    MKL: per calling thread (``mkl_set_num_threads_local``). OpenBLAS: process-wide
    (threadpoolctl), so concurrent partitions must all use the same ``n``.
    """
    if n is None:
        yield
        return
    n = max(1, int(n))
    name = backend or get_backend()
    if name == "mkl":
        lib = load_mkl()
        if lib.set_local is not None:
            prev = lib.set_local(n)
            try:
                yield
            finally:
                lib.set_local(prev)
            return
    ctls = openblas_controllers()
    if ctls:
        prev = [c.get_num_threads() for c in ctls]
        if all(p == n for p in prev):
            yield
            return
        for c in ctls:
            c.set_num_threads(n)
        try:
            yield
        finally:
            for c, p in zip(ctls, prev):
                c.set_num_threads(p)
        return
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=n, user_api="blas"):
        yield


def set_num_threads(n: int, backend: str | None = None) -> None:
    """Set the process-wide BLAS thread count of a backend."""
    name = backend or get_backend()
    if name == "mkl":
        lib = load_mkl()
        if lib.set_global is not None:
            lib.set_global(int(n))
        return
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=int(n), user_api="blas")


def get_num_threads(backend: str | None = None) -> int:
    """The BLAS thread count the backend would use now (in this thread)."""
    name = backend or get_backend()
    if name == "mkl":
        return load_mkl().max_threads()
    ctls = openblas_controllers()
    if ctls:
        return int(ctls[0].get_num_threads())
    from threadpoolctl import threadpool_info

    for info in threadpool_info():
        if info.get("internal_api") == "openblas" and "numpy" in info.get("filepath", ""):
            return int(info.get("num_threads", 1))
    for info in threadpool_info():
        if info.get("internal_api") == "openblas":
            return int(info.get("num_threads", 1))
    return 1
