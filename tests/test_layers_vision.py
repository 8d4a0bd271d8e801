"""Vision layers: Convolution, Deconvolution, Im2col, Pooling, LRN, InnerProduct.

Forward values against naive loops written from Caffe's definitions, float64 gradient checks
of every bottom and parameter, and Caffe's configuration errors.
"""
import itertools
import logging
import math

import numpy as np
import pytest
from naive import naive_conv

from cct import rng
from cct.blob import Blob
from cct.errors import CctError
from cct.io.prototxt import parse_text
from cct.layers import create_layer
from cct.lowering import LoweringStrategy, get_strategy
from cct.proto import caffe_pb2
from cct.testing import check_gradient, make_blob

TRAIN, TEST = caffe_pb2.TRAIN, caffe_pb2.TEST
FLT_MAX = float(np.finfo(np.float32).max)


def make_layer(text: str, phase: int = TRAIN, name: str = "l"):
    lp = caffe_pb2.LayerParameter()
    parse_text(text, lp)
    lp.name = name
    lp.phase = phase
    return create_layer(lp)


def rand(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def distinct(shape, seed=0, spacing=0.05):
    """Values that are pairwise at least ``spacing`` apart (no MAX ties, even under perturbation)."""
    n = int(np.prod(shape))
    return (np.random.default_rng(seed).permutation(n) - n / 2).reshape(shape) * spacing


def run(text, xs, ntop=1, phase=TRAIN, seed=3):
    """Set up and forward a layer on float arrays ``xs``; returns (layer, bottoms, tops)."""
    layer = make_layer(text, phase)
    bottom = [make_blob(x) for x in xs]
    top = [Blob((), dtype=xs[0].dtype) for _ in range(ntop)]
    rng.set_random_seed(seed)
    layer.setup(bottom, top)
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    return layer, bottom, top


def gradcheck(text, xs, ntop=1, phase=TRAIN, **kw):
    layer = make_layer(text, phase)
    bottom = [make_blob(x) for x in xs]
    top = [Blob((), dtype=np.float64) for _ in range(ntop)]
    check_gradient(layer, bottom, top, **kw)
    return layer


# -- naive references --------------------------------------------------------------------------------
def naive_deconv(x, w, b, pad, stride, dil, group):
    """Transposed convolution by scattering: weights (C_in, C_out/group, kh, kw)."""
    n, c, h, wd = x.shape
    _, og, kh, kw = w.shape
    (ph, pw), (sh, sw), (dh, dw) = pad, stride, dil
    oh = sh * (h - 1) + dh * (kh - 1) + 1 - 2 * ph
    ow = sw * (wd - 1) + dw * (kw - 1) + 1 - 2 * pw
    cg = c // group
    y = np.zeros((n, og * group, oh, ow))
    for i, ci, a, bb in itertools.product(range(n), range(c), range(h), range(wd)):
        g = ci // cg
        for oo, p, q in itertools.product(range(og), range(kh), range(kw)):
            r, col = a * sh - ph + p * dh, bb * sw - pw + q * dw
            if 0 <= r < oh and 0 <= col < ow:
                y[i, g * og + oo, r, col] += x[i, ci, a, bb] * w[ci, oo, p, q]
    if b is not None:
        y += b[None, :, None, None]
    return y


def caffe_pooled(size, k, p, s, any_pad):
    out = int(math.ceil((size + 2 * p - k) / s)) + 1
    if any_pad and (out - 1) * s >= size + p:
        out -= 1
    return out


def naive_pool(x, method, kernel, pad, stride):
    """Caffe's CPU pooling loops; returns (top, flat argmax index or None)."""
    n, c, h, w = x.shape
    (kh, kw), (ph, pw), (sh, sw) = kernel, pad, stride
    any_pad = ph > 0 or pw > 0
    oh, ow = caffe_pooled(h, kh, ph, sh, any_pad), caffe_pooled(w, kw, pw, sw, any_pad)
    y = np.zeros((n, c, oh, ow))
    idx = np.full((n, c, oh, ow), -1.0)
    for i, ch, a, bb in itertools.product(range(n), range(c), range(oh), range(ow)):
        hs, ws = a * sh - ph, bb * sw - pw
        if method == "MAX":
            he, we = min(hs + kh, h), min(ws + kw, w)
            hs, ws = max(hs, 0), max(ws, 0)
            best = -FLT_MAX
            for r in range(hs, he):
                for q in range(ws, we):
                    if x[i, ch, r, q] > best:
                        best = x[i, ch, r, q]
                        idx[i, ch, a, bb] = r * w + q
            y[i, ch, a, bb] = best
        else:
            he, we = min(hs + kh, h + ph), min(ws + kw, w + pw)
            size = (he - hs) * (we - ws)
            hs, ws, he, we = max(hs, 0), max(ws, 0), min(he, h), min(we, w)
            y[i, ch, a, bb] = x[i, ch, hs:he, ws:we].sum() / size
    return y, idx


def naive_lrn(x, size, alpha, beta, k, within):
    n, c, h, w = x.shape
    half = (size - 1) // 2
    y = np.zeros_like(x)
    for i, ch, r, q in itertools.product(range(n), range(c), range(h), range(w)):
        if within:
            s = 0.0
            for a in range(r - half, r + half + 1):
                for bb in range(q - half, q + half + 1):
                    if 0 <= a < h and 0 <= bb < w:
                        s += x[i, ch, a, bb] ** 2
            scale = 1.0 + alpha * s / (size * size)
        else:
            s = sum(x[i, cc, r, q] ** 2 for cc in range(ch - half, ch + half + 1) if 0 <= cc < c)
            scale = k + alpha / size * s
        y[i, ch, r, q] = x[i, ch, r, q] * scale ** -beta
    return y


# == Convolution =========================================================================================
CONV = 'type: "Convolution" convolution_param { %s weight_filler { type: "gaussian" std: 0.5 } ' \
       'bias_filler { type: "gaussian" std: 0.5 } }'


@pytest.mark.parametrize("spec,shape,pad,stride,dil,group", [
    ("num_output: 6 kernel_h: 3 kernel_w: 5 pad: 1 stride: 2 dilation: 2 group: 2", (2, 4, 13, 15),
     (1, 1), (2, 2), (2, 2), 2),
    ("num_output: 4 kernel_h: 3 kernel_w: 2 pad_h: 1 pad_w: 2 stride_h: 1 stride_w: 2", (2, 3, 6, 7),
     (1, 2), (1, 2), (1, 1), 1),
    ("num_output: 3 kernel_size: 1", (2, 5, 4, 3), (0, 0), (1, 1), (1, 1), 1),
    ("num_output: 4 kernel_size: 3 kernel_size: 2 dilation: 1 dilation: 2 group: 4", (1, 4, 5, 6),
     (0, 0), (1, 1), (1, 2), 4),
])
def test_conv_forward_matches_naive(spec, shape, pad, stride, dil, group):
    x = rand(shape)
    layer, _, top = run(CONV % spec, [x])
    w, b = layer.blobs[0].data, layer.blobs[1].data
    ref = naive_conv(x, w, b, pad, stride, dil, group)
    assert top[0].shape == ref.shape
    np.testing.assert_allclose(top[0].data, ref, rtol=1e-10, atol=1e-10)


def test_conv_shapes_and_defaults():
    layer, _, top = run('type: "Convolution" convolution_param { num_output: 6 kernel_size: 3 group: 2 }',
                        [rand((2, 4, 5, 5))])
    assert layer.blobs[0].shape == (6, 2, 3, 3) and layer.blobs[1].shape == (6,)
    assert not layer.blobs[0].data.any() and not layer.blobs[1].data.any()  # default constant 0 fillers
    assert top[0].shape == (2, 6, 3, 3)
    layer, _, _ = run('type: "Convolution" convolution_param { num_output: 2 kernel_size: 1 bias_term: false }',
                      [rand((1, 3, 2, 2))])
    assert len(layer.blobs) == 1
    assert layer.blobs[0].dtype == np.float64  # params follow the bottom's dtype


def test_conv_float32():
    x = rand((2, 3, 6, 6)).astype(np.float32)
    layer, _, top = run(CONV % "num_output: 4 kernel_size: 3 pad: 1 stride: 2", [x])
    assert top[0].dtype == np.float32
    ref = naive_conv(x.astype(np.float64), layer.blobs[0].data.astype(np.float64),
                     layer.blobs[1].data.astype(np.float64), (1, 1), (2, 2), (1, 1), 1)
    np.testing.assert_allclose(top[0].data, ref, rtol=1e-5, atol=1e-5)


def test_conv_axis_and_leading_batch_axes():
    # axis 2: axes 0..1 are batch, channels on axis 2, one spatial axis
    x = rand((2, 3, 4, 7))
    layer, _, top = run(CONV % "num_output: 5 kernel_size: 3 pad: 1 stride: 2 axis: 2", [x])
    assert top[0].shape == (2, 3, 5, 4)
    w = layer.blobs[0].data  # (5, 4, 3)
    ref = naive_conv(x.reshape(6, 4, 1, 7), w[:, :, None, :], layer.blobs[1].data, (0, 1), (1, 2), (1, 1), 1)
    np.testing.assert_allclose(top[0].data, ref.reshape(2, 3, 5, 4), rtol=1e-10, atol=1e-10)


def test_conv_gradient_groups_pad_stride_dilation_rect():
    gradcheck(CONV % "num_output: 4 kernel_h: 3 kernel_w: 2 pad: 1 stride: 2 dilation: 2 group: 2",
              [rand((2, 4, 7, 6))])


def test_conv_gradient_1x1_and_nobias():
    gradcheck(CONV % "num_output: 3 kernel_size: 1 group: 3 bias_term: false", [rand((2, 3, 3, 4))])


def test_conv_gradient_two_bottoms_share_weights():
    layer = gradcheck(CONV % "num_output: 2 kernel_size: 2 stride: 1 pad_h: 1 pad_w: 0",
                      [rand((2, 2, 3, 4), 1), rand((2, 2, 3, 4), 2)], ntop=2)
    assert len(layer.blobs) == 2


def test_conv_gradient_3d():
    gradcheck(CONV % "num_output: 2 kernel_size: 2 pad: 1 stride: 2", [rand((1, 2, 3, 3, 4))])


def test_conv_backward_respects_propagate_flags():
    x = rand((2, 2, 4, 4))
    layer, bottom, top = run(CONV % "num_output: 2 kernel_size: 3", [x])
    top[0].diff[...] = 1.0
    bottom[0].diff[...] = 7.0
    layer.param_propagate_down = [False, True]
    layer.backward(top, [False], bottom)
    assert (bottom[0].diff == 7.0).all()  # not touched
    assert not layer.blobs[0].diff.any()
    np.testing.assert_allclose(layer.blobs[1].diff, [2 * 2 * 2] * 2)
    layer.backward(top, [False], bottom)  # param diffs accumulate
    np.testing.assert_allclose(layer.blobs[1].diff, [16.0, 16.0])


class _CountingLowering(LoweringStrategy):
    name = "counting"

    def __init__(self):
        self.inner = get_strategy("type1")
        self.calls = []

    def forward(self, x, w, b, geom):
        self.calls.append("forward")
        return self.inner.forward(x, w, b, geom)

    def backward_data(self, dy, w, geom):
        self.calls.append("backward_data")
        return self.inner.backward_data(dy, w, geom)

    def backward_weights(self, dy, x, geom):
        self.calls.append("backward_weights")
        return self.inner.backward_weights(dy, x, geom)


def test_conv_uses_swappable_lowering():
    layer = make_layer(CONV % "num_output: 2 kernel_size: 3")
    assert layer.lowering.name == "type1"
    layer.lowering = low = _CountingLowering()
    bottom, top = [make_blob(rand((1, 2, 4, 4)))], [Blob((), dtype=np.float64)]
    layer.setup(bottom, top)
    layer.forward(bottom, top)
    layer.backward(top, [True], bottom)
    assert low.calls == ["forward", "backward_weights", "backward_data"]


def test_conv_engine_cudnn_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="cct"):
        run('type: "Convolution" convolution_param { num_output: 2 kernel_size: 1 engine: CUDNN '
            'force_nd_im2col: true }', [rand((1, 2, 2, 2))])
    assert "CUDNN" in caplog.text


