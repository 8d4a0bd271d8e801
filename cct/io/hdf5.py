"""Caffe's HDF5 formats: net weights (Net::ToHDF5 / CopyTrainedLayersFromHDF5) and solver state
(SGDSolver::SnapshotSolverStateToHDF5 / RestoreSolverStateFromHDF5).

Weights file layout::

    /data/<layer name>/0, /data/<layer name>/1, ...   float32 datasets shaped like the param blobs
    /diff/<layer name>/0, ...                          (only when diffs are written)

Every layer of the net gets a group, also layers without params. A param a layer shares with an
earlier layer (it does not own it) has no dataset under ``data`` (Caffe skips it) but its diff is
written. Solver state layout::

    /iter           scalar int32
    /learned_net    scalar fixed-length, NUL-terminated ASCII string (the .caffemodel / .h5 path)
    /current_step   scalar int32
    /history/0, /history/1, ...   float32 datasets shaped like the history blobs
"""
from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

from ..errors import CctError, ProtoParseError
from .atomic import atomic_write


def _h5py():
    try:
        import h5py
    except ImportError as e:  # pragma: no cover - h5py is a dependency
        raise CctError("reading/writing HDF5 files needs h5py (pip install h5py)") from e
    return h5py


def _write_atomic(path: str | os.PathLike, fill) -> None:
    """Create an HDF5 file at a temp path beside ``path``, let ``fill(file)`` write it, then rename."""
    h5py = _h5py()

    def write(tmp: str) -> None:
        with h5py.File(tmp, "w") as f:
            fill(f)

    atomic_write(path, write)


def _open_read(path: str | os.PathLike, what: str):
    h5py = _h5py()
    source = os.fspath(path)
    if not os.path.exists(source):
        raise CctError(f"cannot read {what} '{source}': No such file or directory")
    try:
        return h5py.File(source, "r")
    except OSError as e:
        raise ProtoParseError(f"{source}: not a readable HDF5 file ({e})") from None


# What h5py raises on a damaged file (bad B-tree/heap/object headers, truncated chunks...).
_H5_DAMAGE = (OSError, RuntimeError, KeyError, ValueError, TypeError)


def _damaged(source: str, e: BaseException) -> ProtoParseError:
    return ProtoParseError(f"{source}: damaged HDF5 file ({type(e).__name__}: {e})")


def _save_nd(group, name: str, arr) -> None:
    # np.array, not np.ascontiguousarray: that makes a 0-d blob (PReLU channel_shared) 1-d
    a = np.array(arr, dtype=np.float32, order="C")
    group.create_dataset(name, data=a)


def _load_nd(ds, source: str) -> np.ndarray:
    if ds.dtype.kind not in "fiub":
        raise ProtoParseError(f"{source}: dataset {ds.name} has type {ds.dtype}, expected floating point")
    if ds.shape is None:
        raise ProtoParseError(f"{source}: dataset {ds.name} is empty (null dataspace)")
    if ds.ndim > 32:
        raise ProtoParseError(f"{source}: dataset {ds.name} has {ds.ndim} axes, more than a blob's 32")
    return np.asarray(ds[()], dtype=np.float32).reshape(ds.shape)


def _layer_groups(group, prefix: str = ""):
    """(layer name, group) for each layer group under ``group``; a layer name containing '/' is stored
    as nested groups, so subgroups are walked too (datasets and subgroups may share a level)."""
    h5py = _h5py()
    for key in group:  # h5py iterates in name order, as Caffe's H5Literate by H5_INDEX_NAME
        item = group.get(key)
        if isinstance(item, h5py.Group):
            name = prefix + key
            yield name, item
            yield from _layer_groups(item, name + "/")


def _param_arrays(group, source: str, layer: str) -> list[np.ndarray | None]:
    h5py = _h5py()
    index: dict[int, object] = {}
    for key in group:
        item = group.get(key)
        if isinstance(item, h5py.Dataset):
            if not key.isdigit():
                raise ProtoParseError(f"{source}: layer '{layer}' has a dataset named '{key}'; "
                                      "expected param indices 0, 1, ...")
            index[int(key)] = item
    if not index:
        return []
    out: list[np.ndarray | None] = [None] * (max(index) + 1)
    for j, ds in index.items():
        out[j] = _load_nd(ds, source)
    return out


