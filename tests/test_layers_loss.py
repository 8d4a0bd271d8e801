"""Loss and metric layers (cct/layers/loss.py): gradients in float64, forward values against naive loops."""
import math

import numpy as np
import pytest

from cct.blob import Blob
from cct.errors import LayerError
from cct.io import array_to_blobproto, parse_text, write_binaryproto
from cct.layers import create_layer
from cct.proto import caffe_pb2
from cct.testing import check_gradient, make_blob

FLT_MIN = float(np.finfo(np.float32).tiny)


def make_layer(text: str):
    p = caffe_pb2.LayerParameter()
    parse_text(text, p)
    if not p.name:
        p.name = "L"
    return create_layer(p)


def run(layer, bottoms, ntop=1, loss_weight=1.0):
    """setup + forward + backward (propagate to bottom[0] only); returns (tops, bottoms)."""
    bottom = [make_blob(b) for b in bottoms]
    top = [Blob((), dtype=bottom[0].dtype) for _ in range(ntop)]
    layer.setup(bottom, top)
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    top[0].diff[...] = loss_weight
    return top, bottom


def labels(rng, shape, n):
    return rng.integers(0, n, size=shape).astype(np.float64)


# ----------------------------------------------------------------------------------------------
# Softmax
def naive_softmax(x, axis):
    x = np.moveaxis(x, axis, -1)
    out = np.empty_like(x)
    for idx in np.ndindex(*x.shape[:-1]):
        v = x[idx]
        e = np.array([math.exp(a - max(v)) for a in v])
        out[idx] = e / e.sum()
    return np.moveaxis(out, -1, axis)


@pytest.mark.parametrize("axis", [1, 2, -1])
def test_softmax_forward_and_gradient(axis):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4))
    layer = make_layer(f'type: "Softmax" softmax_param {{ axis: {axis} }}')
    b, t = make_blob(x), Blob((), dtype=np.float64)
    layer.setup([b], [t])
    layer.forward([b], [t])
    np.testing.assert_allclose(t.data, naive_softmax(x, axis), rtol=1e-12)
    check_gradient(layer, [b], [t])


def test_softmax_stable_and_inplace():
    x = np.array([[1000.0, 1001.0, 999.0]])
    layer = make_layer('type: "Softmax"')
    b = make_blob(x)
    layer.setup([b], [b])
    layer.forward([b], [b])
    assert np.all(np.isfinite(b.data))
    np.testing.assert_allclose(b.data, naive_softmax(x - 1000, 1), rtol=1e-12)
    y = b.data.copy()
    b.diff[...] = [[1.0, 0.0, 0.0]]
    layer.backward([b], [True], [b])
    expected = (np.array([[1.0, 0, 0]]) - y[0, 0]) * y
    np.testing.assert_allclose(b.diff, expected, rtol=1e-12)


# ----------------------------------------------------------------------------------------------
# SoftmaxWithLoss
def naive_softmax_loss(x, lab, axis, ignore=None, mode="VALID"):
    p = naive_softmax(x, axis)
    p = np.moveaxis(p, axis, -1)
    outer = int(np.prod(x.shape[:axis]))
    inner = int(np.prod(x.shape[axis + 1:]))
    p = p.reshape(outer * inner, -1)
    lab = lab.reshape(-1)
    loss, count = 0.0, 0
    for i in range(outer * inner):
        if ignore is not None and int(lab[i]) == ignore:
            continue
        loss -= math.log(max(p[i, int(lab[i])], FLT_MIN))
        count += 1
    norm = {"FULL": outer * inner, "VALID": count, "BATCH_SIZE": outer, "NONE": 1}[mode]
    return loss / max(1, norm)


def test_softmax_loss_plain_forward_gradient():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 5))
    lab = labels(rng, (4,), 5)
    layer = make_layer('type: "SoftmaxWithLoss"')
    (top,), _ = run(layer, [x, lab])
    assert top.shape == ()
    assert float(top.data) == pytest.approx(naive_softmax_loss(x, lab, 1), rel=1e-12)
    check_gradient(layer, [make_blob(x), make_blob(lab)], [Blob((), dtype=np.float64)], check_bottom=[0])