@pytest.mark.parametrize("spec,shape,msg", [
    ("num_output: 2 kernel_size: 3 kernel_h: 3 kernel_w: 3", (1, 2, 5, 5), "not both"),
    ("num_output: 2 kernel_size: 3 kernel_size: 3", (1, 2, 5, 5, 5), "once per spatial dimension"),
    ("num_output: 3 kernel_size: 3 group: 2", (1, 2, 5, 5), "multiples of group"),
    ("num_output: 2 kernel_size: 3 stride_h: 2", (1, 2, 5, 5, 5), "2D convolution"),
    ("num_output: 2 kernel_size: 3 axis: 4", (1, 2, 5, 5), "axis"),
])
def test_conv_errors_name_the_layer(spec, shape, msg):
    with pytest.raises(CctError, match=msg) as exc:
        run(f'type: "Convolution" convolution_param {{ {spec} }}', [rand(shape)])
    assert "layer 'l'" in str(exc.value) and "Convolution" in str(exc.value)


def test_conv_reshape_channel_mismatch_and_given_param_shapes():
    layer, bottom, top = run(CONV % "num_output: 2 kernel_size: 3", [rand((1, 2, 5, 5))])
    bottom[0].reshape((1, 3, 5, 5))
    with pytest.raises(CctError, match="layer 'l'.*incompatible"):
        layer.reshape(bottom, top)
    layer = make_layer('type: "Convolution" convolution_param { num_output: 2 kernel_size: 3 }', name="c")
    layer.blobs = [Blob((2, 2, 2, 2)), Blob((2,))]  # as if given by the prototxt/caffemodel
    with pytest.raises(CctError, match="layer 'c'.*Incorrect weight shape"):
        layer.setup([make_blob(rand((1, 2, 5, 5)))], [Blob(())])
    layer = make_layer('type: "Convolution" convolution_param { num_output: 2 kernel_size: 3 }', name="c")
    layer.blobs = [Blob((2, 2, 3, 3))]
    with pytest.raises(CctError, match="layer 'c'.*2 parameter blob"):
        layer.setup([make_blob(rand((1, 2, 5, 5)))], [Blob(())])


