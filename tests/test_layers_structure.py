"""Structure layers (cct/layers/ routing, eltwise, reshaping, reduction, embed, selection, silence,
parameter): forward vs direct references, float64 gradient checks,
Caffe's shapes, tie rules and error cases."""
from __future__ import annotations

import numpy as np
import pytest

from cct.blob import Blob
from cct.errors import LayerError
from cct.io.prototxt import parse_text
from cct.layers import create_layer
from cct.proto import caffe_pb2
from cct.testing import check_gradient, make_blob


def make_layer(text: str, name: str = "L"):
    """A layer from the body of a prototxt ``layer { ... }`` (name defaults to 'L')."""
    lp = caffe_pb2.LayerParameter()
    parse_text(f'name: "{name}"\n' + text, lp)
    return create_layer(lp)


def rnd(*shape, seed=0, dtype=np.float64):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def tops(n=1, dtype=np.float64):
    return [Blob((), dtype=dtype) for _ in range(n)]


def run(layer, bottom, top):
    layer.setup(bottom, top)
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    return top


def backward(layer, top, bottom, diffs, prop=None):
    for t, d in zip(top, diffs):
        t.diff[...] = d
    prop = [True] * len(bottom) if prop is None else prop
    layer.backward(top, prop, bottom)


# ----------------------------------------------------------------------------------------- Concat
@pytest.mark.parametrize("axis_text,axis,shapes", [
    ("axis: 1", 1, [(2, 2, 3), (2, 3, 3), (2, 1, 3)]),
    ("axis: -1", 2, [(2, 3, 1), (2, 3, 4)]),
    ("concat_dim: 0", 0, [(1, 3, 2), (3, 3, 2)]),
])
def test_concat_forward_backward(axis_text, axis, shapes):
    layer = make_layer(f'type: "Concat" concat_param {{ {axis_text} }}')
    arrs = [rnd(*s, seed=i) for i, s in enumerate(shapes)]
    bottom = [make_blob(a) for a in arrs]
    top = run(layer, bottom, tops())
    np.testing.assert_array_equal(top[0].data, np.concatenate(arrs, axis=axis))
    check_gradient(layer, bottom, top)


def test_concat_default_axis_and_single_bottom_shares():
    layer = make_layer('type: "Concat"')
    a = make_blob(rnd(2, 3))
    top = run(layer, [a], tops())
    assert top[0].shape == (2, 3)
    a.data[0, 0] = 42.0
    assert top[0].data[0, 0] == 42.0
    top[0].diff[1, 2] = 7.0
    assert a.diff[1, 2] == 7.0


def test_concat_mismatch_names_layer_and_shapes():
    layer = make_layer('type: "Concat" concat_param { axis: 1 }', name="cat1")
    bottom = [make_blob(rnd(2, 3, 4)), make_blob(rnd(2, 3, 5))]
    with pytest.raises(LayerError) as e:
        layer.setup(bottom, tops())
    msg = str(e.value)
    assert "cat1" in msg and "[2, 3, 4]" in msg and "[2, 3, 5]" in msg


def test_concat_errors():
    with pytest.raises(LayerError, match="not both"):
        make_layer('type: "Concat" concat_param { axis: 1 concat_dim: 1 }').setup(
            [make_blob(rnd(2, 2)), make_blob(rnd(2, 2))], tops())
    with pytest.raises(LayerError, match="#axes"):
        make_layer('type: "Concat"').setup([make_blob(rnd(2, 2)), make_blob(rnd(2, 2, 1))], tops())
    with pytest.raises(LayerError, match="out of range"):
        make_layer('type: "Concat" concat_param { axis: 3 }').setup(
            [make_blob(rnd(2, 2)), make_blob(rnd(2, 2))], tops())
    with pytest.raises(LayerError, match="concat_dim"):
        make_layer('type: "Concat" concat_param { concat_dim: 2 }').setup(
            [make_blob(rnd(2, 2)), make_blob(rnd(2, 2))], tops())


