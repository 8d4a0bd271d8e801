"""Caffe's weight fillers, drawing from the generator they are given (a layer's: its net's random source,
:mod:`cct.random_source`)."""
from __future__ import annotations

import math

import numpy as np

from .blob import Blob
from .errors import CctError
from .proto import caffe_pb2

FILLER_TYPES = ("constant", "uniform", "gaussian", "positive_unitball", "xavier", "msra", "bilinear")


def _fan_n(shape: tuple[int, ...], variance_norm: int) -> float:
    count = int(np.prod(shape))
    fan_in = count / shape[0]
    fan_out = count / shape[1] if len(shape) > 1 else count
    if variance_norm == caffe_pb2.FillerParameter.AVERAGE:
        return (fan_in + fan_out) / 2.0
    if variance_norm == caffe_pb2.FillerParameter.FAN_OUT:
        return fan_out
    return fan_in


def filler_values(param: caffe_pb2.FillerParameter, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Draw an array of ``shape`` (float64) from ``rng`` as Caffe's filler ``param.type`` would."""
    kind = param.type
    shape = tuple(int(d) for d in shape)
    if kind == "constant":
        return np.full(shape, param.value, dtype=np.float64)
    if kind == "uniform":
        return rng.uniform(param.min, param.max, size=shape)
    if kind == "gaussian":
        out = rng.normal(param.mean, param.std, size=shape)
        if param.sparse >= 0:
            if len(shape) < 1:
                raise CctError("gaussian filler: sparse needs a blob with at least one axis")
            p = param.sparse / shape[0]
            out *= rng.random(shape) < p
        return out
    if kind == "positive_unitball":
        out = rng.random(shape)
        num = shape[0] if shape else 1
        flat = out.reshape(num, -1)
        flat /= flat.sum(axis=1, keepdims=True)
        return out
    if kind == "xavier":
        scale = math.sqrt(3.0 / _fan_n(shape, param.variance_norm))
        return rng.uniform(-scale, scale, size=shape)
    if kind == "msra":
        std = math.sqrt(2.0 / _fan_n(shape, param.variance_norm))
        return rng.normal(0.0, std, size=shape)
    if kind == "bilinear":
        if len(shape) != 4 or shape[2] != shape[3]:
            raise CctError(f"bilinear filler needs a 4-D blob with square kernels, got {list(shape)}")
        width = shape[3]
        f = math.ceil(width / 2.0)
        c = (width - 1) / (2.0 * f)
        idx = np.arange(width)
        w1 = 1 - np.abs(idx / f - c)
        kernel = np.outer(w1, w1)
        return np.broadcast_to(kernel, shape).copy()
    raise CctError(f"unknown filler type '{kind}' (known: {', '.join(FILLER_TYPES)})")


def fill(blob: Blob, param: caffe_pb2.FillerParameter | None, rng: np.random.Generator) -> None:
    """Fill ``blob.data`` in place, drawing from ``rng``; ``None`` means Caffe's default constant 0 filler."""
    if param is None:
        param = caffe_pb2.FillerParameter()
    if param.type == "constant":  # no float64 temporary (VGG-sized fc layers: ~0.5 GiB each)
        blob.data[...] = blob.dtype.type(param.value)
        return
    values = filler_values(param, blob.shape, rng)
    blob.data[...] = blob.xp.asarray(values.astype(blob.dtype))
