"""Convolution lowerings (CcT): turning a convolution into GEMMs, one strategy per layer.

``get_strategy("type1")`` gives the im2col lowering, ``"type2"``/``"type3"`` CcT's balanced and
expensive-lifting ones; :mod:`cct.lowering.engine` picks one per conv layer with the cost model
(:mod:`cct.lowering.optimizer`) unless the user sets ``layer.lowering``.
"""
from . import direct, fft, type1, type2, type3  # noqa: F401  (registers "type1".."type3", "direct", "fft")
from .base import LoweringStrategy, get_strategy, register_strategy, strategy_names, supports, unregister_strategy
from .geometry import ConvGeometry, ConvSpatial, conv_output_shape, conv_spatial_params, deconv_output_shape
from .im2col import col2im, im2col

__all__ = [
    "ConvGeometry", "ConvSpatial", "LoweringStrategy", "col2im", "conv_output_shape", "conv_spatial_params",
    "deconv_output_shape", "get_strategy", "im2col", "register_strategy", "strategy_names", "supports",
    "unregister_strategy",
]
