"""The CuPy path of the layer library (skipped without CuPy and a GPU).

Every real-Caffe unit case of ../shared/reference runs layer by layer with its blobs in GPU memory
and must match Caffe to 1e-4, as the CPU path does in test_reference_layers.py; a float64 gradient
check on the GPU covers each convolution lowering and the layer families with hand-written
backward code.
"""
import numpy as np
import pytest
from refcase import list_cases, max_rel_err, reference_available, run_case_layerwise

from cct import rng
from cct.blob import Blob
from cct.device.driver import CupyDevice, HostDevice, cupy_available, to_host
from cct.io.prototxt import parse_text
from cct.layers import create_layer
from cct.proto import caffe_pb2
from cct.testing import check_gradient, make_blob

pytestmark = pytest.mark.skipif(not cupy_available(), reason="needs CuPy and a GPU")

UNIT_CASES = list_cases("unit") if reference_available() else []


def _cupy():
    import cupy

    return cupy


@pytest.mark.skipif(not reference_available(), reason="../shared/reference not present")
@pytest.mark.parametrize("case", UNIT_CASES)
def test_unit_case_on_gpu_matches_caffe(case):
    results = run_case_layerwise(case, device=CupyDevice(0))
    assert results, f"{case}: nothing compared"
    for what, ours, theirs in results:
        err = max_rel_err(ours, theirs)
        assert err <= 1e-4, f"{case} on the GPU: {what} differs from Caffe by {err:.3g} (relative to its max)"


def _layer(text: str):
    lp = caffe_pb2.LayerParameter()
    parse_text(text, lp)
    lp.name = "l"
    lp.phase = caffe_pb2.TRAIN
    return create_layer(lp)


CONV = ('type: "Convolution" convolution_param { num_output: 3 kernel_size: 3 pad: 1 stride: 2 '
        'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" std: 0.5 } }')

GRADIENT_CASES = {
    "conv_type1": (CONV, [(2, 3, 6, 5)]),
    "conv_type2": (CONV, [(2, 3, 6, 5)]),
    "conv_type3": (CONV, [(2, 3, 6, 5)]),
    "deconv": ('type: "Deconvolution" convolution_param { num_output: 2 kernel_size: 3 stride: 2 '
               'weight_filler { type: "gaussian" std: 0.5 } }', [(2, 3, 3, 4)]),
    "ip": ('type: "InnerProduct" inner_product_param { num_output: 4 weight_filler { type: "gaussian" } '
           'bias_filler { type: "gaussian" } }', [(3, 2, 3, 2)]),
    "pool_ave": ('type: "Pooling" pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 }', [(2, 2, 6, 5)]),
    "lrn": ('type: "LRN" lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 }', [(2, 5, 3, 3)]),
    "softmax": ('type: "Softmax"', [(2, 4, 3)]),
    "sigmoid": ('type: "Sigmoid"', [(3, 4)]),
    "tanh": ('type: "TanH"', [(3, 4)]),
    "batchnorm": ('type: "BatchNorm"', [(4, 3, 2, 2)]),
    "scale": ('type: "Scale" scale_param { bias_term: true }', [(2, 3, 2, 2)]),
}


@pytest.mark.parametrize("name", sorted(GRADIENT_CASES))
def test_gradient_on_gpu(name):
    cp = _cupy()
    text, shapes = GRADIENT_CASES[name]
    layer = _layer(text)
    if name.startswith("conv_"):
        layer.lowering = name.split("_")[1]  # each of CcT's lowerings, forced
    gen = np.random.default_rng(7)
    bottom = [make_blob(gen.standard_normal(s), device=CupyDevice(0)) for s in shapes]
    top = [Blob((), dtype=np.float64, device=CupyDevice(0))]
    check_gradient(layer, bottom, top, threshold=1e-3)
    assert isinstance(top[0].data, cp.ndarray), "the layer left the GPU"


def test_conv_on_gpu_equals_cpu():
    x = np.random.default_rng(3).standard_normal((4, 3, 9, 8)).astype(np.float32)
    outs = []
    for device in (HostDevice(), CupyDevice(0)):
        layer = _layer(CONV)
        bottom, top = [make_blob(x, device=device)], [Blob((), device=device)]
        rng.set_random_seed(5)
        layer.setup(bottom, top)
        layer.forward(bottom, top)
        outs.append(to_host(top[0].data))
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("pool", [
    "kernel_size: 3 stride: 2",  # CaffeNet's, windows overhanging the input (ceil)
    "kernel_size: 2 stride: 2",  # LeNet's
    "kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 pad_h: 1 pad_w: 1",
    "kernel_size: 2 stride: 3",  # stride > kernel: positions no window covers
])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_max_pooling_kernels_on_gpu_equal_the_array_path_bitwise(pool, dtype):
    from cct import kernels
    from cct.kernels import gpu_pooling

    cp = _cupy()
    gen = np.random.default_rng(4)
    x = gen.standard_normal((3, 4, 9, 8)).astype(dtype)
    x[0, 0, :2, :2] = 1.5  # ties: the first maximum in window order wins
    dy = gen.standard_normal
    results = []
    for mode in ("auto", "numpy"):
        with kernels.forced_mode(mode):
            layer = _layer(f'type: "Pooling" pooling_param {{ pool: MAX {pool} }}')
            gpu = CupyDevice(0)
            bottom, top = [make_blob(x, device=gpu)], [Blob((), dtype=dtype, device=gpu) for _ in range(2)]
            layer.setup(bottom, top)
            assert gpu_pooling.usable(bottom[0].data, top[0].data) == (mode == "auto")
            layer.forward(bottom, top)
            top[0].diff[...] = cp.asarray(dy(top[0].shape).astype(dtype)) if not results else results[0][3]
            layer.backward(top, [True], bottom)
            results.append((to_host(top[0].data), to_host(top[1].data), to_host(bottom[0].diff), top[0].diff))
    (y, mask, dx, _), (y_ref, mask_ref, dx_ref, _) = results
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(mask, mask_ref)
    np.testing.assert_array_equal(dx, dx_ref)
    assert np.count_nonzero(dx) > 0
