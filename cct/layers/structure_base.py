"""What the structure layers (routing, reshaping, reduction, selection) share: Caffe's axis
handling with layer-named errors, in-place checks, and array helpers (numpy or CuPy)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..blob import Blob
from ..device.driver import device_of
from .base import Layer


def axis_slice(axis: int, start: int, stop: int) -> tuple:
    """Index tuple selecting ``[start, stop)`` along ``axis`` (all of every earlier axis)."""
    return (slice(None),) * axis + (slice(start, stop),)


def index_add(target, index, values) -> None:
    """``target[index] += values`` with repeated indices accumulating (numpy or cupy)."""
    if device_of(target).is_gpu:  # pragma: no cover - needs a GPU
        import cupyx

        cupyx.scatter_add(target, index, values)
    else:
        np.add.at(target, index, values)


def top_diff_safe(top: Blob, bottom: Sequence[Blob]):
    """``top.diff``, copied when the top is also a bottom (in place), so writing bottom diffs cannot clobber it."""
    if any(b is top for b in bottom):
        return top.diff.copy()
    return top.diff


class StructureLayer(Layer):
    """Base of the structure layers: Caffe's CanonicalAxisIndex and in-place checks."""

    def canonical_axis(self, blob: Blob, axis: int, what: str = "axis") -> int:
        """Caffe's CanonicalAxisIndex with an error naming this layer and the blob's shape."""
        n = blob.num_axes
        if not -n <= axis < n:
            raise self.error(f"{what} {axis} out of range for {n}-D blob with shape {list(blob.shape)}")
        return axis + n if axis < 0 else axis

    def no_in_place(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        for t in top:
            if any(t is b for b in bottom):
                raise self.error(f"{self.type} layer does not allow in-place computation")