# ------------------------------------------------------------------------------------------ Slice
def test_slice_points_forward_backward():
    layer = make_layer('type: "Slice" slice_param { axis: 1 slice_point: 1 slice_point: 3 }')
    x = rnd(2, 5, 3)
    bottom = [make_blob(x)]
    top = run(layer, bottom, tops(3))
    np.testing.assert_array_equal(top[0].data, x[:, :1])
    np.testing.assert_array_equal(top[1].data, x[:, 1:3])
    np.testing.assert_array_equal(top[2].data, x[:, 3:])
    check_gradient(layer, bottom, top)


def test_slice_equal_split_legacy_dim():
    layer = make_layer('type: "Slice" slice_param { slice_dim: 0 }')
    x = rnd(4, 3)
    bottom = [make_blob(x)]
    top = run(layer, bottom, tops(2))
    np.testing.assert_array_equal(top[0].data, x[:2])
    np.testing.assert_array_equal(top[1].data, x[2:])
    check_gradient(layer, bottom, top)
    # default axis 1, negative axis
    layer = make_layer('type: "Slice" slice_param { axis: -1 }')
    top = run(layer, [make_blob(rnd(2, 3, 6))], tops(3))
    assert [t.shape for t in top] == [(2, 3, 2)] * 3


def test_slice_errors():
    b = lambda: [make_blob(rnd(2, 5))]  # noqa: E731
    with pytest.raises(LayerError, match="strictly increasing"):
        make_layer('type: "Slice" slice_param { slice_point: 3 slice_point: 2 }').setup(b(), tops(3))
    with pytest.raises(LayerError, match="strictly increasing"):
        make_layer('type: "Slice" slice_param { slice_point: 0 }').setup(b(), tops(2))
    with pytest.raises(LayerError, match="slice_point"):
        make_layer('type: "Slice" slice_param { slice_point: 2 }').setup(b(), tops(3))
    with pytest.raises(LayerError, match="evenly divide"):
        make_layer('type: "Slice"').setup(b(), tops(2))
    with pytest.raises(LayerError, match="beyond"):
        make_layer('type: "Slice" slice_param { slice_point: 6 }').setup(b(), tops(2))
    with pytest.raises(LayerError, match="not both"):
        make_layer('type: "Slice" slice_param { axis: 1 slice_dim: 1 }').setup(b(), tops(5))


# ------------------------------------------------------------------------------------------ Split
def test_split_shares_data_and_sums_diffs():
    layer = make_layer('type: "Split"')
    x = rnd(2, 3)
    bottom = [make_blob(x)]
    top = run(layer, bottom, tops(3))
    for t in top:
        np.testing.assert_array_equal(t.data, x)
    bottom[0].data[0, 0] = 5.0
    assert all(t.data[0, 0] == 5.0 for t in top)
    diffs = [rnd(2, 3, seed=s) for s in (1, 2, 3)]
    backward(layer, top, bottom, diffs)
    np.testing.assert_allclose(bottom[0].diff, diffs[0] + diffs[1] + diffs[2])
    check_gradient(layer, bottom, top)


def test_split_rejects_in_place():
    b = make_blob(rnd(2))
    with pytest.raises(LayerError, match="in-place"):
        make_layer('type: "Split"').setup([b], [b, Blob((), dtype=np.float64)])


# ---------------------------------------------------------------------------------------- Eltwise
def three_bottoms(shape=(2, 3, 2)):
    return [rnd(*shape, seed=s) for s in (1, 2, 3)]


@pytest.mark.parametrize("stable", ["true", "false"])
def test_eltwise_prod(stable):
    layer = make_layer(f'type: "Eltwise" eltwise_param {{ operation: PROD stable_prod_grad: {stable} }}')
    arrs = three_bottoms()
    bottom = [make_blob(a) for a in arrs]
    top = run(layer, bottom, tops())
    np.testing.assert_allclose(top[0].data, arrs[0] * arrs[1] * arrs[2])
    check_gradient(layer, bottom, top)