@pytest.mark.parametrize("mode", ["FULL", "VALID", "BATCH_SIZE", "NONE"])
def test_softmax_loss_ignore_label_normalization_spatial(mode):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 4, 3, 2))
    lab = labels(rng, (2, 1, 3, 2), 4)
    lab.reshape(-1)[[0, 3, 7]] = 255
    text = f'type: "SoftmaxWithLoss" loss_param {{ ignore_label: 255 normalization: {mode} }}'
    layer = make_layer(text)
    (top,), _ = run(layer, [x, lab])
    assert float(top.data) == pytest.approx(naive_softmax_loss(x, lab, 1, 255, mode), rel=1e-12)
    check_gradient(make_layer(text), [make_blob(x), make_blob(lab)], [Blob((), dtype=np.float64)],
                   check_bottom=[0])
    # ignored positions get exactly zero gradient
    layer.backward([top], [True, False], _)
    g = np.moveaxis(_[0].diff, 1, -1).reshape(-1, 4)
    assert np.all(g[[0, 3, 7]] == 0)


def test_softmax_loss_axis2_and_prob_top():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 4))
    lab = labels(rng, (2, 3), 4)
    text = 'type: "SoftmaxWithLoss" softmax_param { axis: 2 }'
    layer = make_layer(text)
    (top, prob), _ = run(layer, [x, lab], ntop=2)
    assert float(top.data) == pytest.approx(naive_softmax_loss(x, lab, 2), rel=1e-12)
    np.testing.assert_allclose(prob.data, naive_softmax(x, 2), rtol=1e-12)
    check_gradient(make_layer(text), [make_blob(x), make_blob(lab)],
                   [Blob((), dtype=np.float64), Blob((), dtype=np.float64)],
                   check_bottom=[0], top_weights=[np.array(1.7), None])


@pytest.mark.parametrize("flag,mode", [("false", "BATCH_SIZE"), ("true", "VALID")])
def test_softmax_loss_legacy_normalize(flag, mode):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 4, 2))
    lab = labels(rng, (3, 2), 4)
    lab[0, 0] = 7
    layer = make_layer(f'type: "SoftmaxWithLoss" loss_param {{ ignore_label: 7 normalize: {flag} }}')
    (top,), _ = run(layer, [x, lab])
    assert float(top.data) == pytest.approx(naive_softmax_loss(x, lab, 1, 7, mode), rel=1e-12)
    # normalization set explicitly wins over normalize
    layer = make_layer(f'type: "SoftmaxWithLoss" loss_param {{ normalize: {flag} normalization: NONE }}')
    (top,), _ = run(layer, [x, np.zeros((3, 2))])
    assert float(top.data) == pytest.approx(naive_softmax_loss(x, np.zeros((3, 2)), 1, None, "NONE"), rel=1e-12)


def test_softmax_loss_all_ignored_and_loss_weight():
    x = np.random.default_rng(5).standard_normal((2, 3))
    layer = make_layer('type: "SoftmaxWithLoss" loss_param { ignore_label: 1 }')
    (top,), bottom = run(layer, [x, np.ones(2)])
    assert float(top.data) == 0.0  # normaliser clamped to >= 1, no NaN
    layer.backward([top], [True, False], bottom)
    assert np.all(bottom[0].diff == 0)
    # the loss weight (top diff) scales the gradient
    layer = make_layer('type: "SoftmaxWithLoss"')
    lab = np.array([0.0, 2.0])
    (top,), bottom = run(layer, [x, lab], loss_weight=2.5)
    layer.backward([top], [True, False], bottom)
    p = naive_softmax(x, 1)
    p[[0, 1], [0, 2]] -= 1
    np.testing.assert_allclose(bottom[0].diff, 2.5 * p / 2, rtol=1e-12)


def test_softmax_loss_float32():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((4, 5)).astype(np.float32)
    lab = labels(rng, (4,), 5).astype(np.float32)
    layer = make_layer('type: "SoftmaxWithLoss"')
    (top,), bottom = run(layer, [x, lab])
    assert top.data.dtype == np.float32
    assert float(top.data) == pytest.approx(naive_softmax_loss(x.astype(np.float64), lab, 1), rel=1e-5)
    layer.backward([top], [True, False], bottom)
    assert bottom[0].diff.dtype == np.float32