# == Deconvolution =========================================================================================
DECONV = CONV.replace("Convolution", "Deconvolution")


@pytest.mark.parametrize("spec,shape,pad,stride,dil,group", [
    ("num_output: 2 kernel_size: 3 stride: 2", (2, 3, 4, 4), (0, 0), (2, 2), (1, 1), 1),
    ("num_output: 4 kernel_size: 4 stride: 2 pad: 1", (2, 3, 5, 5), (1, 1), (2, 2), (1, 1), 1),
    ("num_output: 4 kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 pad_h: 1 pad_w: 0 dilation: 2 group: 2",
     (1, 4, 3, 4), (1, 0), (2, 1), (2, 2), 2),
])
def test_deconv_forward_matches_naive(spec, shape, pad, stride, dil, group):
    x = rand(shape)
    layer, _, top = run(DECONV % spec, [x])
    w, b = layer.blobs[0].data, layer.blobs[1].data
    assert w.shape[0] == shape[1]  # (C_in, C_out / group, kh, kw)
    ref = naive_deconv(x, w, b, pad, stride, dil, group)
    assert top[0].shape == ref.shape
    np.testing.assert_allclose(top[0].data, ref, rtol=1e-10, atol=1e-10)


def test_deconv_gradient():
    gradcheck(DECONV % "num_output: 4 kernel_h: 3 kernel_w: 2 stride: 2 pad: 1 group: 2", [rand((2, 2, 3, 3))])


