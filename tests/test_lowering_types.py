"""CcT lowering types 1, 2, 3 (and the batching wrapper) against a direct convolution.

Every lowering must equal a naive loop convolution -- forward, data gradient and weight/bias
gradient -- on randomized N-d geometries (padding, stride, dilation, rectangular kernels,
groups), in float32 and float64, and pass a finite-difference gradient check through the
Convolution layer. Where CuPy and a GPU are present the same tests run again with the arrays in GPU
memory (every strategy's array-module path).
"""
import importlib

import numpy as np
import pytest
from naive import make_geom, random_conv_inputs, ref_backward, ref_forward

from cct import blas
from cct.config import using_config
from cct.device.driver import CupyDevice, HostDevice, cupy_available, to_host
from cct.io.prototxt import parse_text
from cct.layers.base import create_layer
from cct.lowering import ConvGeometry, get_strategy, supports
from cct.lowering.budget import max_batch_partition
from cct.lowering.chunking import split
from cct.lowering.cost_model import nominal_machine
from cct.lowering.optimizer import PerPassLowering
from cct.lowering.partition import BatchedLowering, caffe_mode
from cct.lowering.tune import TuneCache, measure_partitions
from cct.lowering.type2 import PartialLowering, Type2Lowering
from cct.lowering.type3 import Type3Lowering
from cct.proto import caffe_pb2
from cct.testing import check_gradient, make_blob

TYPES = ("type1", "type2", "type3", "direct", "fft")
ARRAY_MODULES = ("numpy",) + (("cupy",) if cupy_available() else ())


def random_geoms(count, seed):
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < count:
        nd = int(rng.choice([1, 2, 2, 2, 3]))
        group = int(rng.choice([1, 1, 2, 3]))
        cin, cout = group * int(rng.integers(1, 4)), group * int(rng.integers(1, 4))
        in_shape = tuple(int(v) for v in rng.integers(1, 8 if nd < 3 else 5, nd))
        kernel = tuple(int(v) for v in rng.integers(1, 4, nd))
        pad = tuple(int(v) for v in rng.integers(0, 3, nd))
        stride = tuple(int(v) for v in rng.integers(1, 4, nd))
        dil = tuple(int(v) for v in rng.integers(1, 3, nd))
        try:
            g = make_geom(cin, cout, group, in_shape, kernel, pad, stride, dil, bias=bool(rng.integers(0, 2)))
        except ValueError:
            continue
        if all(o > 0 for o in g.out_shape):
            out.append(g)
    return out


GEOMS = random_geoms(18, 1234) + [
    # CaffeNet-like corner cases, shrunk: 11x11 stride 4 (conv1), grouped 5x5 pad 2 (conv2), 3x3 pad 1
    make_geom(3, 4, 1, (19, 19), (11, 11), (0, 0), (4, 4), (1, 1)),
    make_geom(4, 6, 2, (7, 7), (5, 5), (2, 2), (1, 1), (1, 1)),
    make_geom(5, 3, 1, (5, 6), (3, 3), (1, 1), (1, 1), (1, 1)),
    make_geom(2, 2, 1, (6, 5), (2, 3), (0, 1), (2, 1), (1, 2)),  # rectangular
    make_geom(2, 3, 1, (1, 1), (3, 3), (0, 0), (3, 3), (1, 1)),  # window hangs past the input (C division)
    make_geom(2, 3, 1, (4, 4), (1, 1), (0, 0), (1, 1), (1, 1)),  # 1x1
]


def _ids(gs):
    return [f"c{g.channels_in}m{g.channels_out}g{g.group}i{'x'.join(map(str, g.in_shape))}"
            f"k{'x'.join(map(str, g.kernel))}p{''.join(map(str, g.pad))}s{''.join(map(str, g.stride))}"
            f"d{''.join(map(str, g.dilation))}" for g in gs]


