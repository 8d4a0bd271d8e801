"""``caffe.Layer``: the base class of Python layers (cct's PythonLayer)."""
from cct.layers.python_layer import PythonLayer as Layer

__all__ = ["Layer"]