def test_deconv_gradient_nobias_1x1():
    gradcheck(DECONV % "num_output: 3 kernel_size: 1 bias_term: false", [rand((2, 2, 3, 2))])


# == Im2col ==================================================================================================
def test_im2col_layer_forward_and_gradient():
    x = rand((2, 3, 5, 6))
    layer, _, top = run('type: "Im2col" convolution_param { kernel_h: 2 kernel_w: 3 pad: 1 stride: 2 '
                        'dilation: 1 }', [x])
    oh, ow = (5 + 2 - 2) // 2 + 1, (6 + 2 - 3) // 2 + 1
    assert top[0].shape == (2, 3 * 6, oh, ow)
    xpad = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    for ch, i, j in itertools.product(range(3), range(2), range(3)):
        np.testing.assert_array_equal(top[0].data[:, ch * 6 + i * 3 + j],
                                      xpad[:, ch, i:i + 2 * (oh - 1) + 1:2, j:j + 2 * (ow - 1) + 1:2])
    gradcheck('type: "Im2col" convolution_param { kernel_size: 3 pad: 1 stride: 2 dilation: 2 }',
              [rand((2, 2, 5, 4))])


# == Pooling ===================================================================================================
POOL = 'type: "Pooling" pooling_param { %s }'


@pytest.mark.parametrize("method", ["MAX", "AVE"])
@pytest.mark.parametrize("spec,shape,kernel,pad,stride,out_hw", [
    ("kernel_size: 2 stride: 2 pad: 1", (2, 2, 5, 5), (2, 2), (1, 1), (2, 2), (3, 3)),  # last window dropped
    ("kernel_size: 3 stride: 2", (1, 2, 8, 8), (3, 3), (0, 0), (2, 2), (4, 4)),  # ceil, clipped last window
    ("kernel_size: 3 stride: 2 pad: 1", (1, 2, 6, 6), (3, 3), (1, 1), (2, 2), (4, 4)),
    ("kernel_size: 3 stride: 2", (2, 1, 7, 7), (3, 3), (0, 0), (2, 2), (3, 3)),
    ("kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 3 pad_h: 1 pad_w: 0", (1, 2, 7, 9), (3, 2), (1, 0), (2, 3),
     (4, 3)),
    ("kernel_size: 3", (1, 1, 4, 5), (3, 3), (0, 0), (1, 1), (2, 3)),
])
def test_pool_forward_matches_naive(method, spec, shape, kernel, pad, stride, out_hw):
    x = rand(shape, 4)
    ntop = 2 if method == "MAX" else 1
    _, _, top = run(POOL % f"pool: {method} {spec}", [x], ntop=ntop)
    ref, idx = naive_pool(x, method, kernel, pad, stride)
    assert top[0].shape[2:] == out_hw == ref.shape[2:]
    np.testing.assert_allclose(top[0].data, ref, rtol=1e-12, atol=1e-12)
    if method == "MAX":
        np.testing.assert_array_equal(top[1].data, idx)


