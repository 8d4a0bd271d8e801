"""Generated protobuf module for Caffe's message formats (from proto/caffe.proto)."""
from . import caffe_pb2

__all__ = ["caffe_pb2"]