def test_eltwise_sum_coeff():
    layer = make_layer('type: "Eltwise" eltwise_param { operation: SUM coeff: 1 coeff: -0.5 coeff: 2 }')
    arrs = three_bottoms()
    bottom = [make_blob(a) for a in arrs]
    top = run(layer, bottom, tops())
    np.testing.assert_allclose(top[0].data, arrs[0] - 0.5 * arrs[1] + 2 * arrs[2])
    check_gradient(layer, bottom, top)
    # default operation is SUM without coeffs
    layer = make_layer('type: "Eltwise"')
    top = run(layer, [make_blob(a) for a in arrs[:2]], tops())
    np.testing.assert_allclose(top[0].data, arrs[0] + arrs[1])


def test_eltwise_max_forward_and_gradient_away_from_ties():
    rng = np.random.default_rng(5)
    # distinct values 0.1 apart so finite differences never cross a tie
    vals = rng.permuted(np.tile(np.arange(3) * 0.1, (12, 1)), axis=1) + rng.standard_normal((12, 1))
    arrs = [vals[:, k].reshape(3, 4).copy() for k in range(3)]
    layer = make_layer('type: "Eltwise" eltwise_param { operation: MAX }')
    bottom = [make_blob(a) for a in arrs]
    top = run(layer, bottom, tops())
    np.testing.assert_array_equal(top[0].data, np.maximum(np.maximum(arrs[0], arrs[1]), arrs[2]))
    check_gradient(layer, bottom, top)


def test_eltwise_max_ties_follow_caffe():
    # Caffe: bottom0 vs bottom1 uses a > b (tie -> bottom1); later bottoms replace only when strictly greater.
    a = np.array([1.0, 2.0, 0.0, 5.0])
    b = np.array([1.0, 1.0, 3.0, 1.0])
    c = np.array([0.0, 2.0, 3.0, 5.0])
    layer = make_layer('type: "Eltwise" eltwise_param { operation: MAX }')
    bottom = [make_blob(x) for x in (a, b, c)]
    top = run(layer, bottom, tops())
    backward(layer, top, bottom, [np.array([10.0, 20.0, 30.0, 40.0])])
    np.testing.assert_array_equal(bottom[0].diff, [0, 20, 0, 40])
    np.testing.assert_array_equal(bottom[1].diff, [10, 0, 30, 0])
    np.testing.assert_array_equal(bottom[2].diff, [0, 0, 0, 0])


def test_eltwise_errors():
    b = lambda n: [make_blob(rnd(2, 2, seed=i)) for i in range(n)]  # noqa: E731
    with pytest.raises(LayerError, match="one coefficient per bottom"):
        make_layer('type: "Eltwise" eltwise_param { coeff: 1 }').setup(b(2), tops())
    with pytest.raises(LayerError, match="only takes coefficients for summation"):
        make_layer('type: "Eltwise" eltwise_param { operation: PROD coeff: 1 coeff: 2 }').setup(b(2), tops())
    with pytest.raises(LayerError, match=r"bottom\[1\]"):
        make_layer('type: "Eltwise"').setup([make_blob(rnd(2, 2)), make_blob(rnd(2, 3))], tops())
    with pytest.raises(LayerError, match="at least 2"):
        make_layer('type: "Eltwise"').setup(b(1), tops())


# ---------------------------------------------------------------------------------------- Flatten
@pytest.mark.parametrize("params,shape", [
    ("", (2, 60)),
    ("flatten_param { axis: 2 }", (2, 3, 20)),
    ("flatten_param { axis: 0 end_axis: 1 }", (6, 4, 5)),
    ("flatten_param { axis: -3 end_axis: -2 }", (2, 12, 5)),
])
def test_flatten(params, shape):
    layer = make_layer(f'type: "Flatten" {params}')
    x = rnd(2, 3, 4, 5)
    bottom = [make_blob(x)]
    top = run(layer, bottom, tops())
    assert top[0].shape == shape
    np.testing.assert_array_equal(top[0].data, x.reshape(shape))
    top[0].diff[...] = rnd(*shape, seed=3)
    np.testing.assert_array_equal(bottom[0].diff, top[0].diff.reshape(x.shape))
    check_gradient(layer, [make_blob(rnd(2, 3, 2, 1))], tops())