def test_pool_drop_rule_applies_to_both_axes_when_any_is_padded():
    # width: k 1, s 3 on 5 -> ceil gives 3 windows, the 3rd starts at 6 >= 5 + 0: dropped since pad_h > 0
    _, _, top = run(POOL % "pool: MAX kernel_h: 3 kernel_w: 1 stride_h: 1 stride_w: 3 pad_h: 1 pad_w: 0",
                    [rand((1, 1, 4, 5))])
    assert top[0].shape == (1, 1, 4, 2)
    # no padding at all: the window past the edge stays (Caffe: empty window, -FLT_MAX)
    _, _, top = run(POOL % "pool: MAX kernel_size: 1 stride: 3", [rand((1, 1, 5, 5))])
    assert top[0].shape == (1, 1, 3, 3)
    assert top[0].data[0, 0, 2, 2] == -FLT_MAX


def test_pool_global():
    x = rand((2, 3, 5, 7))
    _, _, top = run(POOL % "pool: AVE global_pooling: true", [x])
    np.testing.assert_allclose(top[0].data[:, :, 0, 0], x.mean(axis=(2, 3)), rtol=1e-12)
    _, _, top = run(POOL % "pool: MAX global_pooling: true", [x], ntop=2)
    np.testing.assert_allclose(top[0].data[:, :, 0, 0], x.max(axis=(2, 3)))
    np.testing.assert_array_equal(top[1].data[:, :, 0, 0], x.reshape(2, 3, -1).argmax(axis=2))


