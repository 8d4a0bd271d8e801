"""Dense inference, part 4: InnerProduct layers at the end run as the equivalent convolutions; TIFF output."""
from __future__ import annotations

import json

import numpy as np
import pytest
from google.protobuf import text_format

import cct
from cct.infer.pipeline import DenseInference
from cct.infer.surgery import convert_inner_products
from cct.proto import caffe_pb2

tifffile = pytest.importorskip("tifffile")

# field of view 8: conv 3, pool 2/2, conv 2, then the InnerProduct sees a 2x2 map of 3 channels
NET = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 1 dim: 8 dim: 8 } } }
layer { name: "c1" type: "Convolution" bottom: "data" top: "c1" convolution_param { num_output: 2 kernel_size: 3 } }
layer { name: "r1" type: "ReLU" bottom: "c1" top: "c1" }
layer { name: "p1" type: "Pooling" bottom: "c1" top: "p1" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "c2" type: "Convolution" bottom: "p1" top: "c2" convolution_param { num_output: 3 kernel_size: 2 } }
layer { name: "fc1" type: "InnerProduct" bottom: "c2" top: "fc1" inner_product_param { num_output: 4 } }
layer { name: "r2" type: "ReLU" bottom: "fc1" top: "fc1" }
layer { name: "fc2" type: "InnerProduct" bottom: "fc1" top: "fc2"
        inner_product_param { num_output: 2 transpose: TRANSPOSE } }
layer { name: "prob" type: "Softmax" bottom: "fc2" top: "prob" }
"""


def _net(transpose: bool, dtype=np.float64) -> cct.Net:
    txt = NET.replace("TRANSPOSE", "true" if transpose else "false")
    net = cct.Net(text_format.Parse(txt, caffe_pb2.NetParameter()), cct.TEST, dtype=dtype)
    rng = np.random.default_rng(0)
    for blobs in net.params.values():
        for b in blobs:
            b.data[...] = rng.standard_normal(b.shape)
    return net


def _patchwise(net: cct.Net, vol: np.ndarray) -> np.ndarray:
    """The definition: the original net (with its InnerProducts) on every 8x8 window."""
    out = np.empty((2, vol.shape[0] - 7, vol.shape[1] - 7))
    for y in range(out.shape[1]):
        for x in range(out.shape[2]):
            net.blobs["data"].data[0, 0] = vol[y:y + 8, x:x + 8]
            net.forward()
            out[:, y, x] = net.blobs["prob"].data[0]
    return out


@pytest.mark.parametrize("transpose", [False, True])
def test_inner_products_as_convolutions_equal_the_patchwise_net(transpose):
    net = _net(transpose)
    vol = np.random.default_rng(1).standard_normal((19, 16))
    want = _patchwise(net, vol)
    for method, patch in [("mpf", (13, 11)), ("shift", (30, 30))]:
        di = DenseInference(net, patch=patch, method=method)
        got = di(vol)
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    text = di.plan.describe()
    assert "InnerProduct 'fc1' converted to the equivalent 2x2 convolution" in text
    assert "InnerProduct 'fc2' converted to the equivalent 1x1 convolution" in text


def test_a_net_without_inner_product_is_returned_as_is():
    net = _net(False)
    conv, notes = convert_inner_products(net)
    again, none = convert_inner_products(conv)
    assert notes and again is conv and none == []
    assert [lp.type for lp in conv.param.layer].count("Convolution") == 4


def test_tiff_output_equals_the_in_memory_output(tmp_path):
    net = _net(False, dtype=np.float32)
    vol = np.random.default_rng(2).standard_normal((23, 20)).astype(np.float32)
    want = DenseInference(net, patch=(30, 30))(vol).copy()
    tifffile.imwrite(tmp_path / "in.tif", vol)
    s = DenseInference(net, patch=(13, 11)).run_files(f"{tmp_path}/in.tif", f"{tmp_path}/out.tif", progress=False)
    got = tifffile.imread(tmp_path / "out.tif")
    assert s["tiles"] > 2 and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert json.loads((tmp_path / "out.tif.json").read_text())["cct_infer_method"] == "mpf"
    assert not (tmp_path / "out.tif.partial").exists()
