"""Caffe file formats: prototxt, caffemodel, HDF5 weights, binaryproto, legacy upgrades."""
from .blobproto import (
    array_to_blobproto,
    blobproto_shape,
    blobproto_to_array,
    read_binaryproto,
    write_binaryproto,
)
from .prototxt import parse_text, read_net_prototxt, read_solver_prototxt, read_text_file, to_text, write_text_file

__all__ = [
    "array_to_blobproto", "blobproto_shape", "blobproto_to_array", "read_binaryproto", "write_binaryproto",
    "parse_text", "read_net_prototxt", "read_solver_prototxt", "read_text_file", "to_text", "write_text_file",
]