def write_hdf5_weights(
    path: str | os.PathLike,
    layers: Iterable[tuple[str, Sequence[np.ndarray | None]]],
    diffs: Iterable[tuple[str, Sequence[np.ndarray]]] | None = None,
) -> None:
    """Write net weights in Caffe's HDF5 layout (atomically).

    ``layers``: (layer name, [param arrays]) for every layer of the net in order (layers without params
    get an empty group, as in Caffe). A ``None`` param is one the layer shares but does not own: no
    dataset is written for it. ``diffs``: the same for the param diffs (written for every param), or None.
    """
    layers = [(name, list(arrays)) for name, arrays in layers]
    diff_list = None if diffs is None else [(name, list(arrays)) for name, arrays in diffs]

    def fill(f) -> None:
        data = f.create_group("data")
        for name, arrays in layers:
            g = data.require_group(name)
            for j, a in enumerate(arrays):
                if a is not None:
                    _save_nd(g, str(j), a)
        if diff_list is not None:
            diff = f.create_group("diff")
            for name, arrays in diff_list:
                g = diff.require_group(name)
                for j, a in enumerate(arrays):
                    _save_nd(g, str(j), a)

    _write_atomic(path, fill)


def read_hdf5_weights(path: str | os.PathLike, diff: bool = False) -> OrderedDict[str, list[np.ndarray | None]]:
    """Read Caffe HDF5 weights: layer name -> list of float32 arrays (``None`` where a weight-shared
    layer stored no dataset for that param index). ``diff=True`` reads the ``diff`` group instead."""
    source = os.fspath(path)
    group_name = "diff" if diff else "data"
    out: OrderedDict[str, list[np.ndarray | None]] = OrderedDict()
    try:
        with _open_read(source, "HDF5 weights") as f:
            if group_name not in f:
                raise ProtoParseError(f"{source}: no '{group_name}' group; not a Caffe HDF5 weights file")
            for name, g in _layer_groups(f[group_name]):
                arrays = _param_arrays(g, source, name)
                # A group holding only subgroups is the first part of a layer name containing '/'.
                if arrays or len(g) == 0:
                    out[name] = arrays
    except CctError:
        raise
    except _H5_DAMAGE as e:
        raise _damaged(source, e) from None
    return out


def write_hdf5_solverstate(
    path: str | os.PathLike,
    iter: int,
    learned_net: str,
    current_step: int,
    history: Iterable[np.ndarray],
) -> None:
    """Write a solver state in Caffe's HDF5 layout (atomically)."""
    h5py = _h5py()
    history = [np.asarray(h) for h in history]
    learned = os.fspath(learned_net).encode("utf-8")

    def fill(f) -> None:
        f.create_dataset("iter", data=np.int32(iter))
        # H5LTmake_dataset_string: scalar, fixed length strlen+1, NUL-terminated, ASCII.
        tid = h5py.h5t.C_S1.copy()
        tid.set_size(len(learned) + 1)
        tid.set_strpad(h5py.h5t.STR_NULLTERM)
        space = h5py.h5s.create(h5py.h5s.SCALAR)
        dsid = h5py.h5d.create(f.id, b"learned_net", tid, space)
        dsid.write(h5py.h5s.ALL, h5py.h5s.ALL, np.array(learned + b"\0", dtype=f"S{len(learned) + 1}"), mtype=tid)
        f.create_dataset("current_step", data=np.int32(current_step))
        g = f.create_group("history")
        for i, h in enumerate(history):
            _save_nd(g, str(i), h)

    _write_atomic(path, fill)


def read_hdf5_solverstate(path: str | os.PathLike) -> dict:
    """Read a Caffe HDF5 solver state: dict with ``iter``, ``learned_net`` (str, "" when absent),
    ``current_step`` and ``history`` (list of float32 arrays, by index)."""
    source = os.fspath(path)
    try:
        return _read_hdf5_solverstate(source)
    except CctError:
        raise
    except _H5_DAMAGE as e:
        raise _damaged(source, e) from None


def _read_hdf5_solverstate(source: str) -> dict:
    with _open_read(source, "HDF5 solver state") as f:
        for key in ("iter", "current_step", "history"):
            if key not in f:
                raise ProtoParseError(f"{source}: no '{key}' in the file; not a Caffe HDF5 solver state")
        learned = ""
        if "learned_net" in f:
            raw = f["learned_net"][()]
            if isinstance(raw, np.ndarray):
                raw = raw.item()
            learned = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
            learned = learned.rstrip("\0")
        hist_group = f["history"]
        names = list(hist_group)
        if not all(n.isdigit() for n in names) or sorted(int(n) for n in names) != list(range(len(names))):
            raise ProtoParseError(f"{source}: history datasets must be named 0..{len(names) - 1}, got {names}")
        history = [_load_nd(hist_group[str(i)], source) for i in range(len(names))]
        return {
            "iter": int(f["iter"][()]),
            "learned_net": learned,
            "current_step": int(f["current_step"][()]),
            "history": history,
        }