@pytest.mark.parametrize("xp_name", ARRAY_MODULES)
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("geom", GEOMS, ids=_ids(GEOMS))
def test_matches_direct_convolution(name, geom, xp_name):
    xp = importlib.import_module(xp_name)
    rng = np.random.default_rng(7)
    s = get_strategy(name)
    assert supports(s, geom)
    x, w, b, dy = random_conv_inputs(geom, 2, rng)
    y_ref = ref_forward(x, w, b, geom)
    dx_ref, dw_ref, db_ref = ref_backward(dy, x, w, geom)
    for dt, tol in ((np.float64, 1e-10), (np.float32, 2e-5)):
        xc, wc, dyc = (xp.asarray(a.astype(dt)) for a in (x, w, dy))
        bc = None if b is None else xp.asarray(b.astype(dt))
        y = s.forward(xc, wc, bc, geom)
        assert isinstance(y, xp.ndarray) and y.shape == y_ref.shape and y.dtype == dt
        np.testing.assert_allclose(to_host(y), y_ref, rtol=tol, atol=tol * 10)
        dx = s.backward_data(dyc, wc, geom)
        assert isinstance(dx, xp.ndarray) and dx.shape == x.shape and dx.dtype == dt
        np.testing.assert_allclose(to_host(dx), dx_ref, rtol=tol, atol=tol * 10)
        dw, db = s.backward_weights(dyc, xc, geom)
        assert isinstance(dw, xp.ndarray) and dw.shape == w.shape
        np.testing.assert_allclose(to_host(dw), dw_ref, rtol=tol, atol=tol * 10)
        if geom.bias_term:
            np.testing.assert_allclose(to_host(db), db_ref, rtol=tol, atol=tol * 10)
        else:
            assert db is None


def test_reference_is_not_trivially_equal():
    """The comparison can fail: a wrong stride gives a different result."""
    g = make_geom(2, 3, 1, (6, 6), (3, 3), (1, 1), (2, 2), (1, 1))
    wrong = make_geom(2, 3, 1, (6, 6), (3, 3), (1, 1), (1, 1), (1, 1))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 2, 6, 6))
    w = rng.standard_normal(g.weight_shape)
    y = get_strategy("type3").forward(x, w, None, wrong)
    assert y.shape != ref_forward(x, w, None, g).shape or not np.allclose(y, ref_forward(x, w, None, g))


def test_type_layouts_follow_figure6():
    """Lowered matrix shapes of Figure 6: (k^2 d, m^2), (k d, m n), (d, n^2) with n = padded extent."""
    g = make_geom(8, 16, 1, (13, 13), (3, 3), (0, 0), (1, 1), (1, 1))
    p2 = Type2Lowering().plan(g, 1)
    p3 = Type3Lowering().plan(g, 1)
    assert p2["data"] == (3 * 8, 11 * 13) and p2["kernel"] == (16 * 3, 3 * 8)
    assert p3["data"] == (8, 13 * 13) and p3["kernel"] == (16 * 9, 8)
    assert p3["result"] == (16 * 9, 13 * 13)


def test_types_registered_and_support():
    g = make_geom(2, 2, 1, (5, 5), (3, 3), (1, 1), (1, 1), (1, 1))
    for name in TYPES:
        assert get_strategy(name).name == name
    assert isinstance(get_strategy("type2"), PartialLowering)
    g0 = ConvGeometry(2, 2, 1, (), (), (), (), (), (), True)
    assert not Type2Lowering().supports(g0) and not Type3Lowering().supports(g0)
    assert Type3Lowering().supports(g)