def test_pool_max_ties_pick_first_in_row_major_order():
    x = np.ones((1, 1, 4, 4))
    x[0, 0, 1, 1] = x[0, 0, 2, 0] = 2.0  # window (0..2, 0..2): tie between (1,1) and (2,0) -> (1,1)
    layer, bottom, top = run(POOL % "pool: MAX kernel_size: 3 stride: 1", [x], ntop=2)
    assert top[1].data[0, 0, 0, 0] == 1 * 4 + 1
    assert top[1].data[0, 0, 0, 1] == 1 * 4 + 1
    assert top[1].data[0, 0, 1, 0] == 1 * 4 + 1
    y = np.ones((1, 1, 3, 3))
    _, _, top = run(POOL % "pool: MAX kernel_size: 2 stride: 1", [np.ones((1, 1, 3, 3))], ntop=2)
    np.testing.assert_array_equal(top[1].data[0, 0], [[0, 1], [3, 4]])
    del y


def test_pool_max_backward_routes_to_argmax_and_accumulates():
    x = np.zeros((1, 1, 3, 3))
    x[0, 0, 1, 1] = 5.0  # the max of all four overlapping 2x2 windows
    layer, bottom, top = run(POOL % "pool: MAX kernel_size: 2 stride: 1", [x])
    top[0].diff[...] = np.array([[1.0, 2.0], [3.0, 4.0]])
    layer.backward(top, [True], bottom)
    expected = np.zeros((3, 3))
    expected[1, 1] = 10.0
    np.testing.assert_array_equal(bottom[0].diff[0, 0], expected)


@pytest.mark.parametrize("spec", [
    "pool: MAX kernel_size: 3 stride: 2 pad: 1",
    "pool: MAX kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1",
    "pool: AVE kernel_size: 3 stride: 2 pad: 1",
    "pool: AVE kernel_size: 2 stride: 2 pad: 1",
    "pool: AVE kernel_size: 3 stride: 2",
    "pool: AVE global_pooling: true",
])
def test_pool_gradient(spec):
    gradcheck(POOL % spec, [distinct((2, 2, 6, 5))])


def test_pool_max_with_mask_gradient():
    gradcheck(POOL % "pool: MAX kernel_size: 3 stride: 2", [distinct((1, 2, 8, 7))], ntop=2,
              top_weights=[np.random.default_rng(0).standard_normal((1, 2, 4, 3)), None])


def test_pool_stochastic_train_samples_proportionally_and_routes_gradient():
    n = 4000
    x = np.tile(np.array([1.0, 3.0]).reshape(1, 1, 1, 2), (n, 1, 1, 1))
    layer, bottom, top = run(POOL % "pool: STOCHASTIC kernel_h: 1 kernel_w: 2", [x], seed=11)
    vals = top[0].data.ravel()
    assert set(np.unique(vals)) <= {1.0, 3.0}
    assert abs(np.mean(vals == 3.0) - 0.75) < 0.03
    top[0].diff[...] = 1.0
    layer.backward(top, [True], bottom)
    np.testing.assert_array_equal(bottom[0].diff[:, 0, 0, 1] == 1.0, vals == 3.0)
    np.testing.assert_array_equal(bottom[0].diff.sum(axis=(1, 2, 3)), np.ones(n))
    # reproducible from the seed
    _, _, top2 = run(POOL % "pool: STOCHASTIC kernel_h: 1 kernel_w: 2", [x], seed=11)
    np.testing.assert_array_equal(top2[0].data, top[0].data)


