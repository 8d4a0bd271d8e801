"""Binary ``.caffemodel`` files (a serialized NetParameter) and weight loading by layer name."""
from __future__ import annotations

import os
from collections import OrderedDict

import numpy as np

from ..errors import CctError
from ..proto import caffe_pb2
from .atomic import atomic_write_bytes
from .binary import read_binary_message
from .blobproto import blobproto_to_array
from .hdf5 import read_hdf5_weights
from .upgrade import upgrade_net

_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def is_hdf5(path: str | os.PathLike) -> bool:
    """Whether ``path`` is an HDF5 file, by content as HDF5's ``H5Fis_hdf5`` decides (the superblock
    signature at offset 0, 512, 1024, 2048, ...), whatever the file is called."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            offset = 0
            while offset + len(_HDF5_SIGNATURE) <= size:
                f.seek(offset)
                if f.read(len(_HDF5_SIGNATURE)) == _HDF5_SIGNATURE:
                    return True
                offset = 512 if offset == 0 else offset * 2
    except OSError:
        return False
    return False


def read_caffemodel(path: str | os.PathLike) -> caffe_pb2.NetParameter:
    """Read a binary ``.caffemodel`` and upgrade legacy (V0/V1, input fields) definitions as Caffe does."""
    net = read_binary_message(path, caffe_pb2.NetParameter(), "binary NetParameter (.caffemodel)")
    return upgrade_net(net, source=os.fspath(path))


def write_caffemodel(path: str | os.PathLike, net_param: caffe_pb2.NetParameter) -> None:
    """Write ``net_param`` as a binary ``.caffemodel`` atomically (readers see the old or the new file)."""
    atomic_write_bytes(path, net_param.SerializeToString())


def weights_from_net_param(net: caffe_pb2.NetParameter) -> OrderedDict[str, list[np.ndarray]]:
    """layer name -> its blobs as float32 arrays, for every layer of an (upgraded) NetParameter, in order.

    Layers without blobs are listed with an empty list (Caffe checks the blob count of every layer whose
    name matches). Legacy blobs (num/channels/height/width, no ``shape``) keep their 4-D shape: Caffe's
    Blob::ShapeEquals accepts them for a target whose shape, left-padded with 1s to 4 axes, is equal.
    """
    out: OrderedDict[str, list[np.ndarray]] = OrderedDict()
    for layer in net.layer:
        try:
            out[layer.name] = [blobproto_to_array(b) for b in layer.blobs]
        except CctError as e:
            raise CctError(f"layer '{layer.name}': {e}") from None
    return out


def read_weights(path: str | os.PathLike, format: str | None = None) -> OrderedDict[str, list[np.ndarray]]:
    """Read trained weights for ``Net.copy_from``: layer name -> list of float32 arrays, in file order.

    HDF5 files (by content, :func:`is_hdf5`, as Caffe's CopyTrainedLayersFrom decides) are read as
    Caffe's HDF5 weights (:func:`cct.io.hdf5.read_hdf5_weights`; a param that a weight-shared layer did
    not store is ``None`` there), anything else as a binary ``.caffemodel`` (upgraded first, as Caffe's
    CopyTrainedLayersFromBinaryProto does). ``format`` ``"hdf5"`` or ``"binaryproto"`` insists on one.
    """
    source = os.fspath(path)
    if format not in (None, "hdf5", "binaryproto"):
        raise ValueError(f"unknown weights format {format!r} (hdf5 or binaryproto)")
    if format == "hdf5" and os.path.isfile(source) and not is_hdf5(source):
        raise CctError(f"{source}: not an HDF5 file (HDF5 weights were asked for)")
    if format == "hdf5" or (format is None and is_hdf5(source)):
        return read_hdf5_weights(source)
    net = read_caffemodel(source)
    try:
        return weights_from_net_param(net)
    except CctError as e:
        raise CctError(f"{source}: {e}") from None


def legacy_shape_equals(source_shape: tuple[int, ...], target_shape: tuple[int, ...]) -> bool:
    """Caffe's Blob::ShapeEquals for a legacy (num, channels, height, width) source blob: the target
    (at most 4 axes) left-padded with 1s must equal it."""
    if len(source_shape) != 4 or len(target_shape) > 4:
        return False
    return (1,) * (4 - len(target_shape)) + tuple(target_shape) == tuple(source_shape)
