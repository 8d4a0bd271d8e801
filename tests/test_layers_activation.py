"""Elementwise activation layers (cct/layers/activation.py): forward references, gradients, in-place, errors."""
import logging
import math

import numpy as np
import pytest

from cct import rng
from cct.blob import Blob
from cct.errors import CctError
from cct.io.prototxt import parse_text
from cct.layers import create_layer
from cct.proto import caffe_pb2
from cct.testing import check_gradient, make_blob

TRAIN, TEST = caffe_pb2.TRAIN, caffe_pb2.TEST
SHAPE = (2, 3, 3, 2)


def make_layer(text: str, phase: int = TRAIN):
    lp = caffe_pb2.LayerParameter()
    parse_text(text, lp)
    if not lp.name:
        lp.name = "l"
    lp.phase = phase
    return create_layer(lp)


def rand(shape=SHAPE, seed=0, lo=None, hi=None):
    g = np.random.default_rng(seed)
    if lo is not None:
        return g.uniform(lo, hi, size=shape)
    return g.standard_normal(shape)


def away_from(x, points, margin=0.05):
    """Move values closer than ``margin`` to any of ``points`` out of that band (for kinked functions)."""
    x = x.copy()
    for p in points:
        near = np.abs(x - p) < margin
        x[near] = p + np.where(x[near] >= p, margin, -margin) * 2
    return x


def run(text, x, phase=TRAIN, top_diff=None, seed=5, in_place=False):
    """Set up, forward and (if top_diff given) backward one layer; returns (layer, top data, bottom diff)."""
    layer = make_layer(text, phase)
    b = make_blob(x)
    t = b if in_place else Blob((), dtype=x.dtype)
    rng.set_random_seed(seed)
    layer.setup([b], [t])
    layer.reshape([b], [t])
    rng.set_random_seed(seed + 1)
    layer.forward([b], [t])
    y = t.data.copy()
    dx = None
    if top_diff is not None:
        t.diff[...] = top_diff
        for p in layer.blobs:
            p.diff[...] = 0
        layer.backward([t], [True], [b])
        dx = b.diff.copy()
    return layer, y, dx


def _sig(v):
    return 1.0 / (1.0 + math.exp(-v))


def _elementwise(f):
    def ref(x):
        return np.vectorize(f, otypes=[np.float64])(x)
    return ref


def _prelu_ref(slopes):
    def ref(x):
        out = np.empty_like(x)
        for idx in np.ndindex(x.shape):
            a = slopes[idx[1]] if np.ndim(slopes) else float(slopes)
            out[idx] = x[idx] if x[idx] > 0 else a * x[idx]
        return out
    return ref


POS = dict(lo=0.2, hi=2.0)

