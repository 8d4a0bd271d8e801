"""Alias of cct.proto.caffe_pb2 so that ``from caffe.proto import caffe_pb2`` works as in pycaffe."""
import sys

from cct.proto import caffe_pb2 as _pb2

sys.modules[__name__] = _pb2
