"""Overlap-save tiling (ZNNi, section II): input patches overlapping by the field of view - 1, output tiles exact.

The output is cut into tiles of the patch's output shape; tile ``t`` (output voxels ``[o, o + T)`` per
axis) reads the input patch ``[o * step, o * step + patch)`` in padded input coordinates, where ``step``
is 1 for dense output and the net's stride for its strided output. Neighbouring input patches thus
overlap by ``fov - step`` voxels and every output voxel belongs to exactly one tile.

``mode="valid"``: the output covers the window positions inside the volume (``n - fov + 1`` per axis,
dense). ``mode="same"``: the output has the volume's size; the input is padded by ``(fov - 1) // 2``
before and the rest after, with ``padding="zero"`` or ``padding="mirror"`` (reflection about the edge
voxel, which is not repeated: numpy's ``reflect``), as the net was trained. The last tile of an axis may
reach past the output (a ragged border): its input is read as far as it exists and filled with zeros
beyond, and only the part of its output inside the volume is written.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from ..errors import CctError

MODES = ("valid", "same")
PADDINGS = ("zero", "mirror")


@dataclass(frozen=True)
class Tile:
    """One output tile: its index, first output voxel and output shape inside the volume (``size``)."""

    index: int
    start: tuple[int, ...]
    size: tuple[int, ...]


@dataclass(frozen=True)
class Tiling:
    """The tiles of a volume of spatial shape ``volume`` for patches of input shape ``patch`` and output
    shape ``tile`` (``step``: input voxels between output voxels)."""

    volume: tuple[int, ...]
    fov: tuple[int, ...]
    patch: tuple[int, ...]
    tile: tuple[int, ...]
    step: tuple[int, ...]
    mode: str = "valid"
    padding: str = "zero"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise CctError(f"unknown mode '{self.mode}' (use {' or '.join(MODES)})")
        if self.padding not in PADDINGS:
            raise CctError(f"unknown padding '{self.padding}' (use {' or '.join(PADDINGS)})")
        if self.mode == "same" and any(s != 1 for s in self.step):
            raise CctError("mode 'same' needs dense output (the net's strided output has no 'same' size)")
        if self.mode == "valid" and any(n < f for n, f in zip(self.volume, self.fov)):
            raise CctError(f"volume {list(self.volume)} is smaller than the net's field of view {list(self.fov)} "
                           "(use mode 'same' to pad it)")
        if self.mode == "same" and self.padding == "mirror" and any(
                p >= n for p, n in zip(self.pad_after, self.volume)):
            raise CctError(f"volume {list(self.volume)} too small to mirror-pad by {list(self.pad_after)}")

    @property
    def pad_before(self) -> tuple[int, ...]:
        """Padding before the volume per axis (``same`` mode)."""
        return tuple((f - 1) // 2 for f in self.fov) if self.mode == "same" else (0,) * len(self.fov)

    @property
    def pad_after(self) -> tuple[int, ...]:
        """Padding after the volume per axis (``same`` mode)."""
        return tuple(f - 1 - b for f, b in zip(self.fov, self.pad_before)) if self.mode == "same" \
            else (0,) * len(self.fov)

    @property
    def output(self) -> tuple[int, ...]:
        """Output spatial shape."""
        if self.mode == "same":
            return self.volume
        return tuple((n - f) // s + 1 for n, f, s in zip(self.volume, self.fov, self.step))

    @property
    def counts(self) -> tuple[int, ...]:
        """Tiles per axis."""
        return tuple(-(-o // t) for o, t in zip(self.output, self.tile))

    def __len__(self) -> int:
        return int(np.prod(self.counts))

    def __iter__(self) -> Iterator[Tile]:
        for i, idx in enumerate(itertools.product(*(range(c) for c in self.counts))):
            start = tuple(k * t for k, t in zip(idx, self.tile))
            size = tuple(min(t, o - s) for t, o, s in zip(self.tile, self.output, start))
            yield Tile(i, start, size)

    def input_range(self, tile: Tile) -> tuple[tuple[int, int], ...]:
        """The patch of ``tile`` in volume coordinates ``[lo, hi)`` per axis (may reach outside the volume)."""
        return tuple((s * st - b, s * st - b + p)
                     for s, st, b, p in zip(tile.start, self.step, self.pad_before, self.patch))

    def read_patch(self, tile: Tile, read: Callable[[tuple[slice, ...]], np.ndarray], channels: int,
                   dtype=np.float32) -> np.ndarray:
        """The input patch ``(channels, *patch)`` of ``tile``; ``read(slices)`` returns ``(channels, *box)``
        of the volume. Voxels outside the volume are mirrored (``padding="mirror"``, within the pad zone)
        or zero."""
        ranges = self.input_range(tile)
        idx, ok = [], []
        for (lo, hi), n, b, a in zip(ranges, self.volume, self.pad_before, self.pad_after):
            v = np.arange(lo, hi)
            if self.padding == "mirror":
                inside_pad = (v >= -b) & (v < n + a)
                v = np.where(inside_pad & (v < 0), -v, v)
                v = np.where(inside_pad & (v >= n), 2 * (n - 1) - v, v)
            good = (v >= 0) & (v < n)
            idx.append(v)
            ok.append(good)
        out = np.zeros((channels,) + self.patch, dtype=dtype)
        if not all(g.any() for g in ok):
            return out
        box = tuple(slice(int(v[g].min()), int(v[g].max()) + 1) for v, g in zip(idx, ok))
        data = np.asarray(read(box))
        take = np.ix_(*[np.where(g, v - s.start, 0) for v, g, s in zip(idx, ok, box)])
        out[...] = data[(slice(None),) + take]
        mask = np.ones(self.patch, dtype=bool)
        for a, g in enumerate(ok):
            shape = [1] * len(self.patch)
            shape[a] = -1
            mask &= g.reshape(shape)
        out[:, ~mask] = 0
        return out