FORWARD_CASES = [
    ('type: "ReLU"', {}, _elementwise(lambda v: v if v > 0 else 0.0)),
    ('type: "ReLU" relu_param { negative_slope: 0.1 }', {}, _elementwise(lambda v: v if v > 0 else 0.1 * v)),
    ('type: "ReLU" relu_param { negative_slope: -0.3 }', {}, _elementwise(lambda v: v if v > 0 else -0.3 * v)),
    ('type: "PReLU"', {}, _prelu_ref(np.full(3, 0.25))),
    ('type: "PReLU" prelu_param { channel_shared: true filler { type: "constant" value: -0.5 } }', {},
     _prelu_ref(-0.5)),
    ('type: "ELU"', {}, _elementwise(lambda v: v if v > 0 else math.exp(v) - 1)),
    ('type: "ELU" elu_param { alpha: 0.7 }', {}, _elementwise(lambda v: v if v > 0 else 0.7 * (math.exp(v) - 1))),
    ('type: "Sigmoid"', {}, _elementwise(_sig)),
    ('type: "TanH"', {}, _elementwise(math.tanh)),
    ('type: "AbsVal"', {}, _elementwise(abs)),
    ('type: "Power" power_param { power: 2 scale: 0.5 shift: 1 }', {}, _elementwise(lambda v: (1 + 0.5 * v) ** 2)),
    ('type: "Power" power_param { power: 0.5 scale: 2 shift: 0.3 }', POS, _elementwise(lambda v: (0.3 + 2 * v) ** 0.5)),
    ('type: "Power" power_param { power: 3 scale: -1.5 }', {}, _elementwise(lambda v: (-1.5 * v) ** 3)),
    ('type: "Power" power_param { power: -1.5 scale: 1 shift: 0.1 }', POS, _elementwise(lambda v: (0.1 + v) ** -1.5)),
    ('type: "Power" power_param { power: 0 scale: 3 shift: 2 }', {}, _elementwise(lambda v: 1.0)),
    ('type: "Power" power_param { power: 2.5 scale: 0 shift: 2 }', {}, _elementwise(lambda v: 2.0 ** 2.5)),
    ('type: "Power" power_param { power: 1 scale: 3 shift: 2 }', {}, _elementwise(lambda v: 2 + 3 * v)),
    ('type: "Exp"', {}, _elementwise(math.exp)),
    ('type: "Exp" exp_param { base: 2 scale: 0.5 shift: 0.1 }', {}, _elementwise(lambda v: 2 ** (0.1 + 0.5 * v))),
    ('type: "Exp" exp_param { scale: -2 shift: 0.3 }', {}, _elementwise(lambda v: math.exp(0.3 - 2 * v))),
    ('type: "Log"', POS, _elementwise(math.log)),
    ('type: "Log" log_param { base: 10 scale: 2 shift: 0.5 }', POS, _elementwise(lambda v: math.log10(0.5 + 2 * v))),
    ('type: "Log" log_param { base: 2 scale: -1 shift: 3 }', POS, _elementwise(lambda v: math.log2(3 - v))),
    ('type: "BNLL"', {}, _elementwise(lambda v: math.log(1 + math.exp(v)))),
    ('type: "Threshold" threshold_param { threshold: 0.3 }', {}, _elementwise(lambda v: 1.0 if v > 0.3 else 0.0)),
    ('type: "Threshold"', {}, _elementwise(lambda v: 1.0 if v > 0 else 0.0)),
    ('type: "Clip" clip_param { min: -0.5 max: 0.7 }', {}, _elementwise(lambda v: min(max(v, -0.5), 0.7))),
    ('type: "Swish"', {}, _elementwise(lambda v: v * _sig(v))),
    ('type: "Swish" swish_param { beta: 1.7 }', {}, _elementwise(lambda v: v * _sig(1.7 * v))),
]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("text,rng_kw,ref", FORWARD_CASES, ids=[c[0] for c in FORWARD_CASES])
def test_forward_matches_reference(text, rng_kw, ref, dtype):
    x = rand(**rng_kw).astype(dtype)
    _, y, _ = run(text, x)
    assert y.dtype == dtype
    # Parameters are float32 in caffe.proto (0.1 -> 0.100000001), hence 1e-7 in float64.
    tol = 1e-7 if dtype == np.float64 else 2e-6
    np.testing.assert_allclose(y, ref(x.astype(np.float64)), rtol=tol, atol=tol)


def test_dropout_test_phase_is_identity_forward_and_backward():
    x = rand()
    dy = rand(seed=3)
    _, y, dx = run('type: "Dropout" dropout_param { dropout_ratio: 0.3 }', x, phase=TEST, top_diff=dy)
    np.testing.assert_array_equal(y, x)
    np.testing.assert_array_equal(dx, dy)


def test_dropout_train_mask_scale_and_backward():
    x = rand((40, 50), lo=0.5, hi=1.5)
    dy = rand((40, 50), seed=3)
    _, y, dx = run('type: "Dropout" dropout_param { dropout_ratio: 0.25 }', x, top_diff=dy)
    kept = y != 0
    assert 0.7 < kept.mean() < 0.8
    np.testing.assert_allclose(y[kept], x[kept] / 0.75, rtol=1e-12)
    # Backward reuses the forward's mask.
    np.testing.assert_allclose(dx, np.where(kept, dy / 0.75, 0.0), rtol=1e-12)
    # Reproducible from cct's RNG.
    _, y2, _ = run('type: "Dropout" dropout_param { dropout_ratio: 0.25 }', x)
    np.testing.assert_array_equal(y, y2)
    _, y3, _ = run('type: "Dropout" dropout_param { dropout_ratio: 0.25 }', x, seed=11)
    assert not np.array_equal(y, y3)


