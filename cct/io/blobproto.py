"""Conversions between numpy arrays and Caffe's BlobProto / BlobProtoVector / binaryproto files."""
from __future__ import annotations

import os

import numpy as np

from ..errors import CctError, ProtoParseError
from ..proto import caffe_pb2


def blobproto_shape(proto: caffe_pb2.BlobProto) -> tuple[int, ...]:
    """Shape of a BlobProto: ``shape.dim`` or, for legacy protos, (num, channels, height, width)."""
    if proto.HasField("shape"):
        return tuple(int(d) for d in proto.shape.dim)
    if any(proto.HasField(f) for f in ("num", "channels", "height", "width")):
        return (proto.num, proto.channels, proto.height, proto.width)
    # No shape at all: a flat vector of whatever data it holds.
    n = len(proto.data) or len(proto.double_data)
    return (n,) if n else (0,)


def blobproto_to_array(proto: caffe_pb2.BlobProto, return_diff: bool = False) -> np.ndarray:
    """The data (or diff) of a BlobProto as a float32 array of its shape."""
    shape = blobproto_shape(proto)
    if return_diff:
        values = proto.double_diff if len(proto.double_diff) else proto.diff
    else:
        values = proto.double_data if len(proto.double_data) else proto.data
    arr = np.asarray(values, dtype=np.float32)
    count = int(np.prod(shape, dtype=np.int64))
    if arr.size != count:
        if arr.size == 0 and return_diff:
            return np.zeros(shape, dtype=np.float32)
        raise CctError(f"BlobProto holds {arr.size} values but its shape {list(shape)} needs {count}")
    return arr.reshape(shape)


def array_to_blobproto(arr, diff=None, legacy_4d: bool = False) -> caffe_pb2.BlobProto:
    """A BlobProto holding ``arr`` (and ``diff``); ``legacy_4d`` writes num/channels/height/width."""
    arr = np.asarray(arr)
    proto = caffe_pb2.BlobProto()
    if legacy_4d:
        dims = (1,) * (4 - arr.ndim) + arr.shape
        proto.num, proto.channels, proto.height, proto.width = dims
    else:
        proto.shape.dim.extend(int(d) for d in arr.shape)
    proto.data.extend(arr.astype(np.float32).ravel().tolist())
    if diff is not None:
        proto.diff.extend(np.asarray(diff, dtype=np.float32).ravel().tolist())
    return proto


def read_binaryproto(path: str | os.PathLike) -> caffe_pb2.BlobProto:
    """Read a ``.binaryproto`` file (e.g. a mean file) as a BlobProto."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise CctError(f"cannot read binaryproto '{path}': {e.strerror}") from None
    proto = caffe_pb2.BlobProto()
    try:
        proto.ParseFromString(raw)
    except Exception as e:
        raise ProtoParseError(f"{path}: not a valid BlobProto ({e})") from None
    return proto


def write_binaryproto(path: str | os.PathLike, proto: caffe_pb2.BlobProto) -> None:
    """Write a BlobProto to ``path`` atomically."""
    from .atomic import atomic_write_bytes

    atomic_write_bytes(path, proto.SerializeToString())