def test_pool_stochastic_train_general_windows():
    x = np.abs(rand((2, 2, 7, 6), 5)) + 0.1
    layer, bottom, top = run(POOL % "pool: STOCHASTIC kernel_size: 3 stride: 2", [x], seed=2)
    assert top[0].shape == (2, 2, 3, 3)
    r = np.random.default_rng(1)
    top[0].diff[...] = r.standard_normal(top[0].shape)
    layer.backward(top, [True], bottom)
    for i, c, a, b in itertools.product(range(2), range(2), range(3), range(3)):
        win = x[i, c, 2 * a:2 * a + 3, 2 * b:2 * b + 3]
        assert top[0].data[i, c, a, b] in win
    np.testing.assert_allclose(bottom[0].diff.sum(), top[0].diff.sum(), rtol=1e-12)
    # every nonzero gradient sits on an input equal to one of its windows' outputs
    nz = np.argwhere(bottom[0].diff != 0)
    for i, c, h, w in nz:
        assert x[i, c, h, w] in top[0].data[i, c]


def test_pool_stochastic_test_phase():
    x = np.abs(rand((2, 2, 5, 5), 6)) + 0.1
    _, _, top = run(POOL % "pool: STOCHASTIC kernel_size: 2 stride: 2", [x], phase=TEST)
    assert top[0].shape == (2, 2, 3, 3)
    for i, c, a, b in itertools.product(range(2), range(2), range(3), range(3)):
        win = x[i, c, 2 * a:2 * a + 2, 2 * b:2 * b + 2]
        np.testing.assert_allclose(top[0].data[i, c, a, b], (win ** 2).sum() / win.sum(), rtol=1e-12)
    gradcheck(POOL % "pool: STOCHASTIC kernel_size: 2 stride: 2", [x], phase=TEST)


@pytest.mark.parametrize("spec,msg,ntop", [
    ("pool: MAX global_pooling: true kernel_size: 2", "Global_pooling", 1),
    ("pool: MAX global_pooling: true stride: 2", "only pad = 0 and stride = 1", 1),
    ("pool: MAX kernel_size: 2 kernel_h: 2 kernel_w: 2", "not both", 1),
    ("pool: MAX stride: 2", "kernel_size OR kernel_h", 1),
    ("pool: MAX kernel_size: 2 pad: 1 pad_h: 1 pad_w: 1", "pad is pad OR", 1),
    ("pool: MAX kernel_size: 2 stride_h: 2", "Stride is stride OR", 1),
    ("pool: STOCHASTIC kernel_size: 3 pad: 1", "Padding implemented only", 1),
    ("pool: AVE kernel_size: 2 pad: 2", "smaller than the kernel", 1),
    ("pool: AVE kernel_size: 2", "at most 1 top", 2),
])
def test_pool_errors_name_the_layer(spec, msg, ntop):
    with pytest.raises(CctError, match=msg) as exc:
        run(POOL % spec, [rand((1, 1, 6, 6))], ntop=ntop)
    assert "layer 'l'" in str(exc.value) and "Pooling" in str(exc.value)


def test_pool_needs_4d():
    with pytest.raises(CctError, match="layer 'l'.*4 axes"):
        run(POOL % "pool: MAX kernel_size: 2", [rand((2, 3, 6))])


# == LRN ==========================================================================================================
@pytest.mark.parametrize("spec,size,alpha,beta,k,within", [
    ("", 5, 1.0, 0.75, 1.0, False),
    ("local_size: 3 alpha: 0.3 beta: 0.6 k: 1.5", 3, 0.3, 0.6, 1.5, False),
    ("local_size: 3 alpha: 0.3 beta: 0.75 k: 7 norm_region: WITHIN_CHANNEL", 3, 0.3, 0.75, 7.0, True),
    ("local_size: 5 alpha: 2 beta: 0.5 norm_region: WITHIN_CHANNEL", 5, 2.0, 0.5, 1.0, True),
])
def test_lrn_forward_matches_naive(spec, size, alpha, beta, k, within):
    x = rand((2, 6, 4, 5), 7) * 2
    _, _, top = run(f'type: "LRN" lrn_param {{ {spec} }}', [x])
    f32 = lambda v: float(np.float32(v))  # noqa: E731  (the proto fields are float32)
    np.testing.assert_allclose(top[0].data, naive_lrn(x, size, f32(alpha), f32(beta), f32(k), within), rtol=1e-12)