def test_bnll_is_overflow_safe():
    x = np.array([[-1000.0, -60.0, 0.0, 60.0, 1000.0]])
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        _, y, dx = run('type: "BNLL"', x, top_diff=np.ones_like(x))
    np.testing.assert_allclose(y, [[0.0, math.exp(-60.0), math.log(2), 60.0, 1000.0]], rtol=1e-12, atol=1e-300)
    # Caffe clamps the exponent at 50 in backward.
    e50 = math.exp(50.0)
    np.testing.assert_allclose(dx, [[0.0, math.exp(-60) / (1 + math.exp(-60)), 0.5, e50 / (e50 + 1), e50 / (e50 + 1)]],
                               rtol=1e-12)


def test_sigmoid_extreme_inputs_no_warning():
    x = np.array([[-1000.0, 1000.0]], dtype=np.float32)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        _, y, _ = run('type: "Sigmoid"', x)
    np.testing.assert_array_equal(y, [[0.0, 1.0]])


def test_prelu_param_shapes_and_default_filler():
    layer, _, _ = run('type: "PReLU"', rand())
    assert layer.blobs[0].shape == (3,)
    np.testing.assert_array_equal(layer.blobs[0].data, 0.25)
    layer, _, _ = run('type: "PReLU" prelu_param { channel_shared: true }', rand())
    assert layer.blobs[0].shape == ()
    assert layer.blobs[0].count == 1


def test_power_special_case_gradients():
    x = rand()
    dy = rand(seed=4)
    _, _, dx = run('type: "Power" power_param { power: 0 scale: 3 shift: 2 }', x, top_diff=dy)
    np.testing.assert_array_equal(dx, 0)
    _, _, dx = run('type: "Power" power_param { power: 2 scale: 0 shift: 2 }', x, top_diff=dy)
    np.testing.assert_array_equal(dx, 0)
    _, _, dx = run('type: "Power" power_param { power: 1 scale: -1.5 shift: 2 }', x, top_diff=dy)
    np.testing.assert_allclose(dx, -1.5 * dy, rtol=1e-15)


# ---------------------------------------------------------------------------------------------
# Gradient checks (float64)

KINK0 = dict(kink=0.0, kink_range=0.01)

GRAD_CASES = [
    ('type: "ReLU"', {}, KINK0),
    ('type: "ReLU" relu_param { negative_slope: 0.1 }', {}, KINK0),
    ('type: "ReLU" relu_param { negative_slope: -0.3 }', {}, KINK0),
    ('type: "PReLU" prelu_param { filler { type: "gaussian" std: 0.5 } }', {}, KINK0),
    ('type: "PReLU" prelu_param { channel_shared: true filler { type: "constant" value: 0.3 } }', {}, KINK0),
    ('type: "ELU" elu_param { alpha: 0.7 }', {}, KINK0),
    ('type: "ELU"', {}, {}),
    ('type: "Sigmoid"', {}, {}),
    ('type: "TanH"', {}, {}),
    ('type: "AbsVal"', {}, KINK0),
    ('type: "Power" power_param { power: 2 scale: 0.5 shift: 1 }', {}, {}),
    ('type: "Power" power_param { power: 3 scale: -1.5 }', {}, {}),
    ('type: "Power" power_param { power: 0.5 scale: 2 shift: 0.3 }', POS, {}),
    ('type: "Power" power_param { power: -1.5 shift: 0.1 }', POS, {}),
    ('type: "Power" power_param { power: 0 scale: 3 shift: 2 }', {}, {}),
    ('type: "Power" power_param { power: 1 scale: 3 shift: 2 }', {}, {}),
    ('type: "Exp"', {}, {}),
    ('type: "Exp" exp_param { base: 2 scale: 0.5 shift: 0.1 }', {}, {}),
    ('type: "Log"', POS, {}),
    ('type: "Log" log_param { base: 10 scale: 2 shift: 0.5 }', POS, {}),
    ('type: "BNLL"', {}, {}),
    ('type: "Dropout" dropout_param { dropout_ratio: 0.4 }', {}, {}),
    ('type: "Swish" swish_param { beta: 1.7 }', {}, {}),
    ('type: "Swish"', {}, {}),
]


