"""The layer library: one module per layer family, a registry keyed by Caffe's type string.

Find any Caffe layer by its type name with ``layer_class("Convolution")``.
"""
from . import (  # noqa: F401  (importing registers the layers)
    activation,
    conv,
    data,
    eltwise,
    embed,
    hdf5_output,
    inner_product,
    input,
    loss,
    lrn,
    norm,
    parameter,
    pooling,
    python_layer,
    recurrent,
    reduction,
    reshaping,
    routing,
    selection,
    silence,
    spp,
    window_data,
)
from .base import Layer, create_layer, layer_class, layer_type_list, register

__all__ = ["Layer", "create_layer", "layer_class", "layer_type_list", "register"]
