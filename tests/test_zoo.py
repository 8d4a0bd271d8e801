"""Public model-zoo nets (../shared/zoo, see its README) build and run forward at batch 1 with random
weights, giving the output shapes their authors document.

Every net is built at its documented input size and its outputs' shapes are checked. The forward pass
runs at that size too, except for the two nets too costly for the default suite on a small CPU:
FCN-8s (conv1_1's pad of 100 makes any input cost >10 GFLOP; its shapes are also checked at 64x64)
and S2VT (a 46168-way prediction over 80 x 32 steps, ~300 GFLOP) are only built;
``CCT_ZOO_FULL=1`` runs both forward in full.
BatchNorm statistics are set to mean 0 / variance 1 so that deep random nets stay finite.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import cct
from cct.io import read_net_prototxt
from cct.proto import caffe_pb2

ZOO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "zoo")
FULL = os.environ.get("CCT_ZOO_FULL", "") not in ("", "0")

pytestmark = pytest.mark.skipif(not os.path.isdir(ZOO), reason="../shared/zoo not present")

# file -> (input size (H, W) to build at, {output blob: documented shape}, {inner blob: shape} to check)
NETS = {
    "resnet50_deploy.prototxt": ((224, 224), {"prob": (1, 1000)}, {"pool5": (1, 2048, 1, 1)}),
    "squeezenet11_deploy.prototxt": ((227, 227), {"prob": (1, 1000, 1, 1)}, {}),
    "vgg16_official_v1.prototxt": ((224, 224), {"prob": (1, 1000)}, {"pool5": (1, 512, 7, 7)}),
    "mobilenet_v2.prototxt": ((224, 224), {"prob": (1, 1000, 1, 1)}, {}),
    # round_mode: FLOOR on pool1: 112 -> 56 (CEIL would give 57 and break the dense blocks' concats)
    "densenet121_roundmode.prototxt": ((224, 224), {"fc6": (1, 1000, 1, 1)}, {"pool1": (1, 64, 56, 56)}),
    "fcn8s_deploy.prototxt": ((500, 500), {"score": (1, 21, 500, 500)}, {}),
    "inception_v3.prototxt": ((299, 299), {"prob": (1, 1000)}, {}),
}


def _batch_one(param: caffe_pb2.NetParameter, hw: tuple[int, int] | None = None) -> caffe_pb2.NetParameter:
    """The net with every Input blob at batch 1 (and, for 4-D inputs, spatial size ``hw``)."""
    for layer in param.layer:
        if layer.type == "Input":
            for shape in layer.input_param.shape:
                shape.dim[0] = 1
                if hw is not None and len(shape.dim) == 4:
                    shape.dim[2], shape.dim[3] = hw
    return param


def _sane_batchnorm(net: cct.Net) -> None:
    for layer in net.layers:
        if layer.type == "BatchNorm":
            mean, var, factor = layer.blobs
            mean.data[...] = 0
            var.data[...] = 1
            factor.data[...] = 1


def _forward(net: cct.Net) -> None:
    rng = np.random.default_rng(0)
    _sane_batchnorm(net)
    for name in net.input_blob_names:
        blob = net.blobs[name]
        blob.data[...] = rng.uniform(-1, 1, size=blob.shape)
    net.forward()


@pytest.mark.parametrize("fname", sorted(NETS))
def test_zoo_net_builds_and_runs_forward(fname):
    hw, outputs, inner = NETS[fname]
    param = _batch_one(read_net_prototxt(os.path.join(ZOO, fname)))
    cct.set_random_seed(1)
    net = cct.Net(param, cct.TEST)
    assert {n: net.blobs[n].shape for n in net.output_blob_names} == outputs
    assert net.blobs[net.input_blob_names[0]].shape[2:] == hw
    for blob, shape in inner.items():
        assert net.blobs[blob].shape == shape, blob
    if fname.startswith("fcn8s") and not FULL:
        # conv1_1's pad of 100 makes any input cost >10 GFLOP: shapes only (net.reshape() above)
        net.blobs["data"].reshape((1, 3, 64, 64))
        net.reshape()  # the Crop layers follow the input size
        assert net.blobs["score"].shape == (1, 21, 64, 64)
        return
    _forward(net)
    for name, shape in outputs.items():
        out = net.blobs[name].data
        assert out.shape == shape
        assert np.isfinite(out).all(), f"{fname}: {name} is not finite"
        if name == "prob":
            np.testing.assert_allclose(out.reshape(1, 1000).sum(axis=1), 1.0, rtol=1e-4)


def _s2vt_param() -> caffe_pb2.NetParameter:
    """S2VT in TRAIN with its HDF5 inputs replaced by Input blobs (T = 80, N = 32, as its Reshape fixes)."""
    src = read_net_prototxt(os.path.join(ZOO, "s2vt.prototxt"))
    param = caffe_pb2.NetParameter(name=src.name)
    hdf5 = [l for l in src.layer if l.type == "HDF5Data"]
    tops = list(hdf5[0].top)
    assert tops == ["cont_sentence", "input_sentence", "target_sentence", "stage_indicator", "frame_fc7"]
    for top in tops:
        layer = param.layer.add(name=top, type="Input", top=[top])
        layer.input_param.shape.add(dim=[80, 32, 4096] if top == "frame_fc7" else [80, 32])
    param.layer.extend(l for l in src.layer if l.type != "HDF5Data")
    return param


def test_s2vt_lstm_captioning_net():
    if "LSTM" not in cct.layer_type_list():
        pytest.skip("S2VT needs the LSTM layer, which this build does not register yet")
    cct.set_random_seed(1)
    net = cct.Net(_s2vt_param(), cct.TRAIN, stages=["unfactored"])
    assert net.blobs["embedded_input_video_sequence"].shape == (80, 32, 1001)
    assert net.blobs["lstm1"].shape == (80, 32, 1000)
    assert net.blobs["predict"].shape == (80, 32, 46168)
    assert net.output_blob_names == ["cross_entropy_loss"] and net.blobs["cross_entropy_loss"].shape == ()
    if not FULL:
        return
    rng = np.random.default_rng(0)
    net.blobs["frame_fc7"].data[...] = rng.standard_normal((80, 32, 4096))
    words = rng.integers(0, 46168, size=(80, 32))
    net.blobs["input_sentence"].data[...] = words
    net.blobs["target_sentence"].data[...] = np.roll(words, -1, axis=0)
    net.blobs["cont_sentence"].data[...] = np.arange(80)[:, None] > 0
    net.blobs["stage_indicator"].data[...] = np.arange(80)[:, None] >= 40
    loss = net.forward()
    # near-uniform predictions at random init: loss ~ 20 * log(46168)
    assert 0.8 * 20 * np.log(46168) < loss < 1.2 * 20 * np.log(46168)