@pytest.mark.parametrize("spec", [
    "local_size: 3 alpha: 0.8 beta: 0.75 k: 1.2",
    "local_size: 5 alpha: 1.5 beta: 0.6 k: 0.5",
    "local_size: 3 alpha: 0.8 beta: 0.75 norm_region: WITHIN_CHANNEL",
])
def test_lrn_gradient(spec):
    gradcheck(f'type: "LRN" lrn_param {{ {spec} }}', [rand((2, 5, 3, 4), 8)])


def test_lrn_in_place_matches_out_of_place():
    x = rand((1, 4, 3, 3), 9)
    dy = rand((1, 4, 3, 3), 10)
    layer, bottom, top = run('type: "LRN" lrn_param { local_size: 3 alpha: 0.5 }', [x])
    top[0].diff[...] = dy
    layer.backward(top, [True], bottom)
    layer2 = make_layer('type: "LRN" lrn_param { local_size: 3 alpha: 0.5 }')
    b = make_blob(x)
    layer2.setup([b], [b])
    layer2.forward([b], [b])
    np.testing.assert_allclose(b.data, top[0].data)
    b.diff[...] = dy
    layer2.backward([b], [True], [b])
    np.testing.assert_allclose(b.diff, bottom[0].diff, rtol=1e-12)


def test_lrn_errors_name_the_layer():
    with pytest.raises(CctError, match="layer 'l'.*odd values for local_size"):
        run('type: "LRN" lrn_param { local_size: 4 }', [rand((1, 4, 3, 3))])
    with pytest.raises(CctError, match="layer 'l'.*4 axes"):
        run('type: "LRN" lrn_param { local_size: 3 }', [rand((4, 3, 3))])


# == InnerProduct ==================================================================================================
IP = 'type: "InnerProduct" inner_product_param { %s weight_filler { type: "gaussian" std: 0.5 } ' \
     'bias_filler { type: "gaussian" std: 0.5 } }'


@pytest.mark.parametrize("spec,shape,out_shape", [
    ("num_output: 4", (3, 2, 3, 2), (3, 4)),
    ("num_output: 6 axis: 2", (2, 3, 4, 5), (2, 3, 6)),
    ("num_output: 5 transpose: true", (3, 4, 2, 2), (3, 5)),
    ("num_output: 3 axis: -1 bias_term: false", (2, 3, 4), (2, 3, 3)),
])
def test_ip_forward_matches_naive(spec, shape, out_shape):
    x = rand(shape, 12)
    layer, _, top = run(IP % spec, [x])
    assert top[0].shape == out_shape
    k = int(np.prod(shape[len(out_shape) - 1:]))
    w = layer.blobs[0].data
    if "transpose" in spec:
        assert w.shape == (k, out_shape[-1])
        w = w.T
    else:
        assert w.shape == (out_shape[-1], k)
    b = layer.blobs[1].data if len(layer.blobs) > 1 else 0.0
    xf = x.reshape(-1, k)
    ref = np.array([[sum(xf[m, j] * w[o, j] for j in range(k)) for o in range(w.shape[0])] for m in range(len(xf))])
    np.testing.assert_allclose(top[0].data, (ref + b).reshape(out_shape), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("spec,shape", [
    ("num_output: 4", (3, 2, 3, 2)),
    ("num_output: 3 axis: 2", (2, 3, 2, 2)),
    ("num_output: 5 transpose: true", (3, 4, 2)),
    ("num_output: 2 bias_term: false transpose: true axis: 2", (2, 2, 3)),
])
def test_ip_gradient(spec, shape):
    gradcheck(IP % spec, [rand(shape, 13)])


def test_ip_errors_name_the_layer():
    layer, bottom, top = run(IP % "num_output: 2", [rand((2, 3, 2))])
    bottom[0].reshape((2, 3, 3))
    with pytest.raises(CctError, match="layer 'l'.*incompatible"):
        layer.reshape(bottom, top)
    with pytest.raises(CctError, match="layer 'l'.*axis"):
        run(IP % "num_output: 2 axis: 3", [rand((2, 3, 2))])