def test_softmax_loss_errors():
    layer = make_layer('name: "sl" type: "SoftmaxWithLoss"')
    with pytest.raises(LayerError, match=r"'sl'.*\[4, 5\].*\[4, 2\]"):
        run(layer, [np.zeros((4, 5)), np.zeros((4, 2))])
    layer = make_layer('name: "sl" type: "SoftmaxWithLoss"')
    with pytest.raises(LayerError, match="same first dimension"):
        run(layer, [np.zeros((4, 5)), np.zeros((3,))])
    layer = make_layer('name: "sl" type: "SoftmaxWithLoss"')
    with pytest.raises(LayerError, match="out of range"):
        run(layer, [np.zeros((2, 5)), np.array([1.0, 5.0])])
    layer = make_layer('name: "sl" type: "SoftmaxWithLoss"')
    (top,), bottom = run(layer, [np.zeros((2, 5)), np.array([1.0, 4.0])])
    assert not layer.allow_force_backward(1) and layer.allow_force_backward(0)
    with pytest.raises(LayerError, match="cannot backpropagate to label"):
        layer.backward([top], [True, True], bottom)


# ----------------------------------------------------------------------------------------------
# EuclideanLoss
def test_euclidean_loss():
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal((3, 4, 2)), rng.standard_normal((3, 8))
    layer = make_layer('type: "EuclideanLoss"')
    (top,), _ = run(layer, [a, b])
    ref = sum((a.reshape(-1)[i] - b.reshape(-1)[i]) ** 2 for i in range(24)) / 3 / 2
    assert float(top.data) == pytest.approx(ref, rel=1e-12)
    assert layer.allow_force_backward(0) and layer.allow_force_backward(1)
    check_gradient(make_layer('type: "EuclideanLoss"'), [make_blob(a), make_blob(b)], [Blob((), dtype=np.float64)])
    with pytest.raises(LayerError, match="same dimension"):
        run(make_layer('type: "EuclideanLoss"'), [a, rng.standard_normal((3, 7))])


# ----------------------------------------------------------------------------------------------
# SigmoidCrossEntropyLoss
def naive_sigmoid_ce(x, t, ignore=None, mode="BATCH_SIZE"):
    loss, count = 0.0, 0
    for xi, ti in zip(x.reshape(-1), t.reshape(-1)):
        if ignore is not None and int(ti) == ignore:
            continue
        p = 1 / (1 + math.exp(-xi))
        loss -= ti * math.log(p) + (1 - ti) * math.log(1 - p)
        count += 1
    norm = {"FULL": x.size, "VALID": count, "BATCH_SIZE": x.shape[0], "NONE": 1}[mode]
    return loss / max(1, norm)


def test_sigmoid_ce_default_batch_size():
    rng = np.random.default_rng(8)
    x, t = rng.standard_normal((3, 4)) * 3, rng.random((3, 4))
    layer = make_layer('type: "SigmoidCrossEntropyLoss"')
    (top,), _ = run(layer, [x, t])
    assert float(top.data) == pytest.approx(naive_sigmoid_ce(x, t), rel=1e-10)
    check_gradient(make_layer('type: "SigmoidCrossEntropyLoss"'), [make_blob(x), make_blob(t)],
                   [Blob((), dtype=np.float64)], check_bottom=[0])


def test_sigmoid_ce_stable_large_inputs():
    x = np.array([[500.0, -500.0]])
    t = np.array([[0.0, 1.0]])
    (top,), _ = run(make_layer('type: "SigmoidCrossEntropyLoss"'), [x, t])
    assert float(top.data) == pytest.approx(1000.0)


@pytest.mark.parametrize("mode", ["FULL", "VALID", "BATCH_SIZE", "NONE"])
def test_sigmoid_ce_ignore_label_modes(mode):
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 5))
    t = (rng.random((2, 5)) > 0.5).astype(np.float64)
    t[0, 1] = t[1, 3] = -1
    text = f'type: "SigmoidCrossEntropyLoss" loss_param {{ ignore_label: -1 normalization: {mode} }}'
    (top,), bottom = run(make_layer(text), [x, t])
    assert float(top.data) == pytest.approx(naive_sigmoid_ce(x, t, -1, mode), rel=1e-10)
    layer = make_layer(text)
    check_gradient(layer, [make_blob(x), make_blob(t)], [Blob((), dtype=np.float64)], check_bottom=[0])