@pytest.mark.parametrize("wrapper", ["caffe", "bp2", "p2", "perpass"])
def test_batching_wrappers_equal(wrapper):
    g = make_geom(4, 6, 2, (6, 5), (3, 2), (1, 0), (1, 2), (1, 1))
    rng = np.random.default_rng(3)
    n = 5
    x = rng.standard_normal((n, 4, 6, 5)).astype(np.float32)
    w = rng.standard_normal(g.weight_shape).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    dy = rng.standard_normal((n, 6) + g.out_shape).astype(np.float32)
    base = get_strategy("type1")
    s = {"caffe": caffe_mode(get_strategy("type3")),
         "bp2": BatchedLowering(get_strategy("type2"), batch_partition=2),
         "p2": BatchedLowering(get_strategy("type3"), batch_partition=1, partitions=2),
         "perpass": PerPassLowering(get_strategy("type3"), get_strategy("type2"), get_strategy("type1"))}[wrapper]
    np.testing.assert_allclose(s.forward(x, w, b, g), base.forward(x, w, b, g), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(s.backward_data(dy, w, g), base.backward_data(dy, w, g), rtol=1e-4, atol=1e-4)
    for a, r in zip(s.backward_weights(dy, x, g), base.backward_weights(dy, x, g)):
        np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-4)


def test_batch_partition_respects_budget():
    g = make_geom(16, 32, 1, (13, 13), (3, 3), (1, 1), (1, 1), (1, 1))
    s = get_strategy("type3")
    per_image = s.workspace_bytes(g, 1, 4)
    assert max_batch_partition(s, g, 64, 4, budget=10 * per_image) == 10
    assert max_batch_partition(s, g, 64, 4, budget=10**15) == 64
    assert max_batch_partition(s, g, 64, 4, budget=1) == 1
    wrapped = BatchedLowering(s, batch_partition="budget", budget=10 * per_image)  # CcT: largest that fits
    plan = wrapped.plan(g, 64, 4)
    assert plan["b_p"] == 10 and sum(e - st for st, e in plan["ranges"][0]) == 64
    # the cost model's choice ("auto", the default) also stays within the budget
    auto = BatchedLowering(s, budget=10 * per_image).plan(g, 64, 4)
    assert 1 <= auto["b_p"] <= 10 and sum(e - st for st, e in auto["ranges"][0]) == 64
    assert split(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert BatchedLowering(s, partitions=4, batch_partition=3).plan(g, 10)["ranges"] == [
        [(0, 3)], [(3, 6)], [(6, 8)], [(8, 10)]]


def test_auto_partitions_measured_at_planning_and_reused(tmp_path, monkeypatch):
    """``partitions="auto"`` is measured by the planner (whole iterations of the passes per count), cached;
    the wrapper only executes a count it is given."""
    monkeypatch.setenv("CCT_CACHE_DIR", str(tmp_path))
    g = make_geom(3, 4, 1, (6, 6), (3, 3), (1, 1), (1, 1), (1, 1))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 6, 6)).astype(np.float32)
    w = rng.standard_normal(g.weight_shape).astype(np.float32)
    cache = TuneCache.named("partitions-test.json", "stamp")
    p, seconds = measure_partitions(lambda: get_strategy("type1"), g, 4, ("fwd",), 2, lambda t: nominal_machine(),
                                    candidates=(1, 2), cache=cache)
    assert set(seconds) == {1, 2} and p == min(seconds, key=seconds.get) and all(t > 0 for t in seconds.values())
    assert (tmp_path / "partitions-test.json").is_file()
    again = TuneCache.named("partitions-test.json", "stamp")  # read back from the cache dir: not measured again
    assert measure_partitions(lambda: get_strategy("type1"), g, 4, ("fwd",), 2, lambda t: nominal_machine(),
                              candidates=(1, 2), cache=again) == (p, seconds)  # the same seconds: from the cache
    s = BatchedLowering(get_strategy("type1"), partitions=p, threads=2)
    y = s.forward(x, w, None, g)
    np.testing.assert_allclose(y, get_strategy("type1").forward(x, w, None, g), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="measuring them is the planner's job"):
        BatchedLowering(get_strategy("type1"), partitions="auto")


