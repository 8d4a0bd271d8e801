"""Reading input volumes and writing output volumes piece by piece: HDF5 (h5py), .npy, TIFF stacks.

A volume is named ``path`` or ``path:dataset`` (HDF5; an input file with a single dataset needs no
name, an output dataset defaults to ``main``). Inputs are read a box at a time (h5py slicing, a
read-only memory map of a .npy, a TIFF stack page by page through tifffile, the optional ``[tiff]``
extra), so a volume larger than memory streams through. Outputs are HDF5 datasets, .npy files or
uncompressed float32 TIFFs (memory-mapped through ``tifffile.memmap``) written a tile at a time.

Every failure is a :class:`cct.errors.CctError` naming the file and dataset.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence

import h5py
import numpy as np

from ..errors import CctError
from ..io.atomic import atomic_write_bytes

TIFF_SUFFIXES = (".tif", ".tiff")
H5_SUFFIXES = (".h5", ".hdf5", ".hdf")


def split_spec(spec: str) -> tuple[str, str | None]:
    """``"vol.h5:raw"`` -> ``("vol.h5", "raw")``; a path without ``:dataset`` -> ``(path, None)``."""
    lower = spec.lower()
    for suffix in H5_SUFFIXES:
        at = lower.find(suffix + ":")
        if at >= 0:
            cut = at + len(suffix)
            return spec[:cut], spec[cut + 1:] or None
    return spec, None


def kind_of(path: str) -> str:
    """``"h5"``, ``"npy"`` or ``"tiff"`` from the file name."""
    lower = path.lower()
    if lower.endswith(H5_SUFFIXES):
        return "h5"
    if lower.endswith(".npy"):
        return "npy"
    if lower.endswith(TIFF_SUFFIXES):
        return "tiff"
    raise CctError(f"{path}: unknown volume format (use .h5/.hdf5[:dataset], .npy or .tif/.tiff)")


class InputVolume:
    """A read-only volume: :attr:`shape`, :attr:`dtype`, :meth:`read` of a box; close it (or use ``with``)."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.path, self.dataset = split_spec(spec)
        self.kind = kind_of(self.path)
        self._file = None
        self._pages = None
        if not os.path.isfile(self.path):
            raise CctError(f"{self.path}: no such input file")
        try:
            getattr(self, f"_open_{self.kind}")()
        except CctError:
            self.close()
            raise
        except Exception as e:  # corrupt files: h5py/numpy/tifffile raise many types
            self.close()
            raise CctError(f"{spec}: cannot read the input volume ({type(e).__name__}: {e})") from None
        self.shape = tuple(int(d) for d in self._array.shape) if self._pages is None else self.shape
        if len(self.shape) < 1 or 0 in self.shape:
            raise CctError(f"{spec}: empty volume of shape {list(self.shape)}")

    def _open_h5(self) -> None:
        self._file = h5py.File(self.path, "r")
        name = self.dataset
        if name is None:
            names = []
            self._file.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
            if len(names) != 1:
                raise CctError(f"{self.path}: name the input dataset as {self.path}:DATASET "
                               f"(the file has {', '.join(names) if names else 'no datasets'})")
            name = names[0]
        if name not in self._file or not isinstance(self._file[name], h5py.Dataset):
            raise CctError(f"{self.path}: no dataset '{name}'")
        self.dataset = name
        self._array = self._file[name]
        self.dtype = np.dtype(self._array.dtype)

    def _open_npy(self) -> None:
        self._array = np.load(self.path, mmap_mode="r", allow_pickle=False)
        self.dtype = self._array.dtype

    def _open_tiff(self) -> None:
        try:
            import tifffile
        except ImportError:
            raise CctError(f"{self.path}: reading TIFF needs tifffile (pip install 'cct[tiff]')") from None
        self._file = tifffile.TiffFile(self.path)
        series = self._file.series[0]
        self.shape = tuple(int(d) for d in series.shape)
        self.dtype = np.dtype(series.dtype)
        pages = list(series.pages)
        if len(pages) > 1 and len(self.shape) == 3 and len(pages) == self.shape[0]:
            self._pages = pages  # a stack: read the z range page by page
        else:
            self._array = series.asarray()

    def read(self, box: Sequence[slice]) -> np.ndarray:
        """The voxels of ``box`` (one slice per axis) as a numpy array."""
        box = tuple(box)
        try:
            if self._pages is not None:
                z = box[0]
                return np.stack([self._pages[i].asarray()[box[1:]] for i in range(z.start, z.stop)])
            return np.asarray(self._array[box])
        except Exception as e:
            raise CctError(f"{self.spec}: cannot read voxels {[(s.start, s.stop) for s in box]} "
                           f"({type(e).__name__}: {e})") from None

    def close(self) -> None:
        """Close the underlying file."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> InputVolume:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class OutputVolume:
    """An output volume ``(C, *spatial)`` of float32 being written tile by tile into ``path`` (a partial
    file that :meth:`finish` renames onto the target), with the done-tile record that makes a run resumable.
    ``create=False``: only reopen the partial file of the same job (another MPI rank's turn to write).
    """

    DONE = "_cct_infer_done"

    def __init__(self, spec: str, shape: Sequence[int], chunks: Sequence[int], tiles: int, signature: str,
                 resume: bool = True, create: bool = True) -> None:
        self.spec = spec
        self.target, dataset = split_spec(spec)
        self.kind = kind_of(self.target)
        if self.kind == "tiff":
            try:
                import tifffile
            except ImportError:
                raise CctError(f"{self.target}: writing TIFF needs tifffile (pip install 'cct[tiff]')") from None
            self._tifffile = tifffile
        self.dataset = dataset or "main"
        self.partial = self.target + ".partial"
        self.shape = tuple(int(d) for d in shape)
        self.resumed = 0
        directory = os.path.dirname(os.path.abspath(self.target))
        if not os.path.isdir(directory):
            raise CctError(f"{self.target}: the output directory {directory} does not exist")
        self._h5 = None
        self._npy = None
        self._done_path = self.partial + ".done.npy"
        done = self._load_done(signature, tiles) if resume else None
        if done is None and not create:
            raise CctError(f"{self.partial}: the partial output of this job is missing or changed (another process?)")
        if done is None:
            self._create(signature, chunks, tiles)
        else:
            self.done = done
            self.resumed = int(done.sum())

    # -- creation and resume ---------------------------------------------------------
    def _create(self, signature: str, chunks: Sequence[int], tiles: int) -> None:
        for p in (self.partial, self._done_path):
            if os.path.exists(p):
                os.unlink(p)
        self.done = np.zeros(tiles, dtype=bool)
        if self.kind == "h5":
            self._h5 = h5py.File(self.partial, "w")
            ds = self._h5.create_dataset(self.dataset, shape=self.shape, dtype="f4",
                                         chunks=tuple(min(c, s) for c, s in zip(chunks, self.shape)))
            ds.attrs["cct_infer_signature"] = signature
            self._h5.create_dataset(self.DONE, data=self.done)
            self._h5.flush()
        else:
            self._npy = self._memmap("w+")
            with open(self.partial + ".sig", "w") as f:
                f.write(signature)
            np.save(self._done_path, self.done)

    def _load_done(self, signature: str, tiles: int) -> np.ndarray | None:
        """The done-tile record of a partial output of the same job, or None (start afresh)."""
        if not os.path.exists(self.partial):
            return None
        try:
            if self.kind == "h5":
                f = h5py.File(self.partial, "r+")
                ds = f[self.dataset]
                ok = (ds.attrs.get("cct_infer_signature") == signature and tuple(ds.shape) == self.shape
                      and f[self.DONE].shape == (tiles,))
                if not ok:
                    f.close()
                    return None
                self._h5 = f
                return np.asarray(f[self.DONE][...], dtype=bool)
            with open(self.partial + ".sig") as fh:
                if fh.read() != signature:
                    return None
            arr = self._memmap("r+")
            done = np.load(self._done_path)
            if tuple(arr.shape) != self.shape or done.shape != (tiles,):
                return None
            self._npy = arr
            return done.astype(bool)
        except Exception:  # a partial file left torn by a crash: start over
            if self._h5 is not None:
                self._h5.close()
                self._h5 = None
            return None

    def _memmap(self, mode: str) -> np.ndarray:
        """The partial .npy or TIFF file memory-mapped: created (``w+``) or reopened (``r+``)."""
        if self.kind == "tiff":  # an uncompressed, contiguous float32 TIFF (tifffile.memmap)
            if mode == "w+":
                return self._tifffile.memmap(self.partial, shape=self.shape, dtype=np.float32)
            return self._tifffile.memmap(self.partial, mode="r+")
        if mode == "w+":
            return np.lib.format.open_memmap(self.partial, mode="w+", dtype=np.float32, shape=self.shape)
        return np.lib.format.open_memmap(self.partial, mode="r+")

    # -- writing ------------------------------------------------------------------------
    def write(self, index: int, start: Sequence[int], data: np.ndarray) -> None:
        """Write tile ``index`` (``data`` of shape ``(C, *size)`` at ``start``) and record it done."""
        box = (slice(None),) + tuple(slice(s, s + n) for s, n in zip(start, data.shape[1:]))
        self.done[index] = True
        if self._h5 is not None:
            self._h5[self.dataset][box] = data
            self._h5[self.DONE][index] = True
            self._h5.flush()
        else:
            self._npy[box] = data
            self._npy.flush()
            tmp = self._done_path + ".tmp.npy"
            np.save(tmp, self.done)
            os.replace(tmp, self._done_path)

    def set_attrs(self, attrs: dict) -> None:
        """Attributes stored with the output (HDF5 attributes; a .npy or TIFF gets a ``.json`` beside it)."""
        self._attrs = dict(attrs)

    def finish(self) -> None:
        """Close the partial file and rename it onto the target (the output appears whole or not at all)."""
        attrs = getattr(self, "_attrs", {})
        if self._h5 is not None:
            ds = self._h5[self.dataset]
            for k, v in attrs.items():
                ds.attrs[k] = v
            del self._h5[self.DONE]
            self._h5.close()
            self._h5 = None
            os.replace(self.partial, self.target)
        else:
            self._npy.flush()
            del self._npy
            self._npy = None
            os.replace(self.partial, self.target)
            atomic_write_bytes(self.target + ".json", json.dumps(attrs, indent=1).encode())
            for p in (self._done_path, self.partial + ".sig"):
                if os.path.exists(p):
                    os.unlink(p)

    def close(self) -> None:
        """Close without finishing (the partial file stays for a resumed run)."""
        if self._h5 is not None:
            self._h5.close()
            self._h5 = None
        if self._npy is not None:
            self._npy.flush()
            self._npy = None