# ----------------------------------------------------------------------------------------------
# HingeLoss
def naive_hinge(x, lab, p):
    n, d = x.shape
    loss = 0.0
    for i in range(n):
        for j in range(d):
            s = -1.0 if j == int(lab[i]) else 1.0
            loss += max(0.0, 1 + s * x[i, j]) ** p
    return loss / n


@pytest.mark.parametrize("norm,p", [("L1", 1), ("L2", 2)])
def test_hinge_loss(norm, p):
    rng = np.random.default_rng(10)
    x = rng.uniform(-2, 2, (4, 5))
    x[np.abs(np.abs(x) - 1) < 0.05] += 0.2  # keep away from the hinge kinks at |x| = 1
    lab = labels(rng, (4,), 5)
    text = f'type: "HingeLoss" hinge_loss_param {{ norm: {norm} }}'
    (top,), _ = run(make_layer(text), [x, lab])
    assert float(top.data) == pytest.approx(naive_hinge(x, lab, p), rel=1e-12)
    check_gradient(make_layer(text), [make_blob(x), make_blob(lab)], [Blob((), dtype=np.float64)],
                   check_bottom=[0], stepsize=1e-4)


# ----------------------------------------------------------------------------------------------
# ContrastiveLoss
def naive_contrastive(a, b, sim, margin, legacy):
    n = a.shape[0]
    loss = 0.0
    for i in range(n):
        d2 = float(((a[i] - b[i]) ** 2).sum())
        if int(sim[i]):
            loss += d2
        elif legacy:
            loss += max(margin - d2, 0.0)
        else:
            loss += max(margin - math.sqrt(d2), 0.0) ** 2
    return loss / n / 2


@pytest.mark.parametrize("legacy", [False, True])
def test_contrastive_loss(legacy):
    rng = np.random.default_rng(11)
    a, b = rng.uniform(-0.4, 0.4, (6, 3)), rng.uniform(-0.4, 0.4, (6, 3))
    sim = np.array([1.0, 0, 0, 1, 0, 0])
    margin = 1.0 if not legacy else 0.5
    text = (f'type: "ContrastiveLoss" contrastive_loss_param {{ margin: {margin} '
            f'legacy_version: {"true" if legacy else "false"} }}')
    (top,), _ = run(make_layer(text), [a, b, sim])
    assert float(top.data) == pytest.approx(naive_contrastive(a, b, sim, margin, legacy), rel=1e-6)
    layer = make_layer(text)
    assert layer.allow_force_backward(1) and not layer.allow_force_backward(2)
    # Caffe's non-legacy gradient divides by (d + 1e-4): a slightly looser threshold.
    check_gradient(layer, [make_blob(a), make_blob(b), make_blob(sim)], [Blob((), dtype=np.float64)],
                   check_bottom=[0, 1], threshold=1e-4 if legacy else 2e-3)


def test_contrastive_shape_errors():
    with pytest.raises(LayerError, match="bottom\\[2\\]"):
        run(make_layer('type: "ContrastiveLoss"'), [np.zeros((2, 3)), np.zeros((2, 3)), np.zeros((2, 2))])


# ----------------------------------------------------------------------------------------------
# MultinomialLogisticLoss
def test_multinomial_logistic_loss():
    rng = np.random.default_rng(12)
    p = rng.uniform(0.05, 1.0, (4, 5))
    lab = labels(rng, (4,), 5)
    (top,), _ = run(make_layer('type: "MultinomialLogisticLoss"'), [p, lab])
    ref = -sum(math.log(p[i, int(lab[i])]) for i in range(4)) / 4
    assert float(top.data) == pytest.approx(ref, rel=1e-12)
    check_gradient(make_layer('type: "MultinomialLogisticLoss"'), [make_blob(p), make_blob(lab)],
                   [Blob((), dtype=np.float64)], check_bottom=[0], stepsize=1e-5)
    # log threshold 1e-20: a zero probability costs -log(1e-20), not inf
    p[0, int(lab[0])] = 0.0
    (top,), _ = run(make_layer('type: "MultinomialLogisticLoss"'), [p, lab])
    ref0 = (-math.log(1e-20) - sum(math.log(p[i, int(lab[i])]) for i in range(1, 4))) / 4
    assert float(top.data) == pytest.approx(ref0, rel=1e-12)