def test_flatten_in_place_rejected():
    b = make_blob(rnd(2, 3))
    with pytest.raises(LayerError, match="in-place"):
        make_layer('type: "Flatten"').setup([b], [b])


# ---------------------------------------------------------------------------------------- Reshape
@pytest.mark.parametrize("params,shape", [
    ("shape { dim: 0 dim: -1 dim: 2 }", (2, 30, 2)),
    ("shape { dim: -1 }", (120,)),
    ("shape { dim: 0 dim: 0 dim: 20 }", (2, 3, 20)),
    ("shape { dim: -1 } axis: 1 num_axes: 2", (2, 12, 5)),
    ("shape { dim: 1 } axis: -1 num_axes: 0", (2, 3, 4, 5, 1)),
    ("shape { dim: 1 dim: 1 } axis: 0 num_axes: 0", (1, 1, 2, 3, 4, 5)),
    ("shape { dim: 1 dim: 0 dim: -1 } axis: 1", (2, 1, 4, 15)),
    ("shape { } axis: 1 num_axes: 0", (2, 3, 4, 5)),
])
def test_reshape_shapes(params, shape):
    layer = make_layer(f'type: "Reshape" reshape_param {{ {params} }}')
    x = rnd(2, 3, 4, 5)
    bottom = [make_blob(x)]
    top = run(layer, bottom, tops())
    assert top[0].shape == shape
    np.testing.assert_array_equal(top[0].data, x.reshape(shape))
    top[0].diff[...] = rnd(*shape, seed=4)
    np.testing.assert_array_equal(bottom[0].diff, top[0].diff.reshape(x.shape))


def test_reshape_gradient():
    layer = make_layer('type: "Reshape" reshape_param { shape { dim: 0 dim: -1 } }')
    check_gradient(layer, [make_blob(rnd(2, 3, 2))], tops())


@pytest.mark.parametrize("params,match", [
    ("shape { dim: -1 dim: -1 }", "multiple -1"),
    ("shape { dim: 0 dim: 0 dim: 0 dim: 0 dim: 0 }", "no corresponding bottom axis"),
    ("shape { dim: 7 dim: -1 }", "divisible"),
    ("shape { dim: 7 }", "output count must match input count"),
    ("shape { dim: -1 } axis: 5", "out of range"),
    ("shape { dim: -1 } axis: 1 num_axes: 4", "end_axis"),
    ("shape { dim: -1 } num_axes: -2", "num_axes"),
    ("shape { dim: -2 }", "dims must be"),
])
def test_reshape_errors(params, match):
    layer = make_layer(f'type: "Reshape" reshape_param {{ {params} }}', name="rs")
    with pytest.raises(LayerError, match=match) as e:
        layer.setup([make_blob(rnd(2, 3, 4, 5))], tops())
    assert "rs" in str(e.value)


# ------------------------------------------------------------------------------------------- Crop
def test_crop_per_axis_offsets():
    layer = make_layer('type: "Crop" crop_param { axis: 2 offset: 1 offset: 3 }')
    x = rnd(2, 3, 8, 9)
    ref = np.zeros((2, 3, 5, 4))
    bottom = [make_blob(x), make_blob(ref)]
    top = run(layer, bottom, tops())
    np.testing.assert_array_equal(top[0].data, x[:, :, 1:6, 3:7])
    g = rnd(2, 3, 5, 4, seed=9)
    bottom[0].diff[...] = 123.0
    backward(layer, top, bottom, [g], prop=[True, False])
    expect = np.zeros_like(x)
    expect[:, :, 1:6, 3:7] = g
    np.testing.assert_array_equal(bottom[0].diff, expect)
    assert not np.any(bottom[1].diff)
    assert layer.allow_force_backward(0) and not layer.allow_force_backward(1)


def test_crop_single_offset_default_axis_and_gradient():
    layer = make_layer('type: "Crop" crop_param { offset: 1 }')
    x = rnd(2, 2, 4, 5)
    bottom = [make_blob(x), make_blob(np.zeros((1, 1, 2, 3)))]
    top = run(layer, bottom, tops())
    # axes before axis 2 keep bottom[0]'s size
    np.testing.assert_array_equal(top[0].data, x[:, :, 1:3, 1:4])
    check_gradient(layer, bottom, top, check_bottom=[0])


