"""Solver snapshots: Caffe's files plus cct's own ``.cctstate`` (what Caffe does not restore).

For iteration N and ``snapshot_prefix`` P Caffe writes

* BINARYPROTO (default): ``P_iter_N.caffemodel`` (a NetParameter with the weights) and
  ``P_iter_N.solverstate`` (a SolverState: ``iter``, ``learned_net`` = the model file's path,
  ``current_step``, one ``history`` BlobProto per history blob);
* HDF5: ``P_iter_N.caffemodel.h5`` and ``P_iter_N.solverstate.h5`` (same content).

Both are readable by BVLC Caffe and by cct. cct also writes ``P_iter_N.cctstate`` (JSON): the state
of the solver's host random source (``solver.random_source``, :mod:`cct.random_source`) and the read
position of every data layer that offers ``get_read_state()`` (train net and test nets). Restoring a
solverstate also restores the ``.cctstate`` found beside it, so that N iterations + snapshot + resume
+ M iterations give the same weights, bit for bit, as N + M iterations in one run (Caffe itself
restarts its databases from the beginning on resume). Without a ``.cctstate`` (e.g. a Caffe snapshot)
resuming works as in Caffe.

Every file is written to a temporary name and renamed (``cct.io.atomic``), so an interrupted
snapshot never leaves a torn file behind.
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from ..device.driver import to_host
from ..errors import CctError, ProtoParseError
from ..io.atomic import atomic_write_bytes
from ..io.binary import read_binary_message
from ..io.blobproto import array_to_blobproto, blobproto_to_array
from ..io.hdf5 import read_hdf5_solverstate, write_hdf5_solverstate
from ..proto import caffe_pb2

CCTSTATE_EXT = ".cctstate"
CCTSTATE_FORMAT = 1


def snapshot_filename(prefix: str, it: int, extension: str) -> str:
    """Caffe's ``SnapshotFilename``: ``<prefix>_iter_<N><extension>``."""
    return f"{prefix}_iter_{int(it)}{extension}"


def is_hdf5_path(path: str) -> bool:
    """Caffe decides the solverstate format by the ``.h5`` suffix."""
    return os.fspath(path).endswith(".h5")


def write_solverstate(path: str, it: int, learned_net: str, current_step: int, history: list,
                      hdf5: bool = False) -> None:
    """Write a SolverState (binary proto, or Caffe's HDF5 layout when ``hdf5``) atomically."""
    arrays = [to_host(h) for h in history]
    if hdf5:
        write_hdf5_solverstate(path, it, learned_net, current_step, arrays)
        return
    state = caffe_pb2.SolverState()
    state.iter = int(it)
    state.learned_net = learned_net
    state.current_step = int(current_step)
    for h in arrays:
        state.history.add().CopyFrom(array_to_blobproto(h))
    atomic_write_bytes(path, state.SerializeToString())


def read_solverstate(path: str) -> dict:
    """Read a ``.solverstate`` (binary) or ``.solverstate.h5``: dict with ``iter``, ``learned_net``
    ("" when absent), ``current_step`` and ``history`` (list of float32 arrays)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CctError(f"cannot read solver state '{path}': no such file")
    if is_hdf5_path(path):
        return read_hdf5_solverstate(path)
    state = read_binary_message(path, caffe_pb2.SolverState(), "SolverState (.solverstate)")
    try:
        history = [blobproto_to_array(b) for b in state.history]
    except CctError as e:
        raise CctError(f"{path}: history blob: {e}") from None
    return {
        "iter": int(state.iter),
        "learned_net": state.learned_net if state.HasField("learned_net") else "",
        "current_step": int(state.current_step),
        "history": history,
    }


def cctstate_path(solverstate_path: str) -> str:
    """The ``.cctstate`` file that belongs to a ``.solverstate`` / ``.solverstate.h5``."""
    p = os.fspath(solverstate_path)
    for ext in (".solverstate.h5", ".solverstate"):
        if p.endswith(ext):
            return p[: -len(ext)] + CCTSTATE_EXT
    return p + CCTSTATE_EXT


def _encode(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.tolist(), "dtype": str(obj.dtype), "shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, bytes):
        return {"__bytes__": obj.hex()}
    if isinstance(obj, dict):
        return {str(k): _encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_encode(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise CctError(f"cannot store {type(obj).__name__} in a .cctstate file (read state must be JSON-like)")


def _decode(obj: Any) -> Any:
    if isinstance(obj, dict):
        if "__ndarray__" in obj:
            return np.asarray(obj["__ndarray__"], dtype=obj["dtype"]).reshape(obj["shape"])
        if "__bytes__" in obj:
            return bytes.fromhex(obj["__bytes__"])
        return {k: _decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    return obj


def write_cctstate(path: str, state: dict) -> None:
    """Write cct's extra state (RNG, data-layer read positions) as JSON, atomically."""
    payload = {"format": CCTSTATE_FORMAT, **_encode(state)}
    atomic_write_bytes(path, (json.dumps(payload, indent=1, sort_keys=True) + "\n").encode("utf-8"))


def read_cctstate(path: str) -> dict:
    """Read a ``.cctstate`` file written by :func:`write_cctstate`."""
    try:
        with open(path, encoding="utf-8") as f:
            payload = json.load(f)
    except OSError as e:
        raise CctError(f"cannot read '{path}': {e.strerror}") from None
    except ValueError as e:
        raise ProtoParseError(f"{path}: not a valid .cctstate file: {e}") from None
    if not isinstance(payload, dict) or payload.get("format") != CCTSTATE_FORMAT:
        raise ProtoParseError(f"{path}: unsupported .cctstate format {payload.get('format')!r}"
                              if isinstance(payload, dict) else f"{path}: not a .cctstate file")
    return _decode(payload)
