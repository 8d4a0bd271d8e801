"""Flat parameter buffers: the learnable parameters' data and diffs laid end to end in one array each.

A :class:`FlatParams` is built once at setup (:meth:`cct.net.Net.flatten_params`, called by the solver):
for each dtype of the learnable parameters one :class:`FlatGroup` holds a ``data`` and a ``diff`` buffer
(1-D, C-contiguous) and every parameter Blob's ``data``/``diff`` becomes a reshaped view of its segment
``[offset, offset + count)``. The values are copied in, so nothing the net holds changes but where it lives.
Each segment starts on a 64-byte boundary (:data:`ALIGN`; the gaps between segments hold zeros, which every
update rule leaves zero): the CPU kernels then see the alignment separately allocated arrays had.

With the parameters flat, a solver can update all of them in one elementwise pass
(:mod:`cct.solver.flat_update`); its per-parameter ``lr_mult``/``decay_mult`` come from the segment
table (:meth:`FlatGroup.segment_ends`) or, for the numpy path, from per-element arrays
(:meth:`FlatGroup.per_element`).

Anything that rebinds a parameter's arrays instead of writing into them (``blob.data = ...``,
``Blob.share_data`` on a learnable parameter) leaves the buffer: :meth:`FlatParams.intact` says whether
every view still aliases it (the solver checks before each flat update and otherwise takes the
per-parameter path).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..blob import Blob
from ..device.driver import Device, array_address

#: every parameter's segment starts on a boundary of this many bytes (a cache line: whole-vector loads)
ALIGN = 64


@dataclass
class FlatGroup:
    """The parameters of one dtype on one device: ``param_ids`` (indices into the net's learnable params),
    their ``offsets`` and ``sizes`` in the flat ``data``/``diff`` buffers (in ``device``'s memory)."""

    dtype: np.dtype
    device: Device
    param_ids: list[int]
    offsets: list[int]
    sizes: list[int]
    data: object
    diff: object
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def xp(self):
        """The array module of the buffers."""
        return self.device.xp

    @property
    def size(self) -> int:
        """Number of elements in the buffers."""
        return int(self.data.size)

    def views(self, buffer, shapes: Sequence[tuple[int, ...]]) -> list:
        """Each parameter's segment of ``buffer`` (a flat array of this group's size), in its shape."""
        return [buffer[o:o + n].reshape(s) for o, n, s in zip(self.offsets, self.sizes, shapes)]

    def segment_ends(self):
        """The end offset of each parameter's segment (int64, in ``xp``'s memory; cached)."""
        if "ends" not in self._cache:
            self._cache["ends"] = self.xp.asarray(np.array([o + n for o, n in zip(self.offsets, self.sizes)],
                                                           dtype=np.int64))
        return self._cache["ends"]

    def segment_starts(self):
        """The start offset of each parameter's segment (int64, in ``xp``'s memory; cached)."""
        if "starts" not in self._cache:
            self._cache["starts"] = self.xp.asarray(np.array(self.offsets, dtype=np.int64))
        return self._cache["starts"]

    def per_segment(self, values: Sequence[float]):
        """One value per parameter of this group (``values`` indexed by the net's learnable param id),
        rounded to the group's dtype, in ``xp``'s memory."""
        return self.xp.asarray(np.array([values[p] for p in self.param_ids], dtype=self.dtype))

    def per_element(self, values: Sequence[float]):
        """``values`` (indexed by learnable param id) repeated over each parameter's elements: an array of
        the buffer's size and dtype, 0 in the alignment gaps (allocated here: call at setup)."""
        out = np.zeros(self.size, dtype=self.dtype)
        for p, o, n in zip(self.param_ids, self.offsets, self.sizes):
            out[o:o + n] = values[p]
        return self.xp.asarray(out)


class FlatParams:
    """The flat buffers of a list of learnable parameter Blobs (one :class:`FlatGroup` per dtype and
    array module). Building it copies each Blob's data and diff in and rebinds them to views."""

    def __init__(self, blobs: Sequence[Blob]):
        self.blobs = list(blobs)
        keys: dict[tuple, list[int]] = {}
        for i, b in enumerate(self.blobs):
            keys.setdefault((np.dtype(b.dtype).str, b.device), []).append(i)
        self.groups: list[FlatGroup] = []
        for ids in keys.values():
            first = self.blobs[ids[0]]
            dtype = np.dtype(first.dtype)
            step = max(1, ALIGN // dtype.itemsize)
            sizes = [int(self.blobs[i].data.size) for i in ids]
            offsets, total = [], 0
            for n in sizes:
                offsets.append(total)
                total += -(-n // step) * step
            device = first.device
            group = FlatGroup(dtype, device, list(ids), offsets, sizes, _aligned_zeros(device, total, dtype),
                              _aligned_zeros(device, total, dtype))
            shapes = [self.blobs[i].data.shape for i in ids]
            for i, dv, gv in zip(ids, group.views(group.data, shapes), group.views(group.diff, shapes)):
                b = self.blobs[i]
                dv[...] = b.data
                gv[...] = b.diff
                b.data, b.diff = dv, gv
            self.groups.append(group)

    def intact(self) -> bool:
        """True while every parameter's data and diff are still views of the flat buffers at their offsets."""
        for g in self.groups:
            for i, o, n in zip(g.param_ids, g.offsets, g.sizes):
                b = self.blobs[i]
                if not (_views_at(b.data, g.data, o, n) and _views_at(b.diff, g.diff, o, n)):
                    return False
        return True

    def histories(self, sets: int) -> list:
        """``sets`` zeroed history buffers per group, and the per-parameter views of them in the solver's
        order (set 0's views for params 0..n-1, then set 1's, ...). Returns ``(buffers, views)``;
        ``buffers[k][g]`` is set k of group g."""
        n = len(self.blobs)
        buffers = []
        views: list = [None] * (n * sets)
        for k in range(sets):
            row = []
            for g in self.groups:
                buf = _aligned_zeros(g.device, g.size, g.dtype)
                row.append(buf)
                shapes = [self.blobs[i].data.shape for i in g.param_ids]
                for i, v in zip(g.param_ids, g.views(buf, shapes)):
                    views[k * n + i] = v
            buffers.append(row)
        return buffers, views


def _aligned_zeros(device: Device, n: int, dtype: np.dtype):
    """A zeroed 1-D array of ``n`` elements on ``device`` whose first element sits on an :data:`ALIGN`-byte
    boundary."""
    if device.is_gpu:
        return device.zeros(n, dtype=dtype)  # device allocations are aligned more strictly already
    step = max(1, ALIGN // dtype.itemsize)
    raw = np.zeros(n + step, dtype=dtype)
    start = (-array_address(raw) % ALIGN) // dtype.itemsize
    return raw[start:start + n]


def _views_at(a, buffer, offset: int, size: int) -> bool:
    """Whether ``a`` is the C-contiguous segment ``[offset, offset + size)`` of the 1-D ``buffer`` (same
    first address and length: while ``buffer`` lives no other array can start there)."""
    if a.size != size or not a.flags.c_contiguous:
        return False
    if size == 0:
        return True
    return array_address(a) == array_address(buffer) + offset * buffer.dtype.itemsize