def test_crop_errors():
    with pytest.raises(LayerError, match="out-of-bounds"):
        make_layer('type: "Crop" crop_param { offset: 3 }').setup(
            [make_blob(rnd(1, 1, 4, 4)), make_blob(np.zeros((1, 1, 2, 2)))], tops())
    with pytest.raises(LayerError, match="number of offset"):
        make_layer('type: "Crop" crop_param { axis: 1 offset: 0 offset: 1 }').setup(
            [make_blob(rnd(1, 1, 4, 4)), make_blob(np.zeros((1, 1, 2, 2)))], tops())
    with pytest.raises(LayerError, match="same number of axes"):
        make_layer('type: "Crop"').setup([make_blob(rnd(1, 1, 4, 4)), make_blob(np.zeros((1, 2, 2)))], tops())


# ------------------------------------------------------------------------------------------- Tile
@pytest.mark.parametrize("axis,tiles", [(1, 3), (0, 2), (-1, 2)])
def test_tile(axis, tiles):
    layer = make_layer(f'type: "Tile" tile_param {{ axis: {axis} tiles: {tiles} }}')
    x = rnd(2, 3, 2)
    bottom = [make_blob(x)]
    top = run(layer, bottom, tops())
    np.testing.assert_array_equal(top[0].data, np.concatenate([x] * tiles, axis=axis))
    check_gradient(layer, bottom, top)


def test_tile_errors():
    with pytest.raises(LayerError, match="must be specified"):
        make_layer('type: "Tile"').setup([make_blob(rnd(2, 2))], tops())
    with pytest.raises(LayerError, match="positive"):
        make_layer('type: "Tile" tile_param { tiles: 0 }').setup([make_blob(rnd(2, 2))], tops())


# -------------------------------------------------------------------------------------- Reduction
def naive_reduce(x, op, axis, coeff):
    lead = x.shape[:axis]
    flat = x.reshape(int(np.prod(lead, dtype=np.int64)), -1)
    out = []
    for row in flat:
        if op == "SUM":
            v = sum(row)
        elif op == "ASUM":
            v = sum(abs(r) for r in row)
        elif op == "SUMSQ":
            v = sum(r * r for r in row)
        else:
            v = sum(row) / len(row)
        out.append(coeff * v)
    return np.array(out).reshape(lead)


@pytest.mark.parametrize("op", ["SUM", "ASUM", "SUMSQ", "MEAN"])
@pytest.mark.parametrize("axis,coeff", [(0, 1.0), (1, 0.5), (-1, -2.0)])
def test_reduction(op, axis, coeff):
    layer = make_layer(f'type: "Reduction" reduction_param {{ operation: {op} axis: {axis} coeff: {coeff} }}')
    x = rnd(2, 3, 4)
    x += np.sign(x) * 0.05  # keep ASUM away from its kink at 0
    bottom = [make_blob(x)]
    top = run(layer, bottom, tops())
    ax = axis % 3
    assert top[0].shape == x.shape[:ax]
    np.testing.assert_allclose(top[0].data, naive_reduce(x, op, ax, coeff), rtol=1e-12)
    check_gradient(layer, bottom, top)


def test_reduction_default_is_scalar_sum():
    layer = make_layer('type: "Reduction"')
    x = rnd(2, 3)
    top = run(layer, [make_blob(x)], tops())
    assert top[0].shape == () and top[0].count == 1
    assert top[0].data.ndim == 0
    np.testing.assert_allclose(top[0].data, x.sum())


# ----------------------------------------------------------------------------------------- ArgMax
def naive_topk(values, k):
    # Caffe: std::partial_sort of (value, index) pairs with std::greater -> ties: larger index first
    pairs = sorted(((float(v), j) for j, v in enumerate(values)), reverse=True)[:k]
    return [j for _, j in pairs], [v for v, _ in pairs]