@pytest.mark.parametrize("text,rng_kw,kink", GRAD_CASES, ids=[c[0] for c in GRAD_CASES])
def test_gradient(text, rng_kw, kink):
    layer = make_layer(text)
    b = make_blob(rand(**rng_kw))
    t = Blob((), dtype=np.float64)
    check_gradient(layer, [b], [t], **kink)


def test_gradient_dropout_test_phase():
    layer = make_layer('type: "Dropout"', TEST)
    check_gradient(layer, [make_blob(rand())], [Blob((), dtype=np.float64)])


def test_gradient_clip_away_from_kinks():
    x = away_from(rand() * 1.5, [-0.5, 0.7])
    layer = make_layer('type: "Clip" clip_param { min: -0.5 max: 0.7 }')
    check_gradient(layer, [make_blob(x)], [Blob((), dtype=np.float64)])


def test_clip_gradient_passes_on_closed_interval():
    x = np.array([[-0.5, 0.75, -0.6, 0.8, 0.0]])
    _, _, dx = run('type: "Clip" clip_param { min: -0.5 max: 0.75 }', x, top_diff=np.full_like(x, 2.0))
    np.testing.assert_array_equal(dx, [[2.0, 2.0, 0.0, 0.0, 2.0]])


def test_gradient_is_checked_for_prelu_param():
    """The checker must fail if the slope gradient is wrong (sanity check that tests can fail)."""
    layer = make_layer('type: "PReLU"')
    b = make_blob(rand())
    t = Blob((), dtype=np.float64)
    orig = layer.backward

    def broken(top, prop, bottom):
        orig(top, prop, bottom)
        layer.blobs[0].diff[...] *= 1.5

    layer.backward = broken
    with pytest.raises(AssertionError, match="param"):
        check_gradient(layer, [b], [t], **KINK0)


# ---------------------------------------------------------------------------------------------
# In-place use

INPLACE_CASES = [
    ('type: "ReLU"', {}),
    ('type: "ReLU" relu_param { negative_slope: 0.1 }', {}),
    ('type: "ReLU" relu_param { negative_slope: -0.3 }', {}),
    ('type: "PReLU" prelu_param { filler { type: "gaussian" std: 0.5 } }', {}),
    ('type: "PReLU" prelu_param { channel_shared: true }', {}),
    ('type: "ELU" elu_param { alpha: 0.7 }', {}),
    ('type: "ELU" elu_param { alpha: -0.4 }', {}),
    ('type: "Sigmoid"', {}),
    ('type: "TanH"', {}),
    ('type: "Power" power_param { power: 2 scale: 0.5 shift: 1 }', {}),
    ('type: "Power" power_param { power: 3 scale: -1.5 }', {}),
    ('type: "Power" power_param { power: 0.5 scale: 2 shift: 0.3 }', POS),
    ('type: "Power" power_param { power: 1 scale: 3 shift: 2 }', {}),
    ('type: "Power" power_param { power: 0 scale: 3 shift: 2 }', {}),
    ('type: "Exp" exp_param { base: 2 scale: 0.5 shift: 0.1 }', {}),
    ('type: "Log" log_param { base: 10 scale: 2 shift: 0.5 }', POS),
    ('type: "BNLL"', {}),
    ('type: "Dropout" dropout_param { dropout_ratio: 0.4 }', {}),
    ('type: "Clip" clip_param { min: -0.5 max: 0.7 }', {}),
    ('type: "Swish" swish_param { beta: 1.7 }', {}),
]


@pytest.mark.parametrize("phase", [TRAIN, TEST])
@pytest.mark.parametrize("text,rng_kw", INPLACE_CASES, ids=[c[0] for c in INPLACE_CASES])
def test_in_place_matches_out_of_place(text, rng_kw, phase):
    x = rand(**rng_kw)
    dy = rand(seed=9)
    l1, y1, dx1 = run(text, x, phase=phase, top_diff=dy)
    l2, y2, dx2 = run(text, x, phase=phase, top_diff=dy, in_place=True)
    np.testing.assert_array_equal(y1, y2)
    np.testing.assert_allclose(dx2, dx1, rtol=1e-14, atol=0)
    for p1, p2 in zip(l1.blobs, l2.blobs):
        np.testing.assert_allclose(p2.diff, p1.diff, rtol=1e-14)


