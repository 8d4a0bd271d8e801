"""Conversions between numpy arrays and Caffe's BlobProto / BlobProtoVector / binaryproto files."""
from __future__ import annotations

import os

import numpy as np

from ..blob import MAX_BLOB_AXES
from ..errors import CctError
from ..membudget import INT_MAX
from ..proto import caffe_pb2
from .atomic import atomic_write_bytes
from .binary import read_binary_message


def blobproto_shape(proto: caffe_pb2.BlobProto) -> tuple[int, ...]:
    """Shape of a BlobProto as Caffe's ``Blob::FromProto`` reads it: the legacy 4-D dims
    (num, channels, height, width) when any of them is set, else ``shape.dim``. A proto with
    neither is a blob with no axes, shape ``()`` (one value): that is how Caffe writes a 0-d
    blob such as PReLU's ``channel_shared`` slope, whose ``ToProto`` adds no ``shape``."""
    if any(proto.HasField(f) for f in ("num", "channels", "height", "width")):
        return (proto.num, proto.channels, proto.height, proto.width)
    return tuple(int(d) for d in proto.shape.dim)


def check_blobproto(proto: caffe_pb2.BlobProto) -> tuple[int, ...]:
    """Caffe's Blob::FromProto checks; returns the shape. At most 32 axes, no negative dimension, at
    most INT_MAX elements; ``double_data`` (else ``data``) holds exactly one value per element, and so
    does ``double_diff`` (else ``diff``) when present."""
    shape = blobproto_shape(proto)
    if len(shape) > MAX_BLOB_AXES:
        raise CctError(f"BlobProto has {len(shape)} axes, more than a blob's {MAX_BLOB_AXES}")
    count = 1
    for d in shape:
        if d < 0:
            raise CctError(f"BlobProto shape {list(shape)} has a negative dimension")
        count *= d
        if count > INT_MAX:
            raise CctError(f"BlobProto shape {list(shape)}: blob size exceeds INT_MAX")
    data_field = "double_data" if len(proto.double_data) else "data"
    checks = [(data_field, len(getattr(proto, data_field)))]
    if len(proto.double_diff):
        checks.append(("double_diff", len(proto.double_diff)))
    elif len(proto.diff):
        checks.append(("diff", len(proto.diff)))
    for field, n in checks:
        if n != count:
            raise CctError(f"BlobProto {field} holds {n} values but its shape {list(shape)} needs {count}")
    return shape


def blobproto_to_array(proto: caffe_pb2.BlobProto, return_diff: bool = False) -> np.ndarray:
    """The data (or diff) of a BlobProto as a float32 array of its shape (checked as Caffe's
    Blob::FromProto does, :func:`check_blobproto`; a missing diff reads as zeros)."""
    shape = check_blobproto(proto)
    if return_diff:
        values = proto.double_diff if len(proto.double_diff) else proto.diff
        if not len(values):
            return np.zeros(shape, dtype=np.float32)
    else:
        values = proto.double_data if len(proto.double_data) else proto.data
    return np.asarray(values, dtype=np.float32).reshape(shape)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _packed_floats(field_tag: bytes, arr) -> bytes:
    raw = np.ascontiguousarray(np.asarray(arr), dtype="<f4").tobytes()
    return field_tag + _varint(len(raw)) + raw


def array_to_blobproto(arr, diff=None, legacy_4d: bool = False) -> caffe_pb2.BlobProto:
    """A BlobProto holding ``arr`` (and ``diff``); ``legacy_4d`` writes num/channels/height/width.

    The packed float fields are built from the array's bytes (fast for large weights).
    """
    arr = np.asarray(arr)
    parts = [_packed_floats(b"\x2a", arr)]  # field 5: data
    if diff is not None:
        parts.append(_packed_floats(b"\x32", diff))  # field 6: diff
    proto = caffe_pb2.BlobProto()
    proto.ParseFromString(b"".join(parts))
    if legacy_4d:
        dims = (1,) * (4 - arr.ndim) + arr.shape
        proto.num, proto.channels, proto.height, proto.width = dims
    elif arr.ndim:  # Caffe's ToProto writes no shape at all for a blob with no axes
        proto.shape.dim.extend(int(d) for d in arr.shape)
    return proto


def read_binaryproto(path: str | os.PathLike) -> caffe_pb2.BlobProto:
    """Read a ``.binaryproto`` file (e.g. a mean file) as a BlobProto."""
    return read_binary_message(path, caffe_pb2.BlobProto(), "binaryproto")


def write_binaryproto(path: str | os.PathLike, proto: caffe_pb2.BlobProto) -> None:
    """Write a BlobProto to ``path`` atomically."""
    atomic_write_bytes(path, proto.SerializeToString())