def test_argmax_no_axis():
    x = rnd(3, 2, 3)
    x[0, 0, :] = [1.0, 3.0, 3.0]
    x[0, 1, :] = [2.0, 3.0, -1.0]
    layer = make_layer('type: "ArgMax" argmax_param { top_k: 2 }')
    top = run(layer, [make_blob(x)], tops())
    assert top[0].shape == (3, 1, 2)
    for n in range(3):
        idx, _ = naive_topk(x[n].ravel(), 2)
        np.testing.assert_array_equal(top[0].data[n, 0], idx)
    np.testing.assert_array_equal(top[0].data[0, 0], [4, 2])  # three 3.0s at 1, 2, 4: largest index first

    layer = make_layer('type: "ArgMax" argmax_param { top_k: 3 out_max_val: true }')
    x4 = rnd(2, 3, 2, 2)
    top = run(layer, [make_blob(x4)], tops())
    assert top[0].shape == (2, 2, 3, 1)
    for n in range(2):
        idx, vals = naive_topk(x4[n].ravel(), 3)
        np.testing.assert_array_equal(top[0].data[n, 0, :, 0], idx)
        np.testing.assert_array_equal(top[0].data[n, 1, :, 0], vals)

    layer = make_layer('type: "ArgMax"')
    top = run(layer, [make_blob(rnd(4, 5))], tops())
    assert top[0].shape == (4, 1, 1)


@pytest.mark.parametrize("out_max_val", [False, True])
def test_argmax_axis(out_max_val):
    x = rnd(2, 5, 3)
    x[1, :, 2] = [0.5, 0.5, 0.1, 0.5, 0.0]
    omv = "true" if out_max_val else "false"
    layer = make_layer(f'type: "ArgMax" argmax_param {{ top_k: 2 axis: 1 out_max_val: {omv} }}')
    top = run(layer, [make_blob(x)], tops())
    assert top[0].shape == (2, 2, 3)
    for n in range(2):
        for w in range(3):
            idx, vals = naive_topk(x[n, :, w], 2)
            np.testing.assert_array_equal(top[0].data[n, :, w], vals if out_max_val else idx)
    if not out_max_val:
        np.testing.assert_array_equal(top[0].data[1, :, 2], [3, 1])


def test_argmax_errors_and_no_backward():
    with pytest.raises(LayerError, match="top_k"):
        make_layer('type: "ArgMax" argmax_param { top_k: 4 axis: 1 }').setup([make_blob(rnd(2, 3))], tops())
    with pytest.raises(LayerError, match="top_k"):
        make_layer('type: "ArgMax" argmax_param { top_k: 7 }').setup([make_blob(rnd(2, 3, 2))], tops())
    layer = make_layer('type: "ArgMax"')
    bottom = [make_blob(rnd(2, 3))]
    top = run(layer, bottom, tops())
    with pytest.raises(LayerError):
        layer.backward(top, [True], bottom)


# ---------------------------------------------------------------------------------------- Silence
def test_silence():
    layer = make_layer('type: "Silence"')
    bottom = [make_blob(rnd(2, 2)), make_blob(rnd(3))]
    layer.setup(bottom, [])
    layer.forward(bottom, [])
    for b in bottom:
        b.diff[...] = 1.0
    layer.backward([], [True, False], bottom)
    assert not np.any(bottom[0].diff)
    assert np.all(bottom[1].diff == 1.0)


# ------------------------------------------------------------------------------------------ Embed
EMBED = ('type: "Embed" embed_param { num_output: 3 input_dim: 5 bias_term: %s '
         'weight_filler { type: "gaussian" std: 1 } bias_filler { type: "gaussian" std: 1 } }')