def test_threshold_in_place_forward():
    x = rand()
    _, y1, _ = run('type: "Threshold" threshold_param { threshold: 0.2 }', x)
    _, y2, _ = run('type: "Threshold" threshold_param { threshold: 0.2 }', x, in_place=True)
    np.testing.assert_array_equal(y1, y2)


# ---------------------------------------------------------------------------------------------
# Errors and warnings

def test_absval_refuses_in_place():
    layer = make_layer('type: "AbsVal"')
    b = make_blob(rand())
    with pytest.raises(CctError, match="in-place"):
        layer.setup([b], [b])


def test_threshold_has_no_backward():
    layer = make_layer('type: "Threshold"')
    b, t = make_blob(rand()), Blob((), dtype=np.float64)
    layer.setup([b], [t])
    layer.forward([b], [t])
    layer.backward([t], [False], [b])  # nothing asked: fine
    with pytest.raises(CctError, match="Threshold.*backward"):
        layer.backward([t], [True], [b])


@pytest.mark.parametrize("text,match", [
    ('type: "Exp" exp_param { base: -2 }', "strictly positive"),
    ('type: "Exp" exp_param { base: 0 }', "strictly positive"),
    ('type: "Log" log_param { base: 0 }', "strictly positive"),
    ('type: "Log" log_param { base: 1 }', "log\\(base\\)"),
    ('type: "Dropout" dropout_param { dropout_ratio: 1 }', "dropout_ratio"),
    ('type: "Dropout" dropout_param { dropout_ratio: -0.1 }', "dropout_ratio"),
    ('type: "Clip" clip_param { min: 0 }', "clip_param.max"),
    ('type: "PReLU" blobs { shape { dim: 2 } data: 0.1 data: 0.2 }', "inconsistent"),
    ('type: "PReLU" prelu_param { channel_shared: true } blobs { shape { dim: 3 } data: 1 data: 2 data: 3 }',
     "inconsistent"),
])
def test_setup_errors(text, match):
    layer = make_layer(text)
    with pytest.raises(CctError, match=match):
        layer.setup([make_blob(rand())], [Blob((), dtype=np.float64)])


def test_prelu_needs_two_axes():
    layer = make_layer('type: "PReLU"')
    with pytest.raises(CctError, match="at least 2 axes"):
        layer.setup([make_blob(rand((5,)))], [Blob((), dtype=np.float64)])


def test_blob_count_errors():
    layer = make_layer('type: "ReLU"')
    with pytest.raises(CctError, match="bottom"):
        layer.setup([make_blob(rand()), make_blob(rand())], [Blob(())])


def test_prelu_given_slopes_are_used():
    layer, y, _ = run('type: "PReLU" blobs { shape { dim: 3 } data: 0.1 data: -0.2 data: 0.3 }', rand())
    np.testing.assert_allclose(y, _prelu_ref(np.array([0.1, -0.2, 0.3]))(rand()), rtol=1e-6)


@pytest.mark.parametrize("t", ["ReLU", "Sigmoid", "TanH"])
def test_cudnn_engine_accepted_with_warning(t, caplog):
    field = {"ReLU": "relu_param", "Sigmoid": "sigmoid_param", "TanH": "tanh_param"}[t]
    with caplog.at_level(logging.WARNING, logger="cct"):
        _, y, _ = run(f'type: "{t}" {field} {{ engine: CUDNN }}', rand())
    assert "CUDNN" in caplog.text
    assert y.shape == SHAPE


def test_reshape_follows_bottom():
    layer = make_layer('type: "ReLU"')
    b, t = make_blob(rand()), Blob(())
    layer.setup([b], [t])
    b.reshape((4, 5))
    layer.reshape([b], [t])
    assert t.shape == (4, 5)