# -- gradient check through the Convolution layer ----------------------------------------------
CONV_CASES = [
    ("Convolution", "num_output: 4 kernel_size: 3 pad: 1 stride: 2 group: 2", (2, 4, 5, 5)),
    ("Convolution", "num_output: 2 kernel_h: 2 kernel_w: 3 pad_h: 1 pad_w: 0 stride_h: 1 stride_w: 2 dilation: 2",
     (2, 3, 6, 6)),
    ("Deconvolution", "num_output: 4 kernel_size: 3 pad: 1 stride: 2 group: 2", (2, 2, 3, 3)),
]


@pytest.mark.parametrize("xp_name", ARRAY_MODULES)
@pytest.mark.parametrize("name", TYPES + ("batched-type3",))
@pytest.mark.parametrize("case", range(len(CONV_CASES)))
def test_gradient_through_conv_layer(name, case, xp_name):
    xp = importlib.import_module(xp_name)
    ltype, text, shape = CONV_CASES[case]
    param = parse_text(
        f'name: "conv" type: "{ltype}" convolution_param {{ {text} '
        'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.5 } }',
        caffe_pb2.LayerParameter())
    layer = create_layer(param)
    if name == "batched-type3":
        layer.lowering = BatchedLowering(get_strategy("type3"), batch_partition=1)  # per-image chunks
    else:
        layer.lowering = get_strategy(name)
    rng = np.random.default_rng(5)
    device = CupyDevice(0) if xp_name == "cupy" else HostDevice()
    bottom = [make_blob(rng.standard_normal(shape), device=device)]
    top = [make_blob(np.zeros(1), device=device)]
    check_gradient(layer, bottom, top, stepsize=1e-4, threshold=1e-6)
    assert isinstance(top[0].data, xp.ndarray)


# -- the same gradient checks on every BLAS backend and partition count ------------------------
BLAS_BACKENDS = ["openblas"] + (["mkl"] if blas.mkl_available() else [])
GEMM_BACKENDS = BLAS_BACKENDS + (["cupy"] if cupy_available() else [])  # cupy: cuBLAS, arrays on the GPU


def _backend(name):
    return using_config(blas={"backend": name})


@pytest.mark.parametrize("backend", GEMM_BACKENDS)
@pytest.mark.parametrize("partitions", [1, 2])
@pytest.mark.parametrize("name", TYPES)
def test_gradient_on_each_blas_backend_and_partition_count(backend, partitions, name):
    ltype, text, shape = CONV_CASES[0]
    param = parse_text(
        f'name: "conv" type: "{ltype}" convolution_param {{ {text} '
        'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.5 } }',
        caffe_pb2.LayerParameter())
    layer = create_layer(param)
    layer.lowering = BatchedLowering(get_strategy(name), batch_partition=1, partitions=partitions)
    rng = np.random.default_rng(6)
    xp = importlib.import_module("cupy") if backend == "cupy" else np
    device = CupyDevice(0) if backend == "cupy" else HostDevice()
    bottom = [make_blob(rng.standard_normal(shape), device=device)]
    top = [make_blob(np.zeros(1), device=device)]
    with _backend("openblas" if backend == "cupy" else backend):
        check_gradient(layer, bottom, top, stepsize=1e-4, threshold=1e-6)
    assert isinstance(top[0].data, xp.ndarray)


@pytest.mark.parametrize("backend", BLAS_BACKENDS)
def test_inner_product_gradient_on_each_blas_backend(backend):
    param = parse_text('name: "ip" type: "InnerProduct" inner_product_param { num_output: 3 '
                       'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.5 } }',
                       caffe_pb2.LayerParameter())
    layer = create_layer(param)
    rng = np.random.default_rng(7)
    bottom = [make_blob(rng.standard_normal((4, 5)))]
    top = [make_blob(np.zeros(1))]
    with _backend(backend):
        check_gradient(layer, bottom, top, stepsize=1e-4, threshold=1e-6)
