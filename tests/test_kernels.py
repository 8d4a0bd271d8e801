"""Compiled kernels (cct/kernels) against the numpy paths they replace: same bits, same fallbacks."""
import ast
import importlib
import logging
import subprocess
import sys
import threading

import numpy as np
import pytest

from cct import kernels, rng
from cct.blob import Blob
from cct.device.driver import host_kernels_usable
from cct.io.prototxt import parse_text
from cct.layers import create_layer
from cct.lowering import ConvGeometry, get_strategy
from cct.proto import caffe_pb2
from cct.testing import make_blob

li = importlib.import_module("cct.lowering.im2col")
needs_numba = pytest.mark.skipif(not kernels.numba_available(), reason="numba not installed")
TRAIN, TEST = caffe_pb2.TRAIN, caffe_pb2.TEST
DTYPES = (np.float32, np.float64)


def both(fn):
    """``fn()`` on the numpy path, then on the kernel path."""
    with kernels.forced_mode("numpy"):
        a = fn()
    with kernels.forced_mode("auto"):
        b = fn()
    return a, b


def assert_bits(a, b):
    """Bitwise equality (distinguishes -0.0 from 0.0; NaNs must match too)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype
    ints = {2: np.int16, 4: np.int32, 8: np.int64}[a.dtype.itemsize] if a.dtype.kind == "f" else None
    if ints is None:
        np.testing.assert_array_equal(a, b)
    else:
        np.testing.assert_array_equal(np.ascontiguousarray(a).view(ints), np.ascontiguousarray(b).view(ints))


def make_layer(text, phase=TRAIN):
    lp = caffe_pb2.LayerParameter()
    parse_text(text, lp)
    lp.name = "l"
    lp.phase = phase
    return create_layer(lp)


def run_layer(text, x, dy_seed=5, ntop=1, phase=TRAIN, in_place=False, seed=3):
    """Forward + backward of a fresh layer; returns copies of every output and the bottom diff."""
    layer = make_layer(text, phase)
    bottom = [make_blob(x)]
    top = [bottom[0]] if in_place else [Blob((), dtype=x.dtype) for _ in range(ntop)]
    rng.set_random_seed(seed)
    layer.setup(bottom, top)
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    outs = [t.data.copy() for t in top]
    top[0].diff[...] = np.random.default_rng(dy_seed).standard_normal(top[0].shape)
    layer.backward(top, [True], bottom)
    return outs + [bottom[0].diff.copy()]


# -- pooling -------------------------------------------------------------------------------------
def _pool_cases(count, seed):
    g = np.random.default_rng(seed)
    cases = []
    while len(cases) < count:
        kh, kw = (int(v) for v in g.integers(1, 5, 2))
        ph, pw = int(g.integers(0, kh)), int(g.integers(0, kw))
        sh, sw = (int(v) for v in g.integers(1, 6, 2))  # stride > kernel included
        h, w = int(g.integers(max(1, kh - 2 * ph), 10)), int(g.integers(max(1, kw - 2 * pw), 10))
        cases.append(((2, 3, h, w), f"kernel_h: {kh} kernel_w: {kw} stride_h: {sh} stride_w: {sw} "
                                    f"pad_h: {ph} pad_w: {pw}"))
    return cases


POOL_CASES = _pool_cases(10, 0) + [
    ((2, 3, 8, 8), "kernel_size: 3 stride: 2"),  # ceil: a clipped last window
    ((2, 2, 5, 5), "kernel_size: 2 stride: 2 pad: 1"),  # last window dropped
    ((1, 2, 5, 5), "kernel_size: 1 stride: 3"),  # empty window past the edge (-FLT_MAX / 0-area)
    ((2, 3, 7, 6), "kernel_size: 3 stride: 1 pad: 2"),
    ((2, 3, 9, 8), "kernel_size: 2 stride: 3 pad: 1"),  # unrolled 2x2 path, stride > kernel
    ((2, 3, 10, 9), "kernel_size: 3 stride: 4"),
    ((1, 2, 2, 5), "kernel_size: 3 stride: 1 pad: 1"),  # input smaller than the window
]


@pytest.fixture
def generic_f64(monkeypatch):
    """In float64 only the generic pooling kernels are checked (the unrolled window/stride variants are
    the same code in float32; skipping their float64 compilation keeps a cold-cache run short)."""

    def apply(dtype):
        if dtype == np.float64:
            monkeypatch.setattr(kernels.get("pooling"), "FIXED_GEOMETRIES", {})

    return apply


def _pool_input(shape, dtype, seed):
    # Small integers: plenty of ties (first maximum wins) and exact sums.
    return np.random.default_rng(seed).integers(-3, 4, shape).astype(dtype)


@needs_numba
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,spec", POOL_CASES)
def test_pool_max_bitwise(shape, spec, dtype, generic_f64):
    generic_f64(dtype)
    x = _pool_input(shape, dtype, 1)
    a, b = both(lambda: run_layer(f'type: "Pooling" pooling_param {{ pool: MAX {spec} }}', x, ntop=2))
    for u, v in zip(a, b):
        assert_bits(u, v)


@needs_numba
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,spec", POOL_CASES)
def test_pool_ave_bitwise(shape, spec, dtype, generic_f64):
    generic_f64(dtype)
    x = np.random.default_rng(2).standard_normal(shape).astype(dtype)
    a, b = both(lambda: run_layer(f'type: "Pooling" pooling_param {{ pool: AVE {spec} }}', x))
    for u, v in zip(a, b):
        assert_bits(u, v)


@needs_numba
def test_pool_special_values_and_global():
    x = np.random.default_rng(3).standard_normal((2, 2, 6, 6)).astype(np.float32)
    x[0, 0, :3, :3] = np.nan  # NaN is never '>': the window keeps -FLT_MAX / an earlier value
    x[0, 1, 2:5, 1:4] = -np.inf
    x[1, 0, 0, :] = -0.0
    for spec in ("kernel_size: 3 stride: 2 pad: 1", "global_pooling: true"):
        for method, ntop in (("MAX", 2), ("AVE", 1)):
            text = f'type: "Pooling" pooling_param {{ pool: {method} {spec} }}'
            a, b = both(lambda t=text, n=ntop: run_layer(t, x, ntop=n))
            for u, v in zip(a, b):
                assert_bits(u, v)


@needs_numba
def test_pool_max_kernel_result_is_caffes():
    # Direct check of the tie rule and the -1 index on the kernel path (not only "same as numpy").
    x = np.ones((1, 1, 4, 4), np.float32)
    x[0, 0, 1, 1] = x[0, 0, 2, 0] = 2.0
    with kernels.forced_mode("auto"):
        y, mask, _ = run_layer('type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 1 }', x, ntop=2)
    np.testing.assert_array_equal(mask[0, 0], [[5, 5], [5, 5]])
    np.testing.assert_array_equal(y[0, 0], [[2, 2], [2, 2]])


@needs_numba
def test_pool_stochastic_train_backward_bitwise():
    x = np.abs(np.random.default_rng(4).standard_normal((2, 3, 7, 7))) + 0.1
    a, b = both(lambda: run_layer('type: "Pooling" pooling_param { pool: STOCHASTIC kernel_size: 3 stride: 2 }',
                                  x, seed=11))
    for u, v in zip(a, b):
        assert_bits(u, v)


# -- LRN -----------------------------------------------------------------------------------------
@needs_numba
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size,alpha,beta,k,shape,in_place", [
    (5, 1e-4, 0.75, 1.0, (2, 7, 5, 4), False),
    (5, 0.3, 0.75, 2.0, (2, 7, 5, 4), True),
    (3, 0.5, 1.0, 1.5, (1, 2, 3, 3), False),  # exponent -1: numpy's fast scalar power
    (7, 2.0, 0.5, 1.0, (2, 4, 2, 3), False),  # window wider than the channels
    (1, 0.1, 2.0, 1.0, (1, 3, 2, 2), True),
])
def test_lrn_across_bitwise(size, alpha, beta, k, shape, in_place, dtype):
    x = np.random.default_rng(6).standard_normal(shape).astype(dtype)
    text = f'type: "LRN" lrn_param {{ local_size: {size} alpha: {alpha} beta: {beta} k: {k} }}'
    a, b = both(lambda: run_layer(text, x, in_place=in_place))
    for u, v in zip(a, b):
        assert_bits(u, v)


@needs_numba
def test_lrn_within_channel_still_numpy_and_equal():
    x = np.random.default_rng(7).standard_normal((2, 3, 5, 5))
    text = 'type: "LRN" lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 norm_region: WITHIN_CHANNEL }'
    a, b = both(lambda: run_layer(text, x))
    for u, v in zip(a, b):
        assert_bits(u, v)


# -- im2col / col2im -----------------------------------------------------------------------------
def _conv_cases(count, seed):
    g = np.random.default_rng(seed)
    cases = []
    while len(cases) < count:
        k = tuple(int(v) for v in g.integers(1, 5, 2))
        d = tuple(int(v) for v in g.integers(1, 4, 2))
        p = tuple(int(v) for v in g.integers(0, 4, 2))
        s = tuple(int(v) for v in g.integers(1, 5, 2))
        hw = tuple(int(v) for v in g.integers(1, 10, 2))
        if all(o > 0 for o in li.output_shape(hw, k, p, s, d)):
            cases.append((hw, k, p, s, d))
    return cases


CONV_CASES = _conv_cases(8, 1) + [
    ((2, 2), (3, 3), (0, 0), (2, 2), (1, 1)),  # one window hanging over the input (Caffe's C division)
    ((9, 8), (3, 2), (1, 0), (4, 5), (2, 1)),  # stride > kernel extent
    ((7, 7), (3, 3), (1, 1), (1, 1), (1, 1)),
]


def _layout(kind, shape, dtype):
    """An output array of ``shape`` (N, C, kh, kw, OH, OW): C order, the type-1 buffer view, or strided."""
    if kind == "c":
        return np.empty(shape, dtype)
    if kind == "type1":
        n, c, kh, kw, oh, ow = shape
        return np.empty((c, kh, kw, n, oh, ow), dtype).transpose(3, 0, 1, 2, 4, 5)
    return np.empty(shape + (2,), dtype)[..., 0]


@needs_numba
@pytest.mark.parametrize("layout", ["c", "type1"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hw,k,p,s,d", CONV_CASES)
def test_im2col_col2im_bitwise(hw, k, p, s, d, dtype, layout):
    g = np.random.default_rng(8)
    x = g.standard_normal((2, 3) + hw).astype(dtype)
    oshape = li.output_shape(hw, k, p, s, d)
    cshape = (2, 3) + k + oshape

    def lower():
        out = _layout(layout, cshape, dtype)
        out[...] = np.nan  # every entry must be written
        return li.im2col(x, k, p, s, d, out=out).copy()

    assert_bits(*both(lower))
    col = _layout(layout, cshape, dtype)
    col[...] = g.standard_normal(cshape)
    assert_bits(*both(lambda: li.col2im(col, hw, k, p, s, d)))
    a, b = both(lambda: li.col2im(col, hw, k, p, s, d, out=np.full((2, 3) + hw, np.nan, dtype)))
    assert_bits(a, b)


# Chunk-shaped cases (type 1 lowers b_p images per call): every row path of the kernels -- padded
# scratch planes vs in-place reads, unit stride in whole vectors + a scalar tail, strided gathers.
CHUNK_CASES = [
    # n, c, (h, w), kernel, pad, stride, dilation
    (1, 2, (16, 16), (5, 5), (2, 2), (1, 1), (1, 1)),  # cifar10_quick conv2, one image: rows of 16
    (37, 3, (12, 12), (5, 5), (0, 0), (1, 1), (1, 1)),  # LeNet conv2, many images: rows of 8, no pad
    (6, 2, (8, 8), (5, 5), (2, 2), (1, 1), (1, 1)),  # cifar10_quick conv3: pad as wide as half the row
    (5, 2, (11, 13), (3, 5), (1, 2), (1, 1), (1, 1)),  # rectangular kernel, rows of 13 (vector + tail)
    (2, 1, (5, 30), (1, 3), (0, 0), (1, 1), (1, 1)),  # rows of 28: three vectors + 4
    (4, 3, (17, 19), (3, 3), (1, 1), (2, 2), (1, 1)),  # stride 2
    (3, 2, (13, 20), (3, 2), (2, 1), (1, 1), (2, 2)),  # dilation 2 with pad
    (2, 2, (9, 9), (3, 3), (0, 0), (2, 3), (2, 1)),  # mixed stride and dilation, no pad
    (3, 2, (6, 7), (4, 4), (0, 0), (3, 3), (1, 1)),  # no pad, last window hangs over (scratch plane)
]


@needs_numba
@pytest.mark.parametrize("threads", [1, None])
@pytest.mark.parametrize("layout", ["c", "type1"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,c,hw,k,p,s,d", CHUNK_CASES)
def test_im2col_col2im_chunks_bitwise(n, c, hw, k, p, s, d, dtype, layout, threads):
    g = np.random.default_rng(17)
    x = g.standard_normal((n, c) + hw).astype(dtype)
    x.reshape(-1)[:3] = [-0.0, np.inf, np.nan]
    cshape = (n, c) + k + li.output_shape(hw, k, p, s, d)

    def lower():
        out = _layout(layout, cshape, dtype)
        out[...] = np.nan  # every entry must be written
        return li.im2col(x, k, p, s, d, out=out).copy()

    col = _layout(layout, cshape, dtype)
    col[...] = g.standard_normal(cshape)
    col.reshape(-1)[:4] = [-0.0, -0.0, np.inf, -1e30]  # -0.0 sums: 0.0 + -0.0 is 0.0 only in the right order
    col[0, 0, 0, 0] = -0.0
    with kernels.num_threads(threads):
        cols = both(lower)
        grads = both(lambda: li.col2im(col, hw, k, p, s, d, out=np.full((n, c) + hw, np.nan, dtype)))
    assert_bits(*cols)
    assert_bits(*grads)
    # the lowered columns are the input's windows (direct check, not only "same as numpy")
    xp = np.pad(x, ((0, 0), (0, 0), (p[0], p[0] + s[0] * k[0] * d[0]), (p[1], p[1] + s[1] * k[1] * d[1])))
    oh, ow = cshape[4:]
    for i in range(k[0]):
        for j in range(k[1]):
            ref = xp[:, :, i * d[0]:i * d[0] + (oh - 1) * s[0] + 1:s[0], j * d[1]:j * d[1] + (ow - 1) * s[1] + 1:s[1]]
            assert_bits(ref, cols[1][:, :, i, j])


@needs_numba
def test_col2im_type1_col_into_strided_out():
    hw, k, p, s, d = (7, 9), (3, 3), (1, 1), (1, 1), (1, 1)
    cshape = (3, 2) + k + li.output_shape(hw, k, p, s, d)
    col = _layout("type1", cshape, np.float32)
    col[...] = np.random.default_rng(18).standard_normal(cshape)
    a, b = both(lambda: li.col2im(col, hw, k, p, s, d, out=np.full((3, 2) + hw + (2,), np.nan, np.float32)[..., 0]))
    assert_bits(a, b)


@needs_numba
@pytest.mark.parametrize("lead", [(), (3,), (2, 3), (2, 1, 3)])
def test_im2col_lead_axes_and_generic_strides(lead):
    hw, k, p, s, d = (6, 5), (3, 2), (1, 1), (2, 1), (1, 2)
    x = np.random.default_rng(9).standard_normal(lead + hw).astype(np.float32)
    oshape = li.output_shape(hw, k, p, s, d)
    a, b = both(lambda: li.im2col(x, k, p, s, d))
    assert_bits(a, b)
    assert_bits(*both(lambda: li.col2im(a, hw, k, p, s, d)))
    if len(lead) == 2:  # a strided view that is neither C order nor the type-1 buffer
        col = _layout("strided", lead + k + oshape, np.float32)
        col[...] = a
        assert_bits(*both(lambda: li.col2im(col, hw, k, p, s, d)))
        assert_bits(*both(lambda: li.im2col(x, k, p, s, d, out=_layout("strided", col.shape, np.float32)).copy()))


@needs_numba
@pytest.mark.parametrize("group", [1, 2])
def test_type1_lowering_bitwise(group):
    geom = ConvGeometry(channels_in=4, channels_out=6, group=group, in_shape=(7, 6), kernel=(3, 3), pad=(1, 0),
                        stride=(2, 1), dilation=(1, 1), out_shape=li.output_shape((7, 6), (3, 3), (1, 0), (2, 1),
                                                                                   (1, 1)))
    g = np.random.default_rng(10)
    x = g.standard_normal((3, 4, 7, 6)).astype(np.float32)
    w = g.standard_normal(geom.weight_shape).astype(np.float32)
    dy = g.standard_normal((3, 6) + geom.out_shape).astype(np.float32)
    t1 = get_strategy("type1")
    assert_bits(*both(lambda: t1.forward(x, w, None, geom)))
    assert_bits(*both(lambda: t1.backward_data(dy, w, geom)))
    assert_bits(*both(lambda: t1.backward_weights(dy, x, geom)[0]))


# -- selection, fallback, threads --------------------------------------------------------------------
@needs_numba
def test_kernel_modules_load():
    # get() falls back to None on a load failure; here every module must load (else the bitwise
    # tests above would compare the numpy path with itself).
    for name in ("pooling", "im2col", "lrn", "elementwise"):
        assert kernels.get(name) is not None, name
    assert kernels.enabled()


def test_kernel_module_load_failure_falls_back():
    tried = []

    def broken(name):
        tried.append(name)
        raise RuntimeError("no locator available")

    runtime = kernels.KernelRuntime(import_module=broken)
    runtime.numba_state = True  # as if numba imported: the module's own import fails
    assert runtime.get("pooling") is None and runtime.failed == {"pooling"}
    assert runtime.get("pooling") is None and tried == ["cct.kernels.pooling"]  # not tried again
    assert runtime.modules == {}


def test_env_var_forces_numpy(monkeypatch):
    monkeypatch.setattr(kernels, "RUNTIME", kernels.KernelRuntime())  # no set_mode override
    monkeypatch.setenv("CCT_KERNELS", "numpy")
    assert kernels.mode() == "numpy" and not kernels.enabled()
    assert not host_kernels_usable(np.zeros(3, np.float32))
    monkeypatch.setenv("CCT_KERNELS", "auto")
    assert kernels.mode() == "auto"
    assert host_kernels_usable(np.zeros(3, np.float32)) == kernels.numba_available()
    assert not host_kernels_usable(np.zeros(3, np.float32), np.zeros(3, np.float64))
    assert not host_kernels_usable(np.zeros(3, np.int32))
    with pytest.raises(ValueError):
        kernels.set_mode("fast")


def test_numba_import_failure_falls_back(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "RUNTIME", kernels.KernelRuntime())  # numba not tried yet
    monkeypatch.setitem(sys.modules, "numba", None)  # 'import numba' raises ImportError
    with caplog.at_level(logging.DEBUG, logger="cct"):
        assert not kernels.numba_available()
    assert any("numba unavailable" in r.getMessage() for r in caplog.records)
    assert kernels.get("pooling") is None and not kernels.enabled()
    with kernels.forced_mode("auto"):
        x = _pool_input((1, 2, 5, 5), np.float32, 0)
        y = run_layer('type: "Pooling" pooling_param { pool: MAX kernel_size: 2 stride: 2 }', x)
    assert y[0].shape == (1, 2, 3, 3)


def test_cct_import_does_not_compile_or_import_kernels():
    """Importing cct loads no compiled-kernel module, nor numba or llvmlite (the direct kernels' tile
    tables, plain Python, ask LLVM for the CPU's vector width only when first used), nor scipy.fft
    (~0.3 s; the FFT strategy loads it on its first transform)."""
    code = ("import sys, cct, cct.layers, cct.lowering, cct.net; "
            "print(sorted(m for m in sys.modules if m.startswith(('cct.kernels.', 'numba', 'llvmlite', 'scipy.fft'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    # simd_tiles: plain-Python tile tables; gpu_pooling: the CuPy kernels' source text, compiled by CuPy on first use
    assert set(ast.literal_eval(out.strip())) <= {"cct.kernels.simd_tiles", "cct.kernels.gpu_pooling"}


@needs_numba
def test_thread_budget():
    old = kernels.get_num_threads()
    x = np.random.default_rng(12).standard_normal((3, 4, 9, 9)).astype(np.float32)
    text = 'type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 2 }'
    with kernels.forced_mode("auto"):
        ref = run_layer(text, x)
        with kernels.num_threads(1) as k:
            assert k == 1 and kernels.get_num_threads() == 1
            one = run_layer(text, x)
    assert kernels.get_num_threads() == old
    for u, v in zip(ref, one):
        assert_bits(u, v)
    assert kernels.set_num_threads(10 ** 6) == kernels.get_num_threads() >= 1
    kernels.set_num_threads(old)
    assert kernels.info()["enabled"] in (True, False)


@needs_numba
def test_concurrent_calls_from_several_threads():
    x = np.random.default_rng(13).standard_normal((4, 6, 11, 11)).astype(np.float32)
    text = 'type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 2 }'
    with kernels.forced_mode("numpy"):
        ref = run_layer(text, x)
    got, errors = [], []

    def work():
        try:
            got.append(run_layer(text, x))
        except Exception as e:  # pragma: no cover (reported below)
            errors.append(e)

    with kernels.forced_mode("auto"):
        threads = [threading.Thread(target=work) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors and len(got) == 3
    for res in got:
        for u, v in zip(ref, res):
            assert_bits(u, v)
    # every thread may use the kernels (their pieces run on cct's own threads, not numba's threading layer)
    seen = []
    with kernels.forced_mode("auto"):
        t = threading.Thread(target=lambda: seen.append(host_kernels_usable(x)))
        t.start()
        t.join()
        assert seen == [True] and host_kernels_usable(x)


@needs_numba
@pytest.mark.parametrize("dtype", [np.float32])
@pytest.mark.parametrize("slope", [0.0, 0.1, -0.5])
def test_relu_kernels_bitwise(slope, dtype):
    ke = kernels.get("elementwise")
    x = np.random.default_rng(14).standard_normal((3, 5, 7, 11)).astype(dtype)
    x.reshape(-1)[:7] = [np.nan, -0.0, 0.0, -np.inf, np.inf, 1.0, -1.0]
    dy = np.random.default_rng(15).standard_normal(x.shape).astype(dtype)
    ref = np.maximum(x, 0) if slope == 0 else np.where(x > 0, x, x * slope)
    assert_bits(ref, ke.relu_forward(x, np.empty_like(x), slope))
    inplace = x.copy()
    assert_bits(ref, ke.relu_forward(inplace, inplace, slope))
    ref = np.where(x > 0, dy, 0) if slope == 0 else np.where(x > 0, dy, dy * slope)
    assert_bits(ref.astype(dtype), ke.relu_backward(x, dy, np.empty_like(x), slope))
    g = dy.copy()
    assert_bits(ref.astype(dtype), ke.relu_backward(x, g, g, slope))


@needs_numba
def test_swap01_matches_type1_transposes():
    ke = kernels.get("elementwise")
    g = np.random.default_rng(16)
    m, n, p = 5, 3, 7
    y = g.standard_normal((m, n * p)).astype(np.float32)
    b = g.standard_normal(m).astype(np.float32)
    ref = y.reshape(m, n, p).swapaxes(0, 1) + b.reshape(m, 1)  # type 1's lifting + bias
    assert_bits(ref, ke.swap01(y.reshape(m, n, p), np.empty((n, m, p), np.float32), b))
    dy = g.standard_normal((n, m, p)).astype(np.float32)
    ref = np.ascontiguousarray(dy.reshape(n, 1, m, p).transpose(1, 2, 0, 3)).reshape(m, n, p)  # _group_major
    assert_bits(ref, ke.swap01(dy, np.empty((m, n, p), np.float32)))
    with pytest.raises(ValueError):
        ke.swap01(dy, np.empty((n, m, p), np.float32))


@needs_numba
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("decay", [0.0, 5e-4])
def test_sgd_l2_kernel_bitwise(decay, dtype):
    """The fused update equals updates.regularize (L2) + updates.sgd bit for bit, over several chunks."""
    from cct.solver import updates

    r = np.random.default_rng(17)
    w = r.standard_normal(70001).astype(dtype)
    d = r.standard_normal(w.shape).astype(dtype)
    h = r.standard_normal(w.shape).astype(dtype)
    d_ref, h_ref = d.copy(), h.copy()
    t = dtype
    updates.regularize(w, d_ref, t(decay), "L2")
    updates.sgd(d_ref, h_ref, t(0.01) * t(2), 0.9)
    kernels.get("update").sgd_l2(w, d, h, t(decay), t(0.01) * t(2), 0.9)
    assert_bits(d_ref, d)
    assert_bits(h_ref, h)
    assert not np.array_equal(d, r.standard_normal(w.shape).astype(dtype))
    # with apply: Net::Update's data -= diff in the same pass, same bits
    w2, d2, h2 = w.copy(), r.standard_normal(w.shape).astype(dtype), h.copy()
    w_ref, d2_ref, h2_ref = w2.copy(), d2.copy(), h2.copy()
    updates.regularize(w_ref, d2_ref, t(decay), "L2")
    updates.sgd(d2_ref, h2_ref, t(0.01) * t(2), 0.9)
    w_ref -= d2_ref
    kernels.get("update").sgd_l2(w2, d2, h2, t(decay), t(0.01) * t(2), 0.9, True)
    assert_bits(w_ref, w2)
    assert_bits(d2_ref, d2)


@needs_numba
def test_sgd_solver_fused_and_numpy_updates_agree(monkeypatch):
    """Three SGD iterations of a small net give the same weights with the kernels on and off (the
    convolution pinned to type 1, whose GEMMs are the same on both paths: the direct kernels sum in
    another order than the numpy path)."""
    from cct.solver import get_solver

    monkeypatch.setenv("CCT_LOWERING", "type1")

    ku = kernels.get("update")
    calls = []
    real = ku.sgd_l2
    monkeypatch.setattr(ku, "sgd_l2", lambda *a: calls.append(1) or real(*a))

    net = parse_text("""
        layer { name: "data" type: "DummyData" top: "data" top: "label"
          dummy_data_param { shape { dim: 4 dim: 3 dim: 8 dim: 8 } shape { dim: 4 }
            data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 } } }
        layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
          param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
          convolution_param { num_output: 5 kernel_size: 3 weight_filler { type: "xavier" } } }
        layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
          inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
        layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
    """, caffe_pb2.NetParameter())

    def run():
        sp = caffe_pb2.SolverParameter(base_lr=0.1, momentum=0.9, weight_decay=0.01, lr_policy="fixed",
                                       max_iter=3, random_seed=3, snapshot_after_train=False)
        sp.net_param.CopyFrom(net)
        solver = get_solver(sp)
        solver.step(3)
        return [b.data.copy() for b in solver.net.learnable_params]

    ref, got = both(run)
    assert len(calls) == 3 * 4  # the kernel path ran the fused update for each of the 4 params
    for a, b in zip(ref, got):
        assert_bits(a, b)


def test_launch_runs_one_piece_per_kernel_thread_and_small_work_on_the_caller():
    """``launch`` runs ``kernel(piece, pieces, ...)`` once per kernel thread of the caller, piece 0 on the
    calling thread and the others on the kernel team at the same time; work under the limit is one
    piece. The lowering kernels use a larger limit than the others."""
    import threading

    from cct import kernels as km

    seen, meet = [], threading.Barrier(2, timeout=30)

    def kernel(piece, pieces, tag):
        seen.append((tag, piece, pieces, threading.current_thread() is threading.main_thread()))
        if pieces == 2:
            meet.wait()  # both pieces run at once (a serial run would time out here)

    with km.num_threads(2) as k:
        km.launch(kernel, "big", work=km.SMALL_WORK)
        km.launch(kernel, "small", work=10)
        km.launch(kernel, "lowering", work=km.SMALL_WORK, limit=km.LOWERING_SMALL_WORK)
    if k < 2:
        pytest.skip("one core")
    assert sorted(seen) == [("big", 0, 2, True), ("big", 1, 2, False), ("lowering", 0, 1, True), ("small", 0, 1, True)]
    assert km.LOWERING_SMALL_WORK > km.SMALL_WORK


def test_launch_raises_a_pieces_error_after_every_piece_ended():
    import threading
    import time

    from cct import kernels as km

    ended = threading.Event()

    def kernel(piece, pieces):
        if piece == 0:
            raise ZeroDivisionError("piece 0")
        time.sleep(0.05)
        ended.set()

    with km.num_threads(2) as k:
        if k < 2:
            pytest.skip("one core")
        with pytest.raises(ZeroDivisionError, match="piece 0"):
            km.launch(kernel)
    assert ended.is_set()


def test_kernel_thread_counts_are_per_thread_and_restored():
    import threading

    from cct import kernels as km

    with km.num_threads(1):
        assert km.get_num_threads() == 1
        other = []
        t = threading.Thread(target=lambda: other.append(km.get_num_threads()))
        t.start()
        t.join()
        assert other == [km.max_threads()]  # another thread keeps its own (default) count
    assert km.get_num_threads() == km.max_threads()
    assert km.set_num_threads(10 ** 6) == km.max_threads() and km.set_num_threads(None) == km.max_threads()
