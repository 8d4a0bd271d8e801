"""pycaffe's ``caffe.coord_map``: relate the coordinates of NetSpec tops (e.g. to crop FCN outputs).

A coordinate map is ``(axis, scale, shift)``: output coordinate = input coordinate * scale + shift
(the identity, for pointwise layers, is ``(None, 1, 0)``). Maps are composed along the layers
between two tops; :func:`crop` makes the Crop layer that aligns one top with another.
"""
from __future__ import annotations

import numpy as np

from .net_spec import Top
from .net_spec import layers as L

__all__ = [
    "PASS_THROUGH_LAYERS", "conv_params", "crop_params", "UndefinedMapException", "coord_map",
    "AxisMismatchException", "compose", "inverse", "coord_map_from_to", "crop",
]

PASS_THROUGH_LAYERS = ["AbsVal", "BatchNorm", "Bias", "BNLL", "Dropout", "Eltwise", "ELU", "Log", "LRN", "Exp",
                       "MVN", "Power", "ReLU", "PReLU", "Scale", "Sigmoid", "Split", "TanH", "Threshold"]


def conv_params(fn):
    """(axis, stride, effective kernel extent, pad) of a Convolution/Deconvolution/Im2col/Pooling Function."""
    params = fn.params.get("convolution_param", fn.params)
    axis = params.get("axis", 1)
    ks = np.array(params["kernel_size"], ndmin=1)
    dilation = np.array(params.get("dilation", 1), ndmin=1)
    assert len({"pad_h", "pad_w", "kernel_h", "kernel_w", "stride_h", "stride_w"} & set(fn.params)) == 0, \
        "cropping does not support legacy _h/_w params"
    return (axis, np.array(params.get("stride", 1), ndmin=1), (ks - 1) * dilation + 1,
            np.array(params.get("pad", 0), ndmin=1))


def crop_params(fn):
    """(axis, offset) of a Crop Function, with Caffe's defaults (axis 2, offset 0)."""
    params = fn.params.get("crop_param", fn.params)
    axis = params.get("axis", 2)  # spatial crop of N, C, H, W by default
    offset = np.array(params.get("offset", 0), ndmin=1)
    return axis, offset


class UndefinedMapException(Exception):
    """The layer has no defined coordinate mapping."""


def coord_map(fn):
    """The (axis, scale, shift) coordinate map of one layer (a NetSpec Function)."""
    if fn.type_name in ("Convolution", "Pooling", "Im2col"):
        axis, stride, ks, pad = conv_params(fn)
        return axis, 1 / stride, (pad - (ks - 1) / 2) / stride
    if fn.type_name == "Deconvolution":
        axis, stride, ks, pad = conv_params(fn)
        return axis, stride, (ks - 1) / 2 - pad
    if fn.type_name in PASS_THROUGH_LAYERS:
        return None, 1, 0
    if fn.type_name == "Crop":
        axis, offset = crop_params(fn)
        axis -= 1  # coordinate maps count the axis before the first mapped one (1 for N, C, H, W)
        return axis, 1, -offset
    raise UndefinedMapException


class AxisMismatchException(Exception):
    """Two coordinate maps act on different axes."""


def compose(base_map, next_map):
    """Compose (a1, b1) then (a2, b2): scale a1 * a2, shift a1 * b2 + b1."""
    ax1, a1, b1 = base_map
    ax2, a2, b2 = next_map
    if ax1 is None:
        ax = ax2
    elif ax2 is None or ax1 == ax2:
        ax = ax1
    else:
        raise AxisMismatchException
    return ax, a1 * a2, a1 * b2 + b1


def inverse(coord_map):
    """The inverse map (1 / a, -b / a)."""
    ax, a, b = coord_map
    return ax, 1 / a, -b / a


def _collect_bottoms(top: Top):
    # every bottom maps the same way, except Crop: only its first (cropped) bottom is walked
    bottoms = top.fn.inputs
    if top.fn.type_name == "Crop":
        bottoms = bottoms[:1]
    return bottoms


def coord_map_from_to(top_from: Top, top_to: Top):
    """The coordinate map from ``top_from`` to ``top_to``: walks back from both to a common ancestor."""
    from_maps = {top_from: (None, 1, 0)}
    frontier = {top_from}
    while frontier:
        top = frontier.pop()
        try:
            for bottom in _collect_bottoms(top):
                from_maps[bottom] = compose(from_maps[top], coord_map(top.fn))
                frontier.add(bottom)
        except UndefinedMapException:
            pass

    to_maps = {top_to: (None, 1, 0)}
    frontier = {top_to}
    while frontier:
        top = frontier.pop()
        if top in from_maps:
            return compose(to_maps[top], inverse(from_maps[top]))
        try:
            for bottom in _collect_bottoms(top):
                to_maps[bottom] = compose(to_maps[top], coord_map(top.fn))
                frontier.add(bottom)
        except UndefinedMapException:
            continue
    raise RuntimeError("Could not compute map between tops; are they connected by spatial layers?")


def crop(top_from: Top, top_to: Top) -> Top:
    """A Crop layer cropping ``top_from`` to ``top_to``, its axis and offsets derived from their coordinate map."""
    ax, a, b = coord_map_from_to(top_from, top_to)
    assert (a == 1).all(), f"scale mismatch on crop (a = {a})"
    assert (b <= 0).all(), f"cannot crop negative width (b = {b})"
    assert (np.round(b) == b).all(), f"cannot crop noninteger width (b = {b})"
    return L.Crop(top_from, top_to, crop_param=dict(axis=ax + 1,  # +1 for the first cropping dim
                                                    offset=list(-np.round(b).astype(int))))
