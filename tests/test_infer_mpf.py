"""Dense inference, part 1: geometry (field of view, size rules), max-pooling fragments, dense == naive."""
from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format

import cct
from cct.errors import CctError
from cct.infer.dense import PatchRunner
from cct.infer.fragments import FragmentPooling, fold_offsets, fragment_shape
from cct.infer.geometry import NotDensifiableError, analyze, field_of_view
from cct.infer.naive import naive_dense
from cct.infer.znni_nets import znni_prototxt
from cct.paths import repo_root
from cct.proto import caffe_pb2
from cct.testing import make_blob

REDUCED = {  # ZNNi's four shapes with 4 feature maps and small kernels (same pooling layout)
    "n337": [2, 2, 1, 1, 1, 1, 2],
    "n537": [2, 1, 2, 1, 2, 1, 1],
    "n726": [2, 2, 1, 1, 2, 1],
    "n926": [3, 2, 1, 2, 1, 1],
}


def _net(txt: str, dtype=np.float64) -> cct.Net:
    return cct.Net(text_format.Parse(txt, caffe_pb2.NetParameter()), cct.TEST, dtype=dtype)


def _copy_weights(src: cct.Net, dst: cct.Net) -> None:
    for a, b in zip(src.params.values(), dst.params.values()):
        for pa, pb in zip(a, b):
            pb.data[...] = pa.data


@pytest.mark.parametrize("name,fov", [("n337", 85), ("n537", 163), ("n726", 117), ("n926", 155)])
def test_field_of_view_of_the_znni_prototxts(name, fov):
    assert field_of_view(str(repo_root() / "models" / "znni" / f"{name}.prototxt")) == (fov,) * 3
    # the definition: an input of the field of view's size gives one output voxel (4 maps to keep it small)
    small = znni_prototxt(name, fmaps=1, nd=3)
    assert tuple(_net(small, np.float32).blobs["prob"].shape) == (1, 3, 1, 1, 1)
    assert analyze(_net(small.replace(f"dim: {fov} ", f"dim: {fov - 1} ", 1), np.float32)).field_of_view == (fov,) * 3


