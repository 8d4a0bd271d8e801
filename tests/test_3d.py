"""3-D (5-D blob) convolution and pooling: every strategy that supports volumes, and 3-D Pooling,
against loop references, with gradient checks through the layers (issue 12 item 7)."""
import itertools

import numpy as np
import pytest

from cct.io.prototxt import parse_text
from cct.layers import create_layer
from cct.lowering import get_strategy
from cct.proto import caffe_pb2
from cct.testing import check_gradient, make_blob


def layer(text):
    return create_layer(parse_text(text, caffe_pb2.LayerParameter()))


def naive_pool3d(x, method, k, p, s):
    """Caffe's pooling rules per axis (ceil, windows clipped to the input; AVE over the padded-clipped area)."""
    n, c = x.shape[:2]
    ins = x.shape[2:]
    outs = []
    for i in ins:
        o = int(np.ceil((i + 2 * p - k) / s)) + 1
        if p and (o - 1) * s >= i + p:
            o -= 1
        outs.append(o)
    y = np.zeros((n, c) + tuple(outs))
    for o in itertools.product(*(range(v) for v in outs)):
        lo = [oi * s - p for oi in o]
        hi = [min(l0 + k, i + p) for l0, i in zip(lo, ins)]
        area = np.prod([h - l0 for h, l0 in zip(hi, lo)])
        sl = tuple(slice(max(l0, 0), min(h, i)) for l0, h, i in zip(lo, hi, ins))
        win = x[(slice(None), slice(None)) + sl].reshape(n, c, -1)
        y[(slice(None), slice(None)) + o] = win.max(axis=2) if method == "MAX" else win.sum(axis=2) / area
    return y


@pytest.mark.parametrize("method", ["MAX", "AVE"])
@pytest.mark.parametrize("k,p,s", [(2, 0, 2), (3, 1, 2), (3, 0, 1)])
def test_pool3d_matches_naive_and_gradient(method, k, p, s):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 5, 6, 4))
    lay = layer(f'name: "pool" type: "Pooling" pooling_param {{ pool: {method} kernel_size: {k} pad: {p} '
                f'stride: {s} }}')
    bottom, top = [make_blob(x)], [make_blob(np.zeros(1))]
    lay.setup(bottom, top)
    lay.forward(bottom, top)
    np.testing.assert_allclose(top[0].data, naive_pool3d(x, method, k, p, s), rtol=1e-12, atol=1e-12)
    check_gradient(lay, [make_blob(rng.standard_normal((2, 2, 4, 5, 3)))], [make_blob(np.zeros(1))],
                   stepsize=1e-4, threshold=1e-6)


def test_pool3d_mask_top_is_flat_input_index():
    x = np.random.default_rng(2).standard_normal((1, 2, 4, 4, 4))
    lay = layer('name: "pool" type: "Pooling" pooling_param { pool: MAX kernel_size: 2 stride: 2 }')
    bottom, top = [make_blob(x)], [make_blob(np.zeros(1)), make_blob(np.zeros(1))]
    lay.setup(bottom, top)
    lay.forward(bottom, top)
    flat = x.reshape(1, 2, -1)
    idx = top[1].data.astype(int).reshape(1, 2, -1)
    np.testing.assert_array_equal(np.take_along_axis(flat, idx, axis=2).reshape(top[0].shape), top[0].data)


def test_pool3d_rejects_h_w_forms():
    lay = layer('name: "pool" type: "Pooling" pooling_param { pool: MAX kernel_h: 2 kernel_w: 2 }')
    with pytest.raises(Exception, match="3-D pooling"):
        lay.setup([make_blob(np.zeros((1, 1, 4, 4, 4)))], [make_blob(np.zeros(1))])


@pytest.mark.parametrize("name", ["type1", "type2", "type3", "direct", "fft"])
def test_conv3d_gradient_through_layer(name):
    lay = layer('name: "conv" type: "Convolution" convolution_param { num_output: 3 kernel_size: 3 pad: 1 '
                'stride: 2 weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.5 } }')
    lay.lowering = get_strategy(name)
    rng = np.random.default_rng(3)
    check_gradient(lay, [make_blob(rng.standard_normal((2, 2, 4, 5, 4)))], [make_blob(np.zeros(1))],
                   stepsize=1e-4, threshold=1e-6)


def test_conv3d_planned_by_the_optimizer_matches_type1():
    """With the optimizer free to choose, a 3-D layer's output equals type 1's."""
    text = ('name: "conv" type: "Convolution" convolution_param { num_output: 4 kernel_size: 3 '
            'weight_filler { type: "gaussian" std: 0.5 } }')
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 6, 6, 6)).astype(np.float32)
    free, fixed = layer(text), layer(text)
    fixed.lowering = get_strategy("type1")
    tops = []
    for lay in (free, fixed):
        bottom, top = [make_blob(x)], [make_blob(np.zeros(1, np.float32))]
        lay.setup(bottom, top)
        lay.blobs[0].data[...] = rng.standard_normal(lay.blobs[0].shape) if not tops else free.blobs[0].data
        lay.reshape(bottom, top)
        lay.forward(bottom, top)
        tops.append(top[0].data.copy())
    assert tops[0].shape == (2, 4, 4, 4, 4)
    np.testing.assert_allclose(tops[0], tops[1], rtol=1e-4, atol=1e-4)
