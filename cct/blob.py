"""Blob: a named pair of arrays (``data`` and ``diff``) of one shape, as in Caffe.

Layers write into ``blob.data`` / ``blob.diff`` in place (``a[...] = ...``) so that
views handed out (pycaffe shim, Reshape/Flatten tops) stay valid; only ``reshape``
and ``share_*`` rebind the arrays.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from .config import current
from .device.driver import Device, HostDevice
from .errors import CctError
from .membudget import check_blob_size

MAX_BLOB_AXES = 32


def canonical_axis(axis: int, num_axes: int, what: str = "axis") -> int:
    """Map a possibly negative axis into [0, num_axes) or raise with a clear message."""
    if not -num_axes <= axis < num_axes:
        raise CctError(f"{what} {axis} out of range for a blob with {num_axes} axes")
    return axis + num_axes if axis < 0 else axis


class Blob:
    """Caffe's Blob: N-d ``data`` and ``diff`` arrays of the same shape and dtype.

    ``diff`` is allocated (zeroed) when it is first used, as Caffe's SyncedMemory allocates on first access: a
    net that only runs forward (inference, test nets) holds no gradient arrays.
    """

    def __init__(self, shape: Sequence[int] = (), dtype=np.float32, device: Device | None = None, name: str = ""):
        self.name = name
        self.device = device if device is not None else HostDevice()  # where data and diff live
        self.xp = self.device.xp  # the array module layers compute with (numpy or cupy)
        self.dtype = np.dtype(dtype)
        self._shape: tuple[int, ...] = ()
        self.data = self.device.zeros((), dtype=self.dtype)
        self._diff = None
        self._diff_source: tuple | None = None  # (blob, shape) whose diff this one's views (share_diff)
        self.reshape(shape)

    @property
    def diff(self):
        """The gradient array (same shape and dtype as ``data``); allocated zeroed on first use."""
        d = self._diff
        if d is None:
            source = self._diff_source
            if source is not None:
                d = source[0].diff.reshape(source[1])
            else:
                d = self.device.zeros(self._shape, dtype=self.dtype)
            self._diff = d
        return d

    @diff.setter
    def diff(self, value) -> None:
        self._diff = value
        self._diff_source = None

    @property
    def has_diff(self) -> bool:
        """Whether ``diff`` has been allocated (or resolved to a view of another blob's) yet."""
        return self._diff is not None

    # -- shape -------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    def reshape(self, *shape) -> None:
        """Give the blob a new shape; reallocates (zeroed) only when the shape changes.

        Takes a sequence (``reshape((2, 3))``) or, as pycaffe, the dimensions (``reshape(2, 3)``).
        """
        if len(shape) == 1 and isinstance(shape[0], Iterable):
            shape = shape[0]
        shape = tuple(int(d) for d in shape)
        if len(shape) > MAX_BLOB_AXES:
            raise CctError(f"blob '{self.name}': {len(shape)} axes exceed the maximum of {MAX_BLOB_AXES}")
        if any(d < 0 for d in shape):
            raise CctError(f"blob '{self.name}': negative dimension in shape {list(shape)}")
        if shape == self._shape and self.data.shape == shape:
            return
        check_blob_size(self.name, shape, self.dtype.itemsize, current().memory_budget)
        self._shape = shape
        self.data = self.device.zeros(shape, dtype=self.dtype)
        self._diff = None  # allocated when first used
        self._diff_source = None

    def reshape_like(self, other: Blob) -> None:
        self.reshape(other.shape)

    def share_data(self, other: Blob, shape: Sequence[int] | None = None) -> None:
        """Make ``data`` a view of another blob's data (optionally with a new shape)."""
        shape = other.shape if shape is None else tuple(int(d) for d in shape)
        self._shape = shape
        self.data = other.data.reshape(shape)
        if self._diff is not None and self._diff.shape != shape:
            self._diff = None  # a fresh zeroed diff when next used
        if self._diff_source is not None and tuple(self._diff_source[1]) != shape:
            self._diff_source = None

    def bind_data(self, array) -> None:
        """Make ``data`` the caller's ``array`` (its shape becomes the blob's): storage owned elsewhere, e.g.
        a pool of activation buffers reused across layers (:mod:`cct.infer.buffers`)."""
        self._shape = tuple(int(d) for d in array.shape)
        self.data = array
        self._diff = None
        self._diff_source = None

    def share_diff(self, other: Blob, shape: Sequence[int] | None = None) -> None:
        """Make ``diff`` a view of another blob's diff (optionally with a new shape)."""
        shape = other.shape if shape is None else tuple(int(d) for d in shape)
        if other.has_diff if isinstance(other, Blob) else True:
            self.diff = other.diff.reshape(shape)
        else:  # bound now, allocated when either blob's diff is first used
            self._diff = None
            self._diff_source = (other, shape)

    @property
    def num_axes(self) -> int:
        return len(self._shape)

    @property
    def count(self) -> int:
        return math.prod(self._shape)

    def count_range(self, start: int, end: int | None = None) -> int:
        """Product of dimensions in [start, end)."""
        end = self.num_axes if end is None else end
        return math.prod(self._shape[start:end])  # Python ints: exact, and ~10x cheaper than np.prod

    def canonical_axis(self, axis: int) -> int:
        return canonical_axis(axis, self.num_axes, f"axis of blob '{self.name}'")

    def legacy_shape(self, index: int) -> int:
        """Caffe's LegacyShape: 4-D view of up to 4-D blobs, missing axes are 1."""
        if self.num_axes > 4:
            raise CctError(f"blob '{self.name}' has {self.num_axes} axes; legacy accessors need <= 4")
        if index >= self.num_axes or index < -self.num_axes:
            return 1
        return self._shape[index]

    @property
    def num(self) -> int:
        return self.legacy_shape(0)

    @property
    def channels(self) -> int:
        return self.legacy_shape(1)

    @property
    def height(self) -> int:
        return self.legacy_shape(2)

    @property
    def width(self) -> int:
        return self.legacy_shape(3)

    def shape_string(self) -> str:
        return " ".join(str(d) for d in self._shape) + f" ({self.count})"

    def __repr__(self) -> str:
        return f"Blob({self.name!r}, shape={list(self._shape)})"