def _pool_at(x: np.ndarray, window, offset, method: str) -> np.ndarray:
    """Pooling of ``x`` (spatial axes only) at ``offset`` with stride = window, by loops (the reference)."""
    nd = len(window)
    cnt = tuple((n - o) // p for n, o, p in zip(x.shape[-nd:], offset, window))
    out = np.empty(x.shape[:-nd] + cnt)
    for idx in np.ndindex(*cnt):
        sl = tuple(slice(o + i * p, o + (i + 1) * p) for o, i, p in zip(offset, idx, window))
        block = x[(Ellipsis,) + sl].reshape(x.shape[:-nd] + (-1,))
        out[(Ellipsis,) + idx] = block.max(-1) if method == "MAX" else block.mean(-1)
    return out


@pytest.mark.parametrize("window,size", [((2,), (7,)), ((3,), (11,)), ((2, 3), (5, 8)), ((2, 2, 3), (3, 5, 5))])
def test_fragments_equal_pooling_at_each_offset(window, size):
    rng = np.random.default_rng(1)
    b, c = 2, 3
    frag = fragment_shape(size, window)
    assert frag == tuple(n // p for n, p in zip(size, window))  # ZNNi: floor(n / p) when p | n + 1
    x = rng.standard_normal((b, c) + size)
    # stride-1 pooled values, then the fold (1-D included: the fold is pure array work)
    from numpy.lib.stride_tricks import sliding_window_view
    dense = sliding_window_view(x, window, axis=tuple(range(2, 2 + len(size)))).max(
        axis=tuple(range(-len(size), 0)))
    folded = fold_offsets(dense, window)
    offs = list(np.ndindex(*window))
    assert folded.shape == (len(offs) * b, c) + frag
    for k, off in enumerate(offs):
        np.testing.assert_array_equal(folded[k * b:(k + 1) * b], _pool_at(x, window, off, "MAX"))


@pytest.mark.parametrize("method", ["MAX", "AVE"])
@pytest.mark.parametrize("window,size", [((2, 3), (7, 8)), ((3, 3, 3), (5, 8, 11))])
def test_fragment_pooling_layer(method, window, size):
    nd = len(window)
    if nd == 3:
        kernel = f"kernel_size: {window[0]}"
    else:
        kernel = f"kernel_h: {window[0]} kernel_w: {window[1]}"
    lp = text_format.Parse(f'name: "p" type: "Pooling" bottom: "x" top: "y" pooling_param {{ pool: {method} '
                           f"{kernel} }}", caffe_pb2.LayerParameter())
    rng = np.random.default_rng(2)
    x = make_blob(rng.standard_normal((2, 3) + size))
    y = make_blob(np.zeros(1))
    fp = FragmentPooling(lp, window, x)
    fp.reshape(x, y)
    fp.forward(x, y)
    for k, off in enumerate(np.ndindex(*window)):
        np.testing.assert_allclose(y.data[2 * k:2 * k + 2], _pool_at(x.data, window, off, method), rtol=1e-12)


def test_fragment_size_rule_is_enforced():
    with pytest.raises(ValueError, match="size \\+ 1 must be divisible"):
        fragment_shape((8,), (2,))


CASES = [(n, 2, "MAX") for n in sorted(REDUCED)] + [("n537", 2, "AVE"), ("n926", 2, "AVE"), ("n337", 3, "MAX"),
                                                      ("n726", 3, "AVE")]


@pytest.mark.parametrize("name,nd,pool", CASES)
def test_dense_equals_naive_per_window(name, nd, pool):
    txt = znni_prototxt(name, fmaps=4, nd=nd, pool=pool, kernels=REDUCED[name], channels=2)
    net, ref_net = _net(txt), _net(txt)
    _copy_weights(net, ref_net)
    geom = analyze(net)
    grid = (1, 1, 1) if nd == 3 else (2, 2)
    runner = PatchRunner(net, geom, grid, method="mpf")
    x = np.random.default_rng(3).standard_normal((2,) + runner.patch_shape)
    got = runner.run(x)
    want = naive_dense(ref_net, analyze(ref_net), x, batch=256)
    assert got.shape == want.shape == (3,) + tuple(g * s for g, s in zip(grid, geom.stride))
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("method,mpf", [("shift", None), ("mpf", (True, False, True)), ("mpf", (False, True, False))])
def test_shifted_runs_and_mixed_fragments_equal_mpf(method, mpf):
    txt = znni_prototxt("n337", fmaps=3, nd=2, kernels=REDUCED["n337"])
    net = _net(txt)
    geom = analyze(net)
    x = np.random.default_rng(4).standard_normal((1,) + geom.input_size((2, 2), (True,) * 3))
    full = PatchRunner(net, geom, (2, 2), method="mpf").run(x).copy()
    other = PatchRunner(net, geom, (2, 2), mpf=mpf, method=method).run(x)
    np.testing.assert_allclose(other, full, rtol=1e-10, atol=1e-12)


def test_runner_runs_the_given_strategies_and_gives_the_same_output():
    """The plan's lowerings reach the layers (as lowering overrides of the runner's config), whatever the layers
    would pick themselves; each is exact, so the output is the default run's."""
    txt = znni_prototxt("n337", fmaps=3, nd=2, kernels=REDUCED["n337"])
    net = _net(txt)
    geom = analyze(net)
    x = np.random.default_rng(6).standard_normal((1,) + geom.input_size((2, 2), (True,) * 3))
    want = PatchRunner(net, geom, (2, 2)).run(x).copy()
    chosen = {"conv1": "type2", "conv2": "fft", "conv3": "type3"}
    runner = PatchRunner(net, geom, (2, 2), strategies=chosen)
    ran = {r.name: r.lowering.inner.name for _i, r, _b, _t in runner.steps if r.name in chosen}
    assert ran == chosen and not net.config.engine.overrides  # the net's own config is left as it was
    np.testing.assert_allclose(runner.run(x), want, rtol=1e-9, atol=1e-12)


def test_strided_method_is_the_nets_own_output():
    txt = znni_prototxt("n726", fmaps=3, nd=2, kernels=REDUCED["n726"])
    net = _net(txt)
    geom = analyze(net)
    runner = PatchRunner(net, geom, (3, 2), method="strided")
    x = np.random.default_rng(5).standard_normal((1,) + runner.patch_shape)
    got = runner.run(x).copy()
    plain = _net(txt)
    _copy_weights(net, plain)
    plain.blobs["data"].reshape((1, 1) + runner.patch_shape)
    plain.blobs["data"].data[0] = x
    plain.forward()
    np.testing.assert_allclose(got, plain.blobs["prob"].data[0], rtol=1e-12)
    dense = PatchRunner(net, geom, (3, 2), method="mpf")
    y = dense.run(np.pad(x, ((0, 0),) + tuple((0, d - s) for d, s in zip(dense.patch_shape, x.shape[1:]))))
    np.testing.assert_allclose(got, y[:, ::geom.stride[0], ::geom.stride[1]], rtol=1e-10)


BAD = [
    ('layer { name: "fc" type: "InnerProduct" bottom: "c" top: "fc" inner_product_param { num_output: 2 } }', "fc"),
    ('layer { name: "cr" type: "Crop" bottom: "data" bottom: "c" top: "cr" }', "cr"),
    ('layer { name: "pp" type: "Pooling" bottom: "c" top: "pp" pooling_param { pool: MAX kernel_size: 3 stride: 2 } }',
     "pp"),
    ('layer { name: "cp" type: "Convolution" bottom: "c" top: "cp" convolution_param { num_output: 1 kernel_size: 3 '
     "pad: 1 } }", "cp"),
    ('layer { name: "ln" type: "LRN" bottom: "c" top: "ln" lrn_param { norm_region: WITHIN_CHANNEL } }', "ln"),
]


@pytest.mark.parametrize("extra,name", BAD)
def test_non_densifiable_nets_name_the_layer(extra, name):
    txt = ('layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 1 dim: 12 dim: 12 } } }\n'
           'layer { name: "c" type: "Convolution" bottom: "data" top: "c" convolution_param { num_output: 2 '
           "kernel_size: 3 } }\n" + extra)
    with pytest.raises(NotDensifiableError, match=f"layer '{name}'") as e:
        analyze(_net(txt))
    assert "\n" not in str(e.value)


def test_patch_breaking_the_size_rule_is_refused():
    geom = analyze(_net(znni_prototxt("n726", fmaps=2, nd=2, kernels=REDUCED["n726"])))
    with pytest.raises(CctError, match="divisible"):
        geom.layer_sizes((20, 20), (True, True))
    assert geom.layer_sizes(geom.input_size((2, 2), (True, True)), (True, True))[-1] == (2, 2)
