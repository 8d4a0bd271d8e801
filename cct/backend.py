"""Array-module helpers: layers are written once against ``xp`` (numpy or cupy). The one answer to "is this
array in a GPU's memory" is :func:`in_device_memory`."""
from __future__ import annotations

from typing import Any

import numpy as np

try:  # CuPy is optional (``pip install cct[gpu]``).
    import cupy as _cupy  # type: ignore
except Exception:  # pragma: no cover - no GPU stack on CI machines
    _cupy = None


def get_array_module(*arrays: Any):
    """Return cupy if any argument is a cupy array, else numpy (Chainer's convention)."""
    if _cupy is not None:
        for a in arrays:
            if isinstance(a, _cupy.ndarray):
                return _cupy
    return np


def in_device_memory(a: Any) -> bool:
    """True for an array in a GPU's memory (a CuPy array), False for host arrays."""
    return _cupy is not None and isinstance(a, _cupy.ndarray)


def array_address(a: Any) -> int:
    """Address of an array's first element (device or host memory)."""
    if in_device_memory(a):
        return int(a.data.ptr)
    return int(a.__array_interface__["data"][0])


def cupy_available() -> bool:
    """True when CuPy imports and sees at least one GPU."""
    if _cupy is None:
        return False
    try:
        return _cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # pragma: no cover
        return False


def to_numpy(a: Any) -> np.ndarray:
    """Bring an array (numpy or cupy) to host memory as numpy."""
    if _cupy is not None and isinstance(a, _cupy.ndarray):
        return _cupy.asnumpy(a)
    return np.asarray(a)
