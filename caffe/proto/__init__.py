"""``caffe.proto.caffe_pb2``: cct's generated Caffe protobuf module."""
from cct.proto import caffe_pb2

__all__ = ["caffe_pb2"]
