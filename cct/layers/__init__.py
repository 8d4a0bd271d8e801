"""The layer library: one module per layer family, a registry keyed by Caffe's type string.

Find any Caffe layer by its type name with ``layer_class("Convolution")``.
"""
from . import (  # noqa: F401  (importing registers the layers)
    activation,
    conv,
    data,
    hdf5_output,
    inner_product,
    input,
    loss,
    lrn,
    norm,
    pooling,
    python_layer,
    recurrent,
    spp,
    structure,
    window_data,
)
from .base import Layer, create_layer, layer_class, layer_type_list, register

__all__ = ["Layer", "create_layer", "layer_class", "layer_type_list", "register"]
