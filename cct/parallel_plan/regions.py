"""The input region each worker needs to compute its box of a layer's output (DeePa: "the input sets
for each worker"), convolution and pooling halos included.

Every rule maps the ``(k, 4, 2)`` array of ``k`` workers' output boxes (``[lo, hi)`` per axis of
``(N, C, H, W)``) to the ``(k, 4, 2)`` array of the regions of one input tensor they read; an empty
output box needs nothing (an empty region, ``lo == hi``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def _full(boxes: np.ndarray, in_shape: tuple[int, int, int, int], axes: tuple[int, ...]) -> np.ndarray:
    out = boxes.copy()
    for a in axes:
        out[:, a, 0], out[:, a, 1] = 0, in_shape[a]
    return out


def _empty_rows(boxes: np.ndarray) -> np.ndarray:
    return np.any(boxes[:, :, 1] <= boxes[:, :, 0], axis=1)


def _finish(out: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    out[:, :, 0] = np.minimum(out[:, :, 0], out[:, :, 1])  # a window past the end reads nothing
    out[_empty_rows(boxes)] = 0
    return out


@dataclass(frozen=True)
class Window:
    """A sliding window along one spatial axis: output index o reads inputs
    ``[o*stride - pad, o*stride - pad + extent)`` (extent: the dilated kernel size)."""

    extent: int
    stride: int = 1
    pad: int = 0

    def map(self, lo: np.ndarray, hi: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
        """Input ``[lo, hi)`` ranges (clipped to ``[0, size)``) read by output ranges ``[lo, hi)``."""
        a = np.clip(lo * self.stride - self.pad, 0, size)
        b = np.clip((hi - 1) * self.stride - self.pad + self.extent, 0, size)
        return a, b


class RegionRule:
    """How a layer's output box maps to the region of its input ``bottom`` it reads."""

    def needed(self, boxes: np.ndarray, bottom: int, in_shape: tuple[int, int, int, int]) -> np.ndarray:
        """The ``(k, 4, 2)`` input regions for the ``(k, 4, 2)`` output ``boxes``."""
        raise NotImplementedError


class SameBox(RegionRule):
    """Element-wise layers (Eltwise, Split, in-place activations): the same box of every input."""

    def needed(self, boxes, bottom, in_shape):
        return _finish(boxes.copy(), boxes)


class SampleRows(RegionRule):
    """Per-sample layers that read a whole sample (InnerProduct, losses, layers without a finer rule):
    the box's samples, every channel and position."""

    def needed(self, boxes, bottom, in_shape):
        return _finish(_full(boxes, in_shape, (1, 2, 3)), boxes)


class AllChannels(RegionRule):
    """Softmax over channels: the box's samples and positions, every channel."""

    def needed(self, boxes, bottom, in_shape):
        return _finish(_full(boxes, in_shape, (1,)), boxes)


class LossInputs(RegionRule):
    """A SoftmaxWithLoss split like its scores: the box of the scores (bottom 0), the box's samples and
    positions of the labels (bottom 1, one channel)."""

    def needed(self, boxes, bottom, in_shape):
        return _finish(boxes.copy() if bottom == 0 else _full(boxes, in_shape, (1,)), boxes)


@dataclass(frozen=True)
class Pooling(RegionRule):
    """Pooling (and LRN within a channel): the same channels, the windows of the box's rows and columns."""

    window_h: Window
    window_w: Window

    def _windows(self, boxes: np.ndarray, in_shape: tuple[int, int, int, int]) -> np.ndarray:
        out = boxes.copy()
        out[:, 2, 0], out[:, 2, 1] = self.window_h.map(boxes[:, 2, 0], boxes[:, 2, 1], in_shape[2])
        out[:, 3, 0], out[:, 3, 1] = self.window_w.map(boxes[:, 3, 0], boxes[:, 3, 1], in_shape[3])
        return out

    def needed(self, boxes, bottom, in_shape):
        return _finish(self._windows(boxes, in_shape), boxes)


@dataclass(frozen=True)
class Convolution(Pooling):
    """A convolution: the windows of the box's rows and columns (the halo of a spatial split), and the
    input channels of the groups its output channels belong to."""

    channels_out: int = 1
    group: int = 1

    def needed(self, boxes, bottom, in_shape):
        out = self._windows(boxes, in_shape)
        per_in, per_out = in_shape[1] // self.group, self.channels_out // self.group
        out[:, 1, 0] = boxes[:, 1, 0] // per_out * per_in
        out[:, 1, 1] = ((boxes[:, 1, 1] - 1) // per_out + 1) * per_in
        return _finish(out, boxes)


@dataclass(frozen=True)
class ChannelWindow(RegionRule):
    """LRN across channels: channel c reads ``[c - (size-1)/2, c + (size-1)/2]`` (the channel halo)."""

    size: int

    def needed(self, boxes, bottom, in_shape):
        out = boxes.copy()
        w = Window(self.size, 1, (self.size - 1) // 2)
        out[:, 1, 0], out[:, 1, 1] = w.map(boxes[:, 1, 0], boxes[:, 1, 1], in_shape[1])
        return _finish(out, boxes)


@dataclass(frozen=True)
class ConcatChannels(RegionRule):
    """Concat along channels: bottom b is the channel range ``[offsets[b], offsets[b+1])`` of the output."""

    offsets: tuple[int, ...]

    def needed(self, boxes, bottom, in_shape):
        out = boxes.copy()
        lo, hi = self.offsets[bottom], self.offsets[bottom + 1]
        out[:, 1, 0] = np.clip(boxes[:, 1, 0], lo, hi) - lo
        out[:, 1, 1] = np.clip(boxes[:, 1, 1], lo, hi) - lo
        return _finish(out, boxes)
