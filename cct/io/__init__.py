"""Caffe file formats: prototxt, caffemodel, HDF5 weights, binaryproto, legacy upgrades."""
from .blobproto import (
    array_to_blobproto,
    blobproto_shape,
    blobproto_to_array,
    read_binaryproto,
    write_binaryproto,
)
from .caffemodel import (
    legacy_shape_equals,
    read_caffemodel,
    read_weights,
    weights_from_net_param,
    write_caffemodel,
)
from .hdf5 import read_hdf5_solverstate, read_hdf5_weights, write_hdf5_solverstate, write_hdf5_weights
from .prototxt import parse_text, read_net_prototxt, read_solver_prototxt, read_text_file, to_text, write_text_file
from .upgrade import upgrade_net, upgrade_solver

__all__ = [
    "array_to_blobproto", "blobproto_shape", "blobproto_to_array", "read_binaryproto", "write_binaryproto",
    "parse_text", "read_net_prototxt", "read_solver_prototxt", "read_text_file", "to_text", "write_text_file",
    "legacy_shape_equals", "read_caffemodel", "read_weights", "weights_from_net_param",
    "write_caffemodel",
    "read_hdf5_solverstate", "read_hdf5_weights", "write_hdf5_solverstate", "write_hdf5_weights",
    "upgrade_net", "upgrade_solver",
]