# ----------------------------------------------------------------------------------------------
# InfogainLoss
def naive_infogain(x, lab, H, ignore=None, mode="VALID"):
    p = naive_softmax(x, 1)
    n = x.shape[0]
    loss, count = 0.0, 0
    for i in range(n):
        li = int(lab[i])
        if ignore is not None and li == ignore:
            continue
        for k in range(x.shape[1]):
            loss -= H[li, k] * math.log(max(p[i, k], 1e-20))
        count += 1
    norm = {"FULL": n, "VALID": count, "BATCH_SIZE": n, "NONE": 1}[mode]
    return loss / max(1, norm)


def test_infogain_loss_H_from_file(tmp_path):
    rng = np.random.default_rng(13)
    x = rng.standard_normal((4, 5))
    lab = labels(rng, (4,), 5)
    H = rng.random((5, 5))
    path = tmp_path / "H.binaryproto"
    write_binaryproto(path, array_to_blobproto(H.reshape(1, 1, 5, 5)))
    text = f'type: "InfogainLoss" infogain_loss_param {{ source: "{path}" }}'
    (top, prob), _ = run(make_layer(text), [x, lab], ntop=2)
    H32 = H.astype(np.float32).astype(np.float64)  # the binaryproto stores float32
    assert float(top.data) == pytest.approx(naive_infogain(x, lab, H32), rel=1e-12)
    np.testing.assert_allclose(prob.data, naive_softmax(x, 1), rtol=1e-12)
    check_gradient(make_layer(text), [make_blob(x), make_blob(lab)], [Blob((), dtype=np.float64)],
                   check_bottom=[0])


@pytest.mark.parametrize("mode", ["VALID", "FULL", "NONE"])
def test_infogain_loss_H_bottom_ignore(mode):
    rng = np.random.default_rng(14)
    x = rng.standard_normal((5, 4))
    lab = labels(rng, (5,), 4)
    lab[2] = 9
    H = rng.random((4, 4))
    text = f'type: "InfogainLoss" loss_param {{ ignore_label: 9 normalization: {mode} }}'
    layer = make_layer(text)
    (top,), _ = run(layer, [x, lab, H])
    assert float(top.data) == pytest.approx(naive_infogain(x, lab, H, 9, mode), rel=1e-12)
    assert not layer.allow_force_backward(1) and not layer.allow_force_backward(2)
    check_gradient(make_layer(text), [make_blob(x), make_blob(lab), make_blob(H)], [Blob((), dtype=np.float64)],
                   check_bottom=[0])


def test_infogain_errors(tmp_path):
    with pytest.raises(LayerError, match="source must be specified"):
        run(make_layer('type: "InfogainLoss"'), [np.zeros((2, 3)), np.zeros(2)])
    with pytest.raises(LayerError, match="H must be 3x3"):
        run(make_layer('type: "InfogainLoss"'), [np.zeros((2, 3)), np.zeros(2), np.zeros((2, 2))])
    with pytest.raises(LayerError, match="normalize is deprecated"):
        run(make_layer('type: "InfogainLoss" loss_param { normalize: true }'),
            [np.zeros((2, 3)), np.zeros(2), np.zeros((3, 3))])
    with pytest.raises(LayerError, match="cannot read"):
        run(make_layer(f'type: "InfogainLoss" infogain_loss_param {{ source: "{tmp_path}/nope" }}'),
            [np.zeros((2, 3)), np.zeros(2)])


