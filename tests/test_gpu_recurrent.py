"""LSTM, RNN, LSTMUnit and SPP on the CuPy path (skipped without CuPy and a GPU): the real-Caffe
cases of test_reference_layers.py with GPU blobs, and float64 gradient checks with GPU blobs."""
import numpy as np
import pytest
from refcase import max_rel_err, reference_available, run_case_layerwise

from cct.blob import Blob
from cct.device.driver import CupyDevice, cupy_available
from cct.io.prototxt import parse_text
from cct.layers import create_layer
from cct.proto import caffe_pb2
from cct.testing import check_gradient, make_blob

pytestmark = pytest.mark.skipif(not cupy_available(), reason="needs CuPy and a GPU")


@pytest.mark.skipif(not reference_available(), reason="../shared/reference not present")
@pytest.mark.parametrize("case", ["lstm_t3_n2", "lstmunit", "rnn_t3_n2", "spp_max_h2"])
def test_added_case_on_gpu_matches_caffe(case):

    results = run_case_layerwise(case, device=CupyDevice(0))
    assert results
    for what, ours, theirs in results:
        err = max_rel_err(ours, theirs)
        assert err <= 1e-4, f"{case} on the GPU: {what} differs from Caffe by {err:.3g}"


REC = ('recurrent_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 } '
       'bias_filler { type: "gaussian" std: 0.3 } }')


@pytest.mark.parametrize("text,static", [(f'type: "LSTM" {REC}', False), (f'type: "RNN" {REC}', True),
                                         ('type: "SPP" spp_param { pyramid_height: 2 pool: AVE }', None)])
def test_gradient_on_gpu(text, static):
    import cupy

    lp = caffe_pb2.LayerParameter()
    parse_text('name: "l" ' + text, lp)
    layer = create_layer(lp)
    gen = np.random.default_rng(3)
    if static is None:
        bottom = [make_blob(gen.standard_normal((1, 2, 6, 5)), device=CupyDevice(0))]
        check = [0]
    else:
        cont = np.array([[0, 0], [1, 0], [1, 1]], dtype=np.float64)
        bottom = [make_blob(a, device=CupyDevice(0)) for a in (gen.standard_normal((3, 2, 2)), cont)]
        if static:
            bottom.append(make_blob(gen.standard_normal((2, 3)), device=CupyDevice(0)))
        check = [0, 2] if static else [0]
    top = [Blob((), dtype=np.float64, device=CupyDevice(0))]
    check_gradient(layer, bottom, top, check_bottom=check, threshold=1e-3)
    assert isinstance(top[0].data, cupy.ndarray), "the layer left the GPU"
