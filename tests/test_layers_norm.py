"""Normalisation layers (cct/layers/norm.py): BatchNorm, Scale, Bias, MVN."""
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


def make_layer(text: str, phase: int = TRAIN):
    lp = caffe_pb2.LayerParameter()
    parse_text(text, lp)
    if not lp.name:
        lp.name = "l"
    lp.phase = phase
    return create_layer(lp)


def rand(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def setup(text, xs, phase=TRAIN, in_place=False, seed=3):
    layer = make_layer(text, phase)
    bottom = [make_blob(x) for x in xs]
    top = [bottom[0]] if in_place else [Blob((), dtype=xs[0].dtype)]
    rng.set_random_seed(seed)
    layer.setup(bottom, top)
    return layer, bottom, top


def fwd_bwd(layer, bottom, top, dy, propagate=None):
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    y = top[0].data.copy()
    top[0].diff[...] = dy
    for p in layer.blobs:
        p.diff[...] = 0
    layer.backward(top, propagate or [True] * len(bottom), bottom)
    return y, [b.diff.copy() for b in bottom], [p.diff.copy() for p in layer.blobs]


# ---------------------------------------------------------------------------------------------
# BatchNorm

def bn_reference(x, eps=1e-5):
    """Naive per-channel batch normalisation; returns (y, mean, biased var, unbiased var)."""
    n, c = x.shape[:2]
    y = np.empty_like(x)
    means, bvars, uvars = [], [], []
    for ch in range(c):
        vals = [v for i in range(n) for v in np.ravel(x[i, ch])]
        m = sum(vals) / len(vals)
        var = sum((v - m) ** 2 for v in vals) / len(vals)
        means.append(m)
        bvars.append(var)
        uvars.append(var * len(vals) / (len(vals) - 1))
        for i in range(n):
            y[i, ch] = (x[i, ch] - m) / math.sqrt(var + eps)
    return y, np.array(means), np.array(bvars), np.array(uvars)


@pytest.mark.parametrize("shape", [(4, 3, 2, 3), (5, 2), (3, 2, 2, 2, 2)])
def test_batchnorm_train_forward_and_running_stats(shape):
    x = rand(shape) * 2 + 1
    layer, bottom, top = setup('type: "BatchNorm"', [x])
    assert not layer.use_global_stats
    for b in layer.blobs:
        np.testing.assert_array_equal(b.data, 0)
    assert [b.shape for b in layer.blobs] == [(shape[1],), (shape[1],), (1,)]
    layer.forward(bottom, top)
    y, m, _, uv = bn_reference(x)
    np.testing.assert_allclose(top[0].data, y, rtol=1e-6, atol=1e-9)  # eps is float32 in the proto
    np.testing.assert_allclose(layer.blobs[0].data, m, rtol=1e-12)
    np.testing.assert_allclose(layer.blobs[1].data, uv, rtol=1e-12)
    np.testing.assert_array_equal(layer.blobs[2].data, [1.0])
    # Second pass: moving average with fraction 0.999 (float32 in the proto).
    maf = float(np.float32(0.999))
    x2 = rand(shape, seed=1)
    bottom[0].data[...] = x2
    layer.forward(bottom, top)
    _, m2, _, uv2 = bn_reference(x2)
    np.testing.assert_allclose(layer.blobs[2].data, [maf + 1], rtol=1e-12)
    np.testing.assert_allclose(layer.blobs[0].data, maf * m + m2, rtol=1e-12)
    np.testing.assert_allclose(layer.blobs[1].data, maf * uv + uv2, rtol=1e-12)


def test_batchnorm_test_phase_uses_global_stats_divided_by_factor():
    x = rand((3, 2, 2, 2))
    layer, bottom, top = setup('type: "BatchNorm" batch_norm_param { eps: 0.001 }', [x], phase=TEST)
    assert layer.use_global_stats
    layer.blobs[0].data[...] = [1.0, -2.0]
    layer.blobs[1].data[...] = [4.0, 0.5]
    layer.blobs[2].data[...] = [2.0]
    layer.forward(bottom, top)
    eps = float(np.float32(0.001))
    ref = np.empty_like(x)
    for c, (m, v) in enumerate([(0.5, 2.0), (-1.0, 0.25)]):
        ref[:, c] = (x[:, c] - m) / math.sqrt(v + eps)
    np.testing.assert_allclose(top[0].data, ref, rtol=1e-12)
    # Global mode does not touch the statistics.
    np.testing.assert_array_equal(layer.blobs[2].data, [2.0])
    # Factor 0 means "use 0" for mean and variance.
    layer.blobs[2].data[...] = 0
    layer.forward(bottom, top)
    np.testing.assert_allclose(top[0].data, x / math.sqrt(eps), rtol=1e-12)


def test_batchnorm_use_global_stats_overrides_phase():
    x = rand((3, 2, 2))
    layer, _, _ = setup('type: "BatchNorm" batch_norm_param { use_global_stats: false }', [x], phase=TEST)
    assert not layer.use_global_stats
    layer, _, _ = setup('type: "BatchNorm" batch_norm_param { use_global_stats: true }', [x], phase=TRAIN)
    assert layer.use_global_stats


def test_batchnorm_params_are_not_learnable():
    layer, _, _ = setup('type: "BatchNorm"', [rand((2, 3))])
    assert layer.param_propagate_down == [False, False, False]
    assert [p.lr_mult for p in layer.param.param] == [0.0, 0.0, 0.0]
    layer, _, _ = setup('type: "BatchNorm" param { lr_mult: 0 decay_mult: 0 }', [rand((2, 3))])
    assert [p.lr_mult for p in layer.param.param] == [0.0, 0.0, 0.0]
    assert layer.param.param[0].decay_mult == 0.0
    with pytest.raises(CctError, match="lr_mult"):
        setup('type: "BatchNorm" param { lr_mult: 0 } param { lr_mult: 1 }', [rand((2, 3))])


@pytest.mark.parametrize("shape", [(4, 3, 2, 2), (5, 2)])
def test_batchnorm_gradient_batch_stats(shape):
    layer = make_layer('type: "BatchNorm"')
    check_gradient(layer, [make_blob(rand(shape) * 2 + 0.5)], [Blob((), dtype=np.float64)])


def test_batchnorm_gradient_global_stats():
    layer = make_layer('type: "BatchNorm"', TEST)
    x = make_blob(rand((3, 2, 2, 2)))
    t = Blob((), dtype=np.float64)
    layer.setup([x], [t])
    layer.blobs[0].data[...] = [0.3, -0.2]
    layer.blobs[1].data[...] = [1.5, 0.4]
    layer.blobs[2].data[...] = [1.7]
    check_gradient(layer, [x], [t], setup=False)


@pytest.mark.parametrize("phase", [TRAIN, TEST])
def test_batchnorm_in_place(phase):
    x = rand((4, 3, 2, 2))
    dy = rand((4, 3, 2, 2), seed=5)
    results = []
    for in_place in (False, True):
        layer, bottom, top = setup('type: "BatchNorm"', [x], phase=phase, in_place=in_place)
        layer.blobs[0].data[...] = [0.3, -0.2, 0.1]
        layer.blobs[1].data[...] = [1.5, 0.4, 1.0]
        layer.blobs[2].data[...] = [1.0]
        results.append(fwd_bwd(layer, bottom, top, dy) + ([b.data.copy() for b in layer.blobs],))
    (y1, dx1, _, s1), (y2, dx2, _, s2) = results
    np.testing.assert_array_equal(y1, y2)
    np.testing.assert_allclose(dx2[0], dx1[0], rtol=1e-13, atol=1e-15)
    for a, b in zip(s1, s2):
        np.testing.assert_array_equal(a, b)


def test_batchnorm_errors():
    with pytest.raises(CctError, match="at least 2 axes"):
        setup('type: "BatchNorm"', [rand((5,))])
    layer, bottom, top = setup('type: "BatchNorm"', [rand((2, 3, 2))])
    bottom[0].reshape((2, 4, 2))
    with pytest.raises(CctError, match="channels"):
        layer.reshape(bottom, top)
    with pytest.raises(CctError, match="parameter blob"):
        setup('type: "BatchNorm" blobs { shape { dim: 2 } data: 0 data: 0 } '
              'blobs { shape { dim: 3 } data: 1 data: 1 data: 1 } blobs { shape { dim: 1 } data: 1 }',
              [rand((2, 3, 2))])


# ---------------------------------------------------------------------------------------------
# Scale and Bias

def scale_reference(x, s, axis, op):
    """Apply s to x from ``axis`` with explicit index loops."""
    out = np.empty_like(x)
    n = np.ndim(s)
    for idx in np.ndindex(x.shape):
        sv = s[idx[axis:axis + n]] if n else s
        out[idx] = op(x[idx], sv)
    return out


mul = lambda a, b: a * b  # noqa: E731
add = lambda a, b: a + b  # noqa: E731

PARAM_CASES = [
    # (prototxt params, x shape, param shape, axis used in the reference)
    ("", (2, 3, 4), (3,), 1),
    ("axis: 0 num_axes: 2", (2, 3, 4), (2, 3), 0),
    ("axis: -2 num_axes: -1", (2, 3, 4), (3, 4), 1),
    ("num_axes: -1", (2, 3, 2, 2), (3, 2, 2), 1),
    ("num_axes: 0", (2, 3, 4), (), 0),
    ("axis: 2", (2, 3, 4), (4,), 2),
]


@pytest.mark.parametrize("fields,xshape,pshape,axis", PARAM_CASES)
@pytest.mark.parametrize("kind", ["Scale", "Bias"])
def test_learnable_param_forward_and_gradient(kind, fields, xshape, pshape, axis):
    pname = "scale_param" if kind == "Scale" else "bias_param"
    filler = 'filler { type: "gaussian" std: 1 }'
    text = f'type: "{kind}" {pname} {{ {fields} {filler} }}'
    x = rand(xshape)
    layer, bottom, top = setup(text, [x])
    assert len(layer.blobs) == 1 and layer.blobs[0].shape == pshape
    layer.forward(bottom, top)
    ref = scale_reference(x, layer.blobs[0].data, axis, mul if kind == "Scale" else add)
    np.testing.assert_allclose(top[0].data, ref, rtol=1e-14)
    check_gradient(make_layer(text), [make_blob(x)], [Blob((), dtype=np.float64)])


def test_default_fillers():
    layer, _, _ = setup('type: "Scale" scale_param { bias_term: true }', [rand((2, 3, 4))])
    assert [b.shape for b in layer.blobs] == [(3,), (3,)]
    np.testing.assert_array_equal(layer.blobs[0].data, 1)
    np.testing.assert_array_equal(layer.blobs[1].data, 0)
    layer, _, _ = setup('type: "Bias"', [rand((2, 3, 4))])
    np.testing.assert_array_equal(layer.blobs[0].data, 0)
    layer, _, _ = setup('type: "Scale" scale_param { filler { type: "constant" value: 2 } bias_term: true '
                        'bias_filler { type: "constant" value: -1 } }', [rand((2, 3, 4))])
    np.testing.assert_array_equal(layer.blobs[0].data, 2)
    np.testing.assert_array_equal(layer.blobs[1].data, -1)


@pytest.mark.parametrize("fields,xshape,pshape,axis", PARAM_CASES)
def test_scale_with_bias_term(fields, xshape, pshape, axis):
    text = (f'type: "Scale" scale_param {{ {fields} bias_term: true filler {{ type: "gaussian" }} '
            f'bias_filler {{ type: "gaussian" }} }}')
    x = rand(xshape)
    layer, bottom, top = setup(text, [x])
    assert [b.shape for b in layer.blobs] == [pshape, pshape]
    layer.forward(bottom, top)
    s, b = layer.blobs[0].data, layer.blobs[1].data
    ref = scale_reference(scale_reference(x, s, axis, mul), b, axis, add)
    np.testing.assert_allclose(top[0].data, ref, rtol=1e-14)
    check_gradient(make_layer(text), [make_blob(x)], [Blob((), dtype=np.float64)])


TWO_BOTTOM_CASES = [
    ("", (2, 3, 4, 5), (3, 4), 1),
    ("axis: 0", (2, 3, 4), (2,), 0),
    ("axis: -1", (2, 3, 4), (4,), 2),
    ("axis: 1", (2, 3, 4), (), 0),
]


@pytest.mark.parametrize("fields,xshape,sshape,axis", TWO_BOTTOM_CASES)
@pytest.mark.parametrize("kind", ["Scale", "Bias"])
def test_second_bottom_forward_and_gradient(kind, fields, xshape, sshape, axis):
    pname = "scale_param" if kind == "Scale" else "bias_param"
    text = f'type: "{kind}" {pname} {{ {fields} }}'
    x, s = rand(xshape), rand(sshape, seed=1)
    layer, bottom, top = setup(text, [x, s])
    assert layer.blobs == []
    layer.forward(bottom, top)
    ref = scale_reference(x, s, axis, mul if kind == "Scale" else add)
    np.testing.assert_allclose(top[0].data, ref, rtol=1e-14)
    check_gradient(make_layer(text), [make_blob(x), make_blob(s)], [Blob((), dtype=np.float64)])


def test_scale_second_bottom_with_bias_term():
    text = 'type: "Scale" scale_param { bias_term: true bias_filler { type: "gaussian" } }'
    x, s = rand((2, 3, 4, 5)), rand((3, 4), seed=1)
    layer, bottom, top = setup(text, [x, s])
    assert [b.shape for b in layer.blobs] == [(3, 4)]
    layer.forward(bottom, top)
    ref = scale_reference(scale_reference(x, s, 1, mul), layer.blobs[0].data, 1, add)
    np.testing.assert_allclose(top[0].data, ref, rtol=1e-14)
    check_gradient(make_layer(text), [make_blob(x), make_blob(s)], [Blob((), dtype=np.float64)])


def test_param_diffs_accumulate_and_second_bottom_diff_overwrites():
    x, dy = rand((2, 3, 4)), rand((2, 3, 4), seed=2)
    layer, bottom, top = setup('type: "Scale" scale_param { bias_term: true }', [x])
    _, _, pd = fwd_bwd(layer, bottom, top, dy)
    layer.backward(top, [True], bottom)
    np.testing.assert_allclose(layer.blobs[0].diff, 2 * pd[0], rtol=1e-14)
    np.testing.assert_allclose(layer.blobs[1].diff, 2 * pd[1], rtol=1e-14)
    layer, bottom, top = setup('type: "Scale"', [x, rand((3,), seed=4)])
    _, d, _ = fwd_bwd(layer, bottom, top, dy)
    layer.backward(top, [True, True], bottom)
    np.testing.assert_allclose(bottom[1].diff, d[1], rtol=1e-14)


@pytest.mark.parametrize("text,nb", [
    ('type: "Scale" scale_param { bias_term: true filler { type: "gaussian" } bias_filler { type: "gaussian" } }', 1),
    ('type: "Scale" scale_param { bias_term: true bias_filler { type: "gaussian" } }', 2),
    ('type: "Bias" bias_param { filler { type: "gaussian" } }', 1),
    ('type: "Bias"', 2),
])
def test_scale_bias_in_place(text, nb):
    x, s, dy = rand((2, 3, 4)), rand((3,), seed=1), rand((2, 3, 4), seed=2)
    xs = [x, s][:nb]
    out = []
    for in_place in (False, True):
        layer, bottom, top = setup(text, xs, in_place=in_place)
        out.append(fwd_bwd(layer, bottom, top, dy))
    (y1, d1, p1), (y2, d2, p2) = out
    np.testing.assert_array_equal(y1, y2)
    for a, b in zip(d1 + p1, d2 + p2):
        np.testing.assert_allclose(b, a, rtol=1e-14)


@pytest.mark.parametrize("kind", ["Scale", "Bias"])
@pytest.mark.parametrize("fields,shapes,match", [
    ("num_axes: -2", [(2, 3)], "num_axes"),
    ("axis: 1 num_axes: 3", [(2, 3, 4)], "extends past"),
    ("axis: 3", [(2, 3, 4)], "axis"),
    ("", [(2, 3, 4), (4,)], "mismatch"),
    ("axis: 2", [(2, 3, 4), (4, 2)], "extends past"),
])
def test_scale_bias_errors(kind, fields, shapes, match):
    pname = "scale_param" if kind == "Scale" else "bias_param"
    with pytest.raises(CctError, match=match):
        setup(f'type: "{kind}" {pname} {{ {fields} }}', [rand(s) for s in shapes])


def test_scale_bias_param_shape_checked_at_reshape():
    layer, bottom, top = setup('type: "Scale"', [rand((2, 3, 4))])
    bottom[0].reshape((2, 5, 4))
    with pytest.raises(CctError, match="mismatch"):
        layer.reshape(bottom, top)
    with pytest.raises(CctError, match="parameter blob"):
        setup('type: "Scale" scale_param { bias_term: true } blobs { shape { dim: 3 } data: 1 data: 1 data: 1 }',
              [rand((2, 3, 4))])


# ---------------------------------------------------------------------------------------------
# MVN

def mvn_reference(x, normalize_variance=True, across_channels=False, eps=1e-9):
    n, c = x.shape[0], x.shape[1]
    y = np.empty_like(x)
    groups = [(i, None) for i in range(n)] if across_channels else [(i, ch) for i in range(n) for ch in range(c)]
    for i, ch in groups:
        sel = (i,) if ch is None else (i, ch)
        vals = np.ravel(x[sel])
        m = sum(vals) / len(vals)
        out = x[sel] - m
        if normalize_variance:
            sd = math.sqrt(sum((v - m) ** 2 for v in vals) / len(vals))
            out = out / (sd + eps)
        y[sel] = out
    return y


MVN_CASES = [
    ("", dict()),
    ("mvn_param { across_channels: true }", dict(across_channels=True)),
    ("mvn_param { normalize_variance: false }", dict(normalize_variance=False)),
    ("mvn_param { normalize_variance: false across_channels: true }",
     dict(normalize_variance=False, across_channels=True)),
]


@pytest.mark.parametrize("fields,kw", MVN_CASES)
def test_mvn_forward_and_gradient(fields, kw):
    x = rand((2, 3, 2, 3)) * 3 + 1
    layer, bottom, top = setup(f'type: "MVN" {fields}', [x])
    layer.forward(bottom, top)
    np.testing.assert_allclose(top[0].data, mvn_reference(x, **kw), rtol=1e-12, atol=1e-12)
    check_gradient(make_layer(f'type: "MVN" {fields}'), [make_blob(x)], [Blob((), dtype=np.float64)])


def test_mvn_eps_outside_sqrt_and_caffe_backward():
    x = rand((2, 2, 3)) * 0.1
    dy = rand((2, 2, 3), seed=7)
    eps = float(np.float32(0.05))
    layer, bottom, top = setup('type: "MVN" mvn_param { eps: 0.05 }', [x])
    y, d, _ = fwd_bwd(layer, bottom, top, dy)
    np.testing.assert_allclose(y, mvn_reference(x, eps=eps), rtol=1e-12)
    # Caffe's backward: (dy - mean(dy) - y * mean(y * dy)) / (sd + eps), per (n, c) row.
    for i in range(2):
        for c in range(2):
            yy, g = y[i, c], dy[i, c]
            sd = np.sqrt(np.mean((x[i, c] - x[i, c].mean()) ** 2))
            ref = (g - g.mean() - yy * np.mean(yy * g)) / (sd + eps)
            np.testing.assert_allclose(d[0][i, c], ref, rtol=1e-12)


@pytest.mark.parametrize("fields,kw", MVN_CASES)
def test_mvn_in_place(fields, kw):
    x, dy = rand((2, 3, 4)), rand((2, 3, 4), seed=2)
    out = []
    for in_place in (False, True):
        layer, bottom, top = setup(f'type: "MVN" {fields}', [x], in_place=in_place)
        out.append(fwd_bwd(layer, bottom, top, dy))
    np.testing.assert_array_equal(out[0][0], out[1][0])
    np.testing.assert_allclose(out[1][1][0], out[0][1][0], rtol=1e-13, atol=1e-15)


def test_mvn_more_than_4_axes_is_an_error():
    with pytest.raises(CctError, match="axes"):
        setup('type: "MVN"', [rand((2, 2, 2, 2, 2))])


def test_float32_works():
    x = rand((2, 3, 4)).astype(np.float32)
    for text in ('type: "BatchNorm"', 'type: "Scale" scale_param { bias_term: true }', 'type: "MVN"',
                 'type: "Bias"'):
        layer, bottom, top = setup(text, [x])
        y, d, p = fwd_bwd(layer, bottom, top, np.ones_like(x))
        assert y.dtype == np.float32 and d[0].dtype == np.float32
        assert all(b.dtype == np.float32 for b in layer.blobs)