def test_infogain_reference_case(monkeypatch):
    """The Caffe reference case reads H relative to the working directory, as Caffe does."""
    from refcase import case_dir, max_rel_err, reference_available, run_case_layerwise

    if not reference_available():
        pytest.skip("reference data not present")
    monkeypatch.chdir(case_dir("infogain_loss_Hfile"))
    results = run_case_layerwise("infogain_loss_Hfile")
    assert results
    for what, ours, theirs in results:
        assert max_rel_err(ours, theirs) <= 1e-4, what


# ----------------------------------------------------------------------------------------------
# Accuracy
def naive_accuracy(x, lab, k, axis=1, ignore=None):
    xm = np.moveaxis(x, axis, -1).reshape(-1, x.shape[axis])
    lab = lab.reshape(-1)
    correct, count = 0, 0
    nc = x.shape[axis]
    per_n, per_c = np.zeros(nc), np.zeros(nc)
    for i in range(xm.shape[0]):
        li = int(lab[i])
        if ignore is not None and li == ignore:
            continue
        better = sum(1 for c in range(nc) if c != li and xm[i, c] >= xm[i, li])
        count += 1
        per_n[li] += 1
        if better < k:
            correct += 1
            per_c[li] += 1
    per = np.where(per_n == 0, 0, per_c / np.maximum(per_n, 1))
    return (correct / count if count else 0.0), per


@pytest.mark.parametrize("k", [1, 2, 3])
def test_accuracy_top_k_and_per_class(k):
    rng = np.random.default_rng(15)
    x = rng.standard_normal((20, 5))
    x[3, 1] = x[3, 2]  # a tie
    lab = labels(rng, (20,), 5)
    lab[3] = 2
    layer = make_layer(f'type: "Accuracy" accuracy_param {{ top_k: {k} }}')
    (acc, per), _ = run(layer, [x, lab], ntop=2)
    ref, ref_per = naive_accuracy(x, lab, k)
    assert acc.shape == () and per.shape == (5,)
    assert float(acc.data) == pytest.approx(ref)
    np.testing.assert_allclose(per.data, ref_per)
    assert not layer.allow_force_backward(0)
    with pytest.raises(LayerError):
        layer.backward([acc, per], [True, False], _)


def test_accuracy_tie_counts_against():
    x = np.array([[1.0, 1.0, 0.0]])
    (acc,), _ = run(make_layer('type: "Accuracy"'), [x, np.array([1.0])])
    assert float(acc.data) == 0.0  # class 0 ties with the true class 1: ranks above it


def test_accuracy_ignore_label_spatial_axis():
    rng = np.random.default_rng(16)
    x = rng.standard_normal((2, 4, 3))
    lab = labels(rng, (2, 3), 4)
    lab[0, 1] = lab[1, 2] = -1
    layer = make_layer('type: "Accuracy" accuracy_param { axis: 1 ignore_label: -1 top_k: 2 }')
    (acc, per), _ = run(layer, [x, lab], ntop=2)
    ref, ref_per = naive_accuracy(x, lab, 2, 1, -1)
    assert float(acc.data) == pytest.approx(ref)
    np.testing.assert_allclose(per.data, ref_per)
    # all ignored -> 0, not NaN
    (acc,), _ = run(make_layer('type: "Accuracy" accuracy_param { ignore_label: 0 }'), [x, np.zeros((2, 3))])
    assert float(acc.data) == 0.0


def test_accuracy_errors():
    with pytest.raises(LayerError, match="top_k"):
        run(make_layer('name: "acc" type: "Accuracy" accuracy_param { top_k: 6 }'),
            [np.zeros((2, 5)), np.zeros(2)])
    with pytest.raises(LayerError, match=r"'acc'.*\[2, 5, 2\].*\[2\]"):
        run(make_layer('name: "acc" type: "Accuracy"'), [np.zeros((2, 5, 2)), np.zeros(2)])


def test_loss_layers_declare_loss_and_0d_top():
    for t in ("SoftmaxWithLoss", "EuclideanLoss", "SigmoidCrossEntropyLoss", "HingeLoss",
              "ContrastiveLoss", "MultinomialLogisticLoss", "InfogainLoss"):
        layer = make_layer(f'type: "{t}"')
        assert layer.is_loss and layer.loss_weight(0) == 1.0
    assert not make_layer('type: "Accuracy"').is_loss
