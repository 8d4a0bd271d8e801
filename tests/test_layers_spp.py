"""SPP layer (cct/layers/spp.py): bins against a direct reference, Caffe's level geometry,
float64 gradient checks, the unflattened pyramid_height 1 top, errors."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cct.blob import Blob
from cct.errors import LayerError
from cct.io.prototxt import parse_text
from cct.layers import create_layer
from cct.layers.spp import spp_pooling_param
from cct.proto import caffe_pb2
from cct.testing import check_gradient, make_blob


def make_layer(text: str, name: str = "spp"):
    lp = caffe_pb2.LayerParameter()
    parse_text(f'name: "{name}" type: "SPP" ' + text, lp)
    return create_layer(lp)


def run(layer, x):
    bottom, top = [make_blob(x)], [Blob((), dtype=x.dtype)]
    layer.setup(bottom, top)
    layer.forward(bottom, top)
    return bottom, top


def spp_reference(x, levels, reduce):
    """Per level, 2^l x 2^l bins of the padded grid: kernel ceil(H / 2^l) at stride kernel,
    pad (kernel 2^l - H + 1) / 2, windows clipped to the input (MAX) / padded input (AVE)."""
    n, c, h, w = x.shape
    outs = []
    for level in range(levels):
        bins = 2 ** level
        kh, kw = math.ceil(h / bins), math.ceil(w / bins)
        ph, pw = (kh * bins - h + 1) // 2, (kw * bins - w + 1) // 2
        oh = [i for i in range(bins + 1) if i * kh - ph < h and (i == 0 or i * kh < h + ph)]
        ow = [j for j in range(bins + 1) if j * kw - pw < w and (j == 0 or j * kw < w + pw)]
        out = np.zeros((n, c, len(oh), len(ow)))
        for a, i in enumerate(oh):
            for b, j in enumerate(ow):
                h0, w0 = i * kh - ph, j * kw - pw
                win = x[:, :, max(h0, 0):min(h0 + kh, h), max(w0, 0):min(w0 + kw, w)]
                if reduce == "max":
                    out[:, :, a, b] = win.max(axis=(2, 3))
                else:
                    area = (min(h0 + kh, h + ph) - h0) * (min(w0 + kw, w + pw) - w0)
                    out[:, :, a, b] = win.sum(axis=(2, 3)) / area
        outs.append(out.reshape(n, -1))
    return np.concatenate(outs, axis=1)


@pytest.mark.parametrize("shape,levels", [((2, 3, 7, 6), 2), ((1, 1, 9, 13), 3), ((1, 1, 8, 8), 3)])
def test_spp_max_matches_reference_and_gradient(shape, levels):
    x = np.random.default_rng(0).standard_normal(shape)
    layer = make_layer(f"spp_param {{ pyramid_height: {levels} pool: MAX }}")
    bottom, top = run(layer, x)
    ref = spp_reference(x, levels, "max")
    assert top[0].shape == ref.shape
    np.testing.assert_allclose(top[0].data, ref, rtol=1e-12)
    check_gradient(layer, bottom, top, setup=False)


def test_spp_ave_matches_reference_and_gradient():
    x = np.random.default_rng(1).standard_normal((1, 2, 9, 6))
    layer = make_layer("spp_param { pyramid_height: 3 pool: AVE }")
    bottom, top = run(layer, x)
    np.testing.assert_allclose(top[0].data, spp_reference(x, 3, "ave"), rtol=1e-12)
    check_gradient(layer, bottom, top, setup=False)


def test_spp_level_geometry_is_caffes():
    p = spp_pooling_param(1, 7, 6, caffe_pb2.SPPParameter.MAX)
    assert (p.kernel_h, p.kernel_w, p.stride_h, p.stride_w, p.pad_h, p.pad_w) == (4, 3, 4, 3, 1, 0)
    p = spp_pooling_param(2, 13, 9, caffe_pb2.SPPParameter.AVE)
    assert (p.kernel_h, p.kernel_w, p.pad_h, p.pad_w, p.pool) == (4, 3, 2, 2, caffe_pb2.PoolingParameter.AVE)


def test_spp_height_one_keeps_pooling_shape_and_follows_input_size():
    layer = make_layer("spp_param { pyramid_height: 1 }")
    x = np.random.default_rng(2).standard_normal((2, 3, 5, 4))
    bottom, top = run(layer, x)
    assert top[0].shape == (2, 3, 1, 1)  # Caffe hands out the single Pooling top unflattened
    np.testing.assert_array_equal(top[0].data[:, :, 0, 0], x.max(axis=(2, 3)))
    layer2 = make_layer("spp_param { pyramid_height: 2 }")
    bottom, top = run(layer2, x)
    bigger = [make_blob(np.random.default_rng(3).standard_normal((1, 3, 9, 9)))]
    layer2.reshape(bigger, top)
    layer2.forward(bigger, top)
    np.testing.assert_allclose(top[0].data, spp_reference(bigger[0].data, 2, "max"))


def test_spp_stochastic_train_samples_within_bins():
    x = np.random.default_rng(4).random((1, 2, 8, 8)) + 0.1  # no padding at 8x8, 2 levels
    layer = make_layer("spp_param { pyramid_height: 2 pool: STOCHASTIC }")
    _, top = run(layer, x)
    ref_max, ref_min = spp_reference(x, 2, "max"), -spp_reference(-x, 2, "max")
    assert top[0].shape == (1, 10)
    assert np.all(top[0].data <= ref_max) and np.all(top[0].data >= ref_min)


def test_spp_errors_name_layer():
    x = np.zeros((1, 1, 7, 7))
    with pytest.raises(LayerError, match="spp9.*level 1.*Padding implemented only"):
        create = make_layer("spp_param { pyramid_height: 2 pool: STOCHASTIC }", name="spp9")
        run(create, x)
    with pytest.raises(LayerError, match="spp9.*pyramid_height"):
        run(make_layer("spp_param { pool: MAX }", name="spp9"), x)
    with pytest.raises(LayerError, match="spp9.*4 axes"):
        run(make_layer("spp_param { pyramid_height: 2 }", name="spp9"), np.zeros((2, 3, 4)))