@pytest.mark.parametrize("bias", ["true", "false"])
def test_embed_forward_and_param_gradients(bias):
    layer = make_layer(EMBED % bias)
    idx = np.array([[0, 3, 3], [4, 0, 3]], dtype=np.float64)
    bottom = [make_blob(idx)]
    top = run(layer, bottom, tops())
    assert len(layer.blobs) == (2 if bias == "true" else 1)
    assert layer.blobs[0].shape == (5, 3)
    assert top[0].shape == (2, 3, 3)
    w = layer.blobs[0].data
    for i in range(2):
        for j in range(3):
            expect = w[int(idx[i, j])] + (layer.blobs[1].data if bias == "true" else 0)
            np.testing.assert_allclose(top[0].data[i, j], expect)
    check_gradient(layer, bottom, top, check_bottom=[])
    # repeated indices accumulate: row 3 appears three times
    g = rnd(2, 3, 3, seed=8)
    for p in layer.blobs:
        p.diff[...] = 0
    backward(layer, top, bottom, [g], prop=[False])
    np.testing.assert_allclose(layer.blobs[0].diff[3], g[0, 1] + g[0, 2] + g[1, 2])
    np.testing.assert_allclose(layer.blobs[0].diff[1], 0)
    assert not layer.allow_force_backward(0)
    with pytest.raises(LayerError, match="backpropagate"):
        layer.backward(top, [True], bottom)


@pytest.mark.parametrize("bad", [5.0, -1.0, 1.5])
def test_embed_index_checks(bad):
    layer = make_layer(EMBED % "true", name="emb")
    bottom = [make_blob(np.array([0.0, bad]))]
    with pytest.raises(LayerError, match="input_dim") as e:
        run(layer, bottom, tops())
    assert "emb" in str(e.value)


def test_embed_param_errors():
    with pytest.raises(LayerError, match="num_output must be positive"):
        make_layer('type: "Embed" embed_param { input_dim: 3 }').setup([make_blob(np.zeros(2))], tops())
    with pytest.raises(LayerError, match="input_dim must be positive"):
        make_layer('type: "Embed" embed_param { num_output: 3 }').setup([make_blob(np.zeros(2))], tops())


# ----------------------------------------------------------------------------------------- Filter
def test_filter_forward_backward():
    layer = make_layer('type: "Filter"')
    a, b = rnd(4, 3), rnd(4, 2, 2, seed=1)
    sel = np.array([[1.0], [0.0], [2.0], [0.0]])
    bottom = [make_blob(a), make_blob(b), make_blob(sel)]
    top = tops(2)
    layer.setup(bottom, top)
    assert top[0].shape == (4, 3)  # first reshape: full batch, as Caffe
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    np.testing.assert_array_equal(top[0].data, a[[0, 2]])
    np.testing.assert_array_equal(top[1].data, b[[0, 2]])
    g0, g1 = rnd(2, 3, seed=4), rnd(2, 2, 2, seed=5)
    bottom[0].diff[...] = 9.0
    backward(layer, top, bottom, [g0, g1], prop=[True, True, False])
    e0 = np.zeros_like(a)
    e0[[0, 2]] = g0
    np.testing.assert_array_equal(bottom[0].diff, e0)
    assert not layer.allow_force_backward(2) and layer.allow_force_backward(0)
    check_gradient(layer, bottom, top, check_bottom=[0, 1], setup=False)
    with pytest.raises(LayerError):
        layer.backward(top, [True, True, True], bottom)


def test_filter_errors():
    with pytest.raises(LayerError, match="singletons"):
        make_layer('type: "Filter"').setup([make_blob(rnd(2, 3)), make_blob(np.ones((2, 2)))], tops())
    with pytest.raises(LayerError, match="0th dimension"):
        make_layer('type: "Filter"').setup([make_blob(rnd(3, 3)), make_blob(np.ones((2,)))], tops())


# ----------------------------------------------------------------------------------- BatchReindex
def test_batch_reindex():
    layer = make_layer('type: "BatchReindex"')
    x = rnd(3, 2, 2)
    ridx = np.array([2.0, 0.0, 2.0, 1.0, 2.0])
    bottom = [make_blob(x), make_blob(ridx)]
    top = run(layer, bottom, tops())
    np.testing.assert_array_equal(top[0].data, x[[2, 0, 2, 1, 2]])
    g = rnd(5, 2, 2, seed=6)
    backward(layer, top, bottom, [g], prop=[True, False])
    np.testing.assert_allclose(bottom[0].diff[2], g[0] + g[2] + g[4])
    np.testing.assert_allclose(bottom[0].diff[0], g[1])
    assert not layer.allow_force_backward(1)
    check_gradient(layer, bottom, top, check_bottom=[0])
    with pytest.raises(LayerError, match="index"):
        layer.backward(top, [True, True], bottom)


