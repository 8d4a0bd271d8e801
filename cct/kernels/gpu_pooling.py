"""CuPy kernels of MAX pooling on ``(N, C, H, W)`` arrays in GPU memory: one launch per pass.

The layer's array-module path (:mod:`cct.layers.pooling`) launches three small kernels per window
offset in each pass (compare, select, select; backward: compare, select, add), which leaves a resident
net bound by the host issuing them. These two kernels give its results bitwise: the forward keeps the
first strict maximum in row-major window order, starting from ``-FLT_MAX`` (index -1) and skipping
positions outside the input; the backward gathers, for each input position, the output gradients
whose maximum it was, adding them in increasing window offset as that path does.

Used for float32/float64 C-contiguous CuPy arrays unless ``CCT_KERNELS=numpy``
(:func:`cct.kernels.mode`); the kernels compile on first use (CuPy caches them on disk), checked on a
tiny input: a GPU toolchain that cannot build them leaves the array path in use (a warning says why).
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import mode

log = logging.getLogger("cct")

_GEOMETRY = ("int32 h, int32 w, int32 oh, int32 ow, int32 kh, int32 kw, int32 sh, int32 sw, "
             "int32 ph, int32 pw")

_FORWARD = """
    const int plane = i / (oh * ow);
    const int r = i - plane * (oh * ow);
    const int hs = (r / ow) * sh - ph, ws = (r % ow) * sw - pw;
    const ptrdiff_t base = (ptrdiff_t)plane * h * w;
    T best = init;
    int a = -1;
    for (int di = 0; di < kh; ++di) {
        const int hh = hs + di;
        if (hh < 0 || hh >= h) continue;
        for (int dj = 0; dj < kw; ++dj) {
            const int ww = ws + dj;
            if (ww < 0 || ww >= w) continue;
            const T v = x[base + (ptrdiff_t)hh * w + ww];
            if (v > best) { best = v; a = di * kw + dj; }
        }
    }
    y = best;
    arg = a;
"""

_BACKWARD = """
    const int plane = i / (h * w);
    const int r = i - plane * (h * w);
    const int hp = r / w + ph, wp = r % w + pw;
    const ptrdiff_t base = (ptrdiff_t)plane * oh * ow;
    T acc = 0;
    for (int di = 0; di < kh; ++di) {
        const int t = hp - di;
        if (t < 0 || t % sh != 0 || t / sh >= oh) continue;
        for (int dj = 0; dj < kw; ++dj) {
            const int u = wp - dj;
            if (u < 0 || u % sw != 0 || u / sw >= ow) continue;
            const ptrdiff_t o = base + (ptrdiff_t)(t / sh) * ow + u / sw;
            if (arg[o] == di * kw + dj) acc += dy[o];
        }
    }
    dx = acc;
"""


@functools.cache
def _kernels() -> tuple[Any, Any]:
    import cupy

    forward = cupy.ElementwiseKernel(f"raw T x, {_GEOMETRY}, T init", "T y, int32 arg", _FORWARD,
                                     "cct_max_pool_forward")
    backward = cupy.ElementwiseKernel(f"raw T dy, raw int32 arg, {_GEOMETRY}", "T dx", _BACKWARD,
                                      "cct_max_pool_backward")
    return forward, backward


def usable(*arrays: Any) -> bool:
    """True for 4-D, C-contiguous float32/float64 CuPy arrays of one dtype (and the kernels enabled)."""
    if mode() == "numpy" or not arrays:
        return False
    try:
        import cupy
    except ImportError:
        return False
    dt = arrays[0].dtype
    return all(isinstance(a, cupy.ndarray) and a.ndim == 4 and a.flags.c_contiguous and a.dtype == dt
               and a.dtype in (np.float32, np.float64) for a in arrays) and _builds(np.dtype(dt).name)


@functools.cache
def _builds(dtype: str) -> bool:
    """Whether both kernels compile and run for ``dtype`` here (once per process)."""
    import cupy

    try:
        x = cupy.arange(4, dtype=dtype).reshape(1, 1, 2, 2)
        y, arg = cupy.empty((1, 1, 1, 1), dtype=dtype), cupy.empty((1, 1, 1, 1), dtype=np.int32)
        max_forward(x, y, arg, (2, 2), (0, 0), (2, 2))
        dx = cupy.empty_like(x)
        max_backward(cupy.ones_like(y), arg, dx, (2, 2), (0, 0), (2, 2))
        ok = float(y[0, 0, 0, 0]) == 3.0 and int(arg[0, 0, 0, 0]) == 3 and float(dx.sum()) == 1.0
    except Exception as e:  # noqa: BLE001 - any failure to build or run them: the array path serves
        log.warning("MAX pooling GPU kernels unavailable (%s: %s); using the array-module path", type(e).__name__, e)
        return False
    if not ok:
        log.warning("MAX pooling GPU kernels gave a wrong result on a check; using the array-module path")
    return ok


def _args(shape_in: Sequence[int], shape_out: Sequence[int], kernel: Sequence[int], pad: Sequence[int],
          stride: Sequence[int]) -> tuple[np.int32, ...]:
    vals = (*shape_in[2:], *shape_out[2:], *kernel, *stride, *pad)
    return tuple(np.int32(v) for v in vals)


def max_forward(x: Any, out: Any, arg: Any, kernel: Sequence[int], pad: Sequence[int],
                stride: Sequence[int]) -> None:
    """``out``, ``arg`` (int32, window offset of each maximum, -1 for an empty window) of ``x``."""
    forward, _ = _kernels()
    init = x.dtype.type(-np.finfo(np.float32).max)
    forward(x, *_args(x.shape, out.shape, kernel, pad, stride), init, out, arg)


def max_backward(dy: Any, arg: Any, dx: Any, kernel: Sequence[int], pad: Sequence[int],
                 stride: Sequence[int]) -> None:
    """``dx[...] =`` the gradient of MAX pooling from ``dy`` and the forward's ``arg``."""
    _, backward = _kernels()
    backward(dy, arg, *_args(dx.shape, dy.shape, kernel, pad, stride), dx)
