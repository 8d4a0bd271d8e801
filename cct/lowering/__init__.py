"""Convolution lowerings (CcT): turning a convolution into GEMMs, one strategy per layer.

``get_strategy("type1")`` gives the im2col lowering; the engine may register more
(``register_strategy``) and swap a conv layer's ``lowering`` attribute per layer.
"""
from . import type1  # noqa: F401  (registers "type1")
from .base import LoweringStrategy, get_strategy, register_strategy, strategy_names
from .geometry import ConvGeometry, ConvSpatial, conv_output_shape, conv_spatial_params, deconv_output_shape
from .im2col import col2im, im2col

__all__ = [
    "ConvGeometry", "ConvSpatial", "LoweringStrategy", "col2im", "conv_output_shape", "conv_spatial_params",
    "deconv_output_shape", "get_strategy", "im2col", "register_strategy", "strategy_names",
]