@pytest.mark.parametrize("bad,match", [(-1.0, "negative"), (3.0, "greater than batch size")])
def test_batch_reindex_index_checks(bad, match):
    layer = make_layer('type: "BatchReindex"')
    with pytest.raises(LayerError, match=match):
        run(layer, [make_blob(rnd(3, 2)), make_blob(np.array([0.0, bad]))], tops())
    with pytest.raises(LayerError, match="1-D"):
        make_layer('type: "BatchReindex"').setup([make_blob(rnd(3, 2)), make_blob(np.zeros((2, 1)))], tops())


# -------------------------------------------------------------------------------------- Parameter
def test_parameter_layer_shares_param_blob():
    layer = make_layer('type: "Parameter" parameter_param { shape { dim: 2 dim: 3 } }')
    top = tops()
    layer.setup([], top)
    layer.forward([], top)
    assert len(layer.blobs) == 1 and layer.blobs[0].shape == (2, 3)
    assert top[0].shape == (2, 3)
    assert not np.any(top[0].data)  # Caffe: no filler, zero-initialised
    layer.blobs[0].data[...] = rnd(2, 3)
    np.testing.assert_array_equal(top[0].data, layer.blobs[0].data)
    # the consumer writes the top diff: that is the param gradient (top diff shares the param diff)
    g = rnd(2, 3, seed=2)
    top[0].diff[...] = g
    layer.backward(top, [], [])
    np.testing.assert_array_equal(layer.blobs[0].diff, g)


# -------------------------------------------------------------------------------- float32 / dtype
@pytest.mark.parametrize("text,shapes", [
    ('type: "Concat"', [(2, 3), (2, 1)]),
    ('type: "Eltwise" eltwise_param { operation: MAX }', [(2, 3), (2, 3), (2, 3)]),
    ('type: "Eltwise" eltwise_param { operation: PROD }', [(2, 3), (2, 3)]),
    ('type: "Tile" tile_param { tiles: 2 }', [(2, 3)]),
    ('type: "Reduction" reduction_param { operation: MEAN axis: 1 }', [(2, 3)]),
    ('type: "ArgMax" argmax_param { axis: 1 top_k: 2 out_max_val: true }', [(2, 3)]),
])
def test_float32_matches_float64(text, shapes):
    arrs = [rnd(*s, seed=i) for i, s in enumerate(shapes)]
    out = {}
    for dt in (np.float32, np.float64):
        layer = make_layer(text)
        top = run(layer, [make_blob(a.astype(dt)) for a in arrs], tops(dtype=dt))
        assert top[0].data.dtype == dt
        out[dt] = top[0].data.astype(np.float64)
    np.testing.assert_allclose(out[np.float32], out[np.float64], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------- propagate_down / in place
def test_propagate_down_false_leaves_diffs_untouched():
    layer = make_layer('type: "Concat"')
    bottom = [make_blob(rnd(2, 2)), make_blob(rnd(2, 3))]
    top = run(layer, bottom, tops())
    bottom[0].diff[...] = 7.0
    g = rnd(2, 5, seed=3)
    backward(layer, top, bottom, [g], prop=[False, True])
    assert np.all(bottom[0].diff == 7.0)
    np.testing.assert_array_equal(bottom[1].diff, g[:, 2:])


def test_eltwise_sum_in_place():
    layer = make_layer('type: "Eltwise" eltwise_param { coeff: 2 coeff: 3 }')
    a, b = rnd(2, 3), rnd(2, 3, seed=1)
    bottom = [make_blob(a), make_blob(b)]
    top = [bottom[0]]
    run(layer, bottom, top)
    np.testing.assert_allclose(bottom[0].data, 2 * a + 3 * b)
    g = rnd(2, 3, seed=2)
    backward(layer, top, bottom, [g])
    np.testing.assert_allclose(bottom[0].diff, 2 * g)
    np.testing.assert_allclose(bottom[1].diff, 3 * g)
