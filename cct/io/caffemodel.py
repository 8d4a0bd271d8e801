"""Binary ``.caffemodel`` files (a serialized NetParameter) and weight loading by layer name."""
from __future__ import annotations

import os
from collections import OrderedDict

import numpy as np

from ..errors import CctError
from ..proto import caffe_pb2
from .binary import read_binary_message
from .blobproto import blobproto_to_array

HDF5_EXTENSIONS = (".h5", ".hdf5")


def read_caffemodel(path: str | os.PathLike) -> caffe_pb2.NetParameter:
    """Read a binary ``.caffemodel`` and upgrade legacy (V0/V1, input fields) definitions as Caffe does."""
    from .upgrade import upgrade_net

    net = read_binary_message(path, caffe_pb2.NetParameter(), "binary NetParameter (.caffemodel)")
    return upgrade_net(net, source=os.fspath(path))


def write_caffemodel(path: str | os.PathLike, net_param: caffe_pb2.NetParameter) -> None:
    """Write ``net_param`` as a binary ``.caffemodel`` atomically (readers see the old or the new file)."""
    from .atomic import atomic_write_bytes

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


def read_weights(path: str | os.PathLike) -> OrderedDict[str, list[np.ndarray]]:
    """Read trained weights for ``Net.copy_from``: layer name -> list of float32 arrays, in file order.

    ``.h5``/``.hdf5`` files are read as Caffe's HDF5 weights (:func:`cct.io.hdf5.read_hdf5_weights`; a
    param that a weight-shared layer did not store is ``None`` there), anything else as a binary
    ``.caffemodel`` (upgraded first, as Caffe's CopyTrainedLayersFromBinaryProto does).
    """
    source = os.fspath(path)
    if source.lower().endswith(HDF5_EXTENSIONS):
        from .hdf5 import read_hdf5_weights

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
