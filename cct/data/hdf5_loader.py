"""The loader of Caffe's ``HDF5Data`` layer: batches of the datasets (named after the tops) of the HDF5
files listed in a text file.

It walks the rows of each listed file in order and wraps around row by row, even inside a batch; with
``shuffle`` the files and each file's rows are permuted again at each pass.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import CctError
from .stream import continued_state, keeps, rng_state, set_rng_state


def resolve_listed(path: str, list_file: str) -> str:
    """A path from a list file: as given (relative to the cwd, as Caffe), else relative to the list file."""
    if os.path.isabs(path) or os.path.exists(path):
        return path
    alt = os.path.join(os.path.dirname(os.path.abspath(list_file)), path)
    return alt if os.path.exists(alt) else path


def read_hdf5_list(source: str) -> list[str]:
    """The .h5 file names listed (whitespace separated) in ``source``."""
    try:
        # Bytes as Caffe reads them: a non-UTF-8 path still names its file (surrogateescape, like os.fsdecode).
        with open(source, encoding="utf-8", errors="surrogateescape") as f:
            names = f.read().split()
    except OSError as e:
        raise CctError(f"failed to open HDF5 list file '{source}': {e.strerror}") from None
    if not names:
        raise CctError(f"must have at least 1 HDF5 filename listed in '{source}'")
    return [resolve_listed(n, source) for n in names]


def load_hdf5_file(path: str, names: Sequence[str], dtypes: Sequence) -> list[np.ndarray]:
    """Read the datasets ``names`` of one HDF5 file (same number of rows) as arrays of ``dtypes``."""
    import h5py

    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise CctError(f"cannot open HDF5 file '{path}': {e}") from None
    with f:
        out = []
        for name, dt in zip(names, dtypes):
            if name not in f:
                raise CctError(f"HDF5 file '{path}' has no dataset '{name}' (datasets are named after the tops)")
            ds = f[name]
            if not isinstance(ds, h5py.Dataset) or ds.ndim < 1:
                raise CctError(f"HDF5 dataset '{name}' in '{path}' must be an array with at least 1 axis")
            if ds.dtype.kind not in "fiub":
                raise CctError(f"HDF5 dataset '{name}' in '{path}' is not numeric ({ds.dtype})")
            out.append(np.asarray(ds[...], dtype=dt))
    n = out[0].shape[0]
    for name, arr in zip(names, out):
        if arr.shape[0] != n:
            raise CctError(f"HDF5 file '{path}': dataset '{name}' has {arr.shape[0]} rows, "
                           f"'{names[0]}' has {n}")
    if n == 0:
        raise CctError(f"HDF5 file '{path}' has no rows")
    return out


class HDF5Loader:
    """Walks the rows of the listed files (permuted with ``shuffle``), wrapping at the end; builds batches."""

    def __init__(self, files: list[str], names: list[str], dtypes: list, batch_size: int,
                 shuffle: bool, rng: np.random.Generator | None):
        self.files = files
        self.names = names
        self.dtypes = dtypes
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.rng = rng
        self.file_perm = np.arange(len(files))
        if shuffle:
            self.file_perm = rng.permutation(self.file_perm)
        self.cur_file = 0
        self.arrays: list[np.ndarray] = []
        self.trailing: list[tuple[int, ...]] | None = None
        self._load(self.files[self.file_perm[0]])
        self.offset = 0  # rows passed since setup (never wraps): the sharding counter
        self.shard = (0, 1, 1)

    def state(self) -> dict:
        # file_perm and row_perm are replaced, never mutated, so a state can refer to them.
        return {"cur_file": self.cur_file, "file_perm": self.file_perm, "cur_row": self.cur_row,
                "row_perm": self.row_perm, "offset": self.offset, "rng": rng_state(self.rng), "shard": self.shard}

    def set_state(self, state: dict) -> None:
        state = continued_state(state, self.shard)
        self.file_perm = np.asarray(state["file_perm"], dtype=np.int64)
        self.cur_file = int(state["cur_file"])
        self._load(self.files[self.file_perm[self.cur_file]], permute=False)
        self.row_perm = None if state["row_perm"] is None else np.asarray(state["row_perm"], dtype=np.int64)
        self.cur_row = int(state["cur_row"])
        self.offset = int(state.get("offset", 0))
        set_rng_state(self.rng, state["rng"])

    def _load(self, path: str, permute: bool = True) -> None:
        arrays = load_hdf5_file(path, self.names, self.dtypes)
        trailing = [a.shape[1:] for a in arrays]
        if self.trailing is None:
            self.trailing = trailing
        elif trailing != self.trailing:
            raise CctError(f"HDF5 file '{path}': dataset shapes {trailing} differ from the first file's "
                           f"{self.trailing}")
        self.arrays = arrays
        self.rows = arrays[0].shape[0]
        self.row_perm = self.rng.permutation(self.rows) if (self.shuffle and permute) else None
        self.cur_row = 0

    def _end_of_file(self) -> None:
        if len(self.files) > 1:
            self.cur_file += 1
            if self.cur_file == len(self.files):
                self.cur_file = 0
                if self.shuffle:
                    self.file_perm = self.rng.permutation(self.file_perm)
            self._load(self.files[self.file_perm[self.cur_file]])
        self.cur_row = 0
        if self.shuffle:
            self.row_perm = self.rng.permutation(self.rows)

    def _next_row(self) -> None:
        self.cur_row += 1
        self.offset += 1
        if self.cur_row == self.rows:
            self._end_of_file()

    def load(self, buf: list[np.ndarray] | None) -> list[np.ndarray]:
        bs = self.batch_size
        outs = buf if buf is not None else [np.empty((bs,) + t, dt) for t, dt in zip(self.trailing, self.dtypes)]
        if self.shard[2] > 1:  # row by row, stepping over the other ranks' rows (Caffe's Skip)
            for pos in range(bs):
                while not keeps(self.shard, self.offset):
                    self._next_row()
                row = self.cur_row if self.row_perm is None else self.row_perm[self.cur_row]
                for out, arr in zip(outs, self.arrays):
                    out[pos] = arr[row]
                self._next_row()
            return outs
        pos = 0
        while pos < bs:
            n = min(bs - pos, self.rows - self.cur_row)
            if self.row_perm is None:
                idx: Any = slice(self.cur_row, self.cur_row + n)
            else:
                idx = self.row_perm[self.cur_row:self.cur_row + n]
            for out, arr in zip(outs, self.arrays):
                out[pos:pos + n] = arr[idx]
            pos += n
            self.cur_row += n
            self.offset += n
            if self.cur_row == self.rows:
                self._end_of_file()
        return outs
