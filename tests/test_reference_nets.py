"""Whole nets against BVLC Caffe: every upstream net's blob shapes (shapes.json) and the model cases."""
import json
import os

import numpy as np
import pytest
from refcase import REFERENCE_DIR, list_cases, max_rel_err, once_per_name, reference_available, run_model_case

import cct
from cct.io.prototxt import read_net_prototxt
from cct.proto import caffe_pb2

pytestmark = pytest.mark.skipif(not reference_available(), reason="../shared/reference not present")

MODELS_DIR = os.path.join(REFERENCE_DIR, "..", "caffe-models")
SHAPES = json.load(open(os.path.join(REFERENCE_DIR, "shapes.json"))) if reference_available() else {}
SHAPE_KEYS = [k for k in SHAPES if k != "_about"]


def substitute_inputs(param: caffe_pb2.NetParameter, shapes: dict) -> caffe_pb2.NetParameter:
    """Replace data layers by Input layers of the shapes Caffe reported (as the reference did)."""
    out = caffe_pb2.NetParameter()
    out.CopyFrom(param)
    for lp in out.layer:
        if lp.type in ("Data", "HDF5Data", "ImageData") and all(t in shapes for t in lp.top):
            tops, name, include, exclude = list(lp.top), lp.name, list(lp.include), list(lp.exclude)
            lp.Clear()
            lp.name, lp.type = name, "Input"
            lp.top.extend(tops)
            lp.include.extend(include)
            lp.exclude.extend(exclude)
            for t in tops:
                lp.input_param.shape.add().dim.extend(shapes[t])
    return out


@pytest.mark.parametrize("key", SHAPE_KEYS)
@pytest.mark.parametrize("phase", ["TRAIN", "TEST"])
def test_upstream_net_shapes(key, phase):
    expected = SHAPES[key][phase]
    param = read_net_prototxt(os.path.join(MODELS_DIR, key))
    param = substitute_inputs(param, expected["substituted_inputs"])
    stages = ["test-on-test"] if (key == "mnist/mnist_autoencoder.prototxt" and phase == "TEST") else None
    net = cct.Net(param, phase, stages=stages)
    assert [n for n in net.layer_names if not n.endswith("_split")] == expected["layers"]
    types = [l.type for l in net.layers if l.type != "Split" or not l.name.endswith("_split")]
    assert types == expected["layer_types"]
    for blob, shape in expected["blobs"].items():
        assert list(net.blobs[blob].shape) == shape, f"{key} {phase}: blob {blob}"
    split_layers = [n for n in net.layer_names if n.endswith("_split")]
    assert split_layers == expected["caffe_auto_split_layers"]
    for blob, shape in expected["caffe_auto_split_blobs"].items():
        assert list(net.blobs[blob].shape) == shape


MODEL_CASES = [c for c in list_cases("model")] if reference_available() else []


@pytest.fixture(scope="module")
def model_run():
    """``model_run(name)``: :func:`refcase.run_model_case` once per case for the forward and the backward test
    (one forward and backward; both tests only read the net)."""
    return once_per_name(run_model_case)


@pytest.mark.parametrize("name", MODEL_CASES)
def test_model_case_forward_matches_caffe(model_run, name):
    case, net, loss = model_run(name)
    a = case.arrays
    for blob in case.meta["blobs"]:
        key = f"data/{blob}"
        if key in a:
            assert max_rel_err(net.blobs[blob].data, a[key]) <= 1e-4, f"{name}: {key}"
    for blob, value in case.meta["loss_values"].items():
        assert abs(float(net.blobs[blob].data) - value) <= 1e-4 * max(1.0, abs(value))


@pytest.mark.parametrize("name", MODEL_CASES)
def test_model_case_backward_matches_caffe(model_run, name):
    case, net, _ = model_run(name)
    a = case.arrays
    checked = 0
    for key in a:
        if key.startswith("diff/"):
            blob = key[5:]
            if blob in case.meta["loss_blobs"] or blob == "label":
                continue
            assert max_rel_err(net.blobs[blob].diff, a[key]) <= 1e-4, f"{name}: {key}"
            checked += 1
        elif key.startswith("paramdiff/"):
            layer, idx = key[len("paramdiff/"):].rsplit("/", 1)
            ours = net.layer_by_name(layer).blobs[int(idx)].diff
            assert max_rel_err(ours, a[key]) <= 1e-4, f"{name}: {key}"
            checked += 1
    assert checked > 0


def test_model_case_weights_round_trip(tmp_path):
    case, net, _ = run_model_case("lenet")
    path = tmp_path / "lenet.caffemodel"
    net.save(path)
    net2 = cct.Net(os.path.join(case.dir, "net.prototxt"), "TRAIN", weights=str(path))
    for l1, l2 in zip(net.layers, net2.layers):
        for b1, b2 in zip(l1.blobs, l2.blobs):
            np.testing.assert_array_equal(b1.data, b2.data)
