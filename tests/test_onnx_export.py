"""ONNX export (cct.onnx, ``cct export_onnx``) checked by ONNX Runtime against cct's own forward.

* Every real-Caffe unit case of ../shared/reference whose layers are exportable: ORT's outputs equal
  cct's forward (which itself equals Caffe's, tests/test_reference_layers.py) to 1e-5 relative; the
  cases with a refused layer must fail with the clean error naming that layer.
* The zoo nets and models/ deploy nets with random weights, exported with a dynamic batch and run at
  batch 1 and 4 (the costliest at batch 1 only), compared on the outputs and the logits before softmax.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from refcase import case_dir, list_cases, load_case, reference_available

import cct
from cct.errors import CctError, LayerError
from cct.io import read_net_prototxt
from cct.io.prototxt import parse_text
from cct.paths import shared_path
from cct.proto import caffe_pb2

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from cct.onnx import export, to_onnx  # noqa: E402  (after the optional-dependency skip)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ZOO = str(shared_path("zoo"))
RTOL = 1e-5

ADDED_CASES = ["infogain_axis2", "lstm_t3_n2", "lstmunit", "rnn_t3_n2", "spp_max_h2", "pool_max_round_floor",
               "pool_ave_round_floor"]
UNIT_CASES = list_cases("unit") + ADDED_CASES if reference_available() else []
# case -> the layer type the exporter must refuse (with its reason); every other unit case must match ORT.
REFUSED_CASES = {
    "accuracy_top3": "Accuracy", "batchnorm_train_scale_bias": "BatchNorm",
    "contrastive_loss_margin1": "ContrastiveLoss",
    "euclidean_loss": "EuclideanLoss", "hinge_loss_l1": "HingeLoss", "hinge_loss_l2": "HingeLoss",
    "infogain_loss_Hfile": "InfogainLoss", "infogain_axis2": "InfogainLoss",
    "multinomial_logistic_loss": "MultinomialLogisticLoss", "pool_max_with_mask_8x8k3s2": "Pooling",
    "sigmoid_cross_entropy_loss": "SigmoidCrossEntropyLoss", "softmaxloss_ignore255_valid": "SoftmaxWithLoss",
    "softmaxloss_plain": "SoftmaxWithLoss",
}


def rel_err(actual, expected) -> float:
    """max|a - e| / max|e| (the reference README's per-array check)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"shape {actual.shape} != {expected.shape}"
    scale = np.abs(expected).max() if expected.size else 0.0
    diff = np.abs(actual - expected).max() if expected.size else 0.0
    return float(diff / scale) if scale else float(diff)


def run_ort(model, feeds: dict, extra_outputs=()) -> dict:
    """Run ``model`` in ONNX Runtime (CPU); ``extra_outputs``: inner values to return as well."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for name in extra_outputs:
        m.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds)))


# -- the reference cases -----------------------------------------------------------------------------
@pytest.mark.skipif(not reference_available(), reason="../shared/reference not present")
@pytest.mark.parametrize("case", UNIT_CASES)
def test_reference_case_onnx_equals_cct(case, monkeypatch):
    ref = load_case(case)
    monkeypatch.chdir(case_dir(case))  # relative sources, as Caffe ran the case
    phase = caffe_pb2.TRAIN if ref.meta["phase"] == "TRAIN" else caffe_pb2.TEST
    net = cct.Net(ref.net, phase, weights=ref.meta.get("weights_file", "weights.caffemodel"))
    if case in REFUSED_CASES:
        with pytest.raises(LayerError, match="cannot be exported to ONNX") as err:
            to_onnx(net)
        assert err.value.layer_type == REFUSED_CASES[case]
        assert "\n" not in str(err.value)
        return
    feeds = {b: ref.arrays[f"input/{b}"] for b in net.input_blob_names}
    for b, v in feeds.items():
        net.blobs[b].data[...] = v
    net.forward()
    model = to_onnx(net)
    outs = run_ort(model, feeds)
    graph_outputs = [o.name for o in model.graph.output]
    assert len(graph_outputs) == len(net.output_blob_names) >= 1
    for blob, value in zip(net.output_blob_names, graph_outputs):
        ours = net.blobs[blob].data
        assert np.abs(ours).max() > 0 or case.startswith("threshold"), f"{case}: {blob} is all zero"
        err = rel_err(outs[value], ours)
        assert err <= RTOL, f"{case}: ONNX Runtime's {blob} differs from cct's by {err:.3g}"
        # and cct's forward is Caffe's (the stored reference), so ORT equals Caffe too
        assert rel_err(outs[value], ref.arrays[f"data/{blob}"]) <= 1e-4


# -- public nets, random weights, dynamic batch ---------------------------------------------------------
def _nets() -> list:
    zoo = [  # (path, input H x W (None: as written), fc layers narrowed to 64 outputs, batches)
        ("zoo/squeezenet11_deploy.prototxt", (67, 67), (), (1, 4)),
        ("zoo/mobilenet_v2.prototxt", (64, 64), (), (1, 4)),
        ("zoo/densenet121_roundmode.prototxt", (64, 64), (), (1,)),
        ("zoo/resnet50_deploy.prototxt", None, (), (1,)),
        ("zoo/inception_v3.prototxt", (139, 139), (), (1,)),  # global pooling: any size from 139 up
        # at 32x32 VGG16's fc6 sees 1x1 (not 7x7): its weights are built for that
        ("zoo/vgg16_official_v1.prototxt", (32, 32), ("fc6", "fc7"), (1,)),
    ]
    models = [
        ("models/lenet/lenet.prototxt", None, (), (1, 4)),
        ("models/cifar10_quick/cifar10_quick.prototxt", None, (), (1, 4)),
        ("models/caffenet/deploy.prototxt", None, ("fc6", "fc7"), (1, 4)),
        ("models/alexnet/deploy.prototxt", None, ("fc6", "fc7"), (1,)),
    ]
    return zoo + models


def load_public_net(path: str, hw, narrowed) -> caffe_pb2.NetParameter:
    """A zoo/ or models/ net at input size ``hw`` (None: as written), the layers ``narrowed`` at 64 outputs."""
    full = os.path.join(ZOO, path[4:]) if path.startswith("zoo/") else os.path.join(REPO, path)
    if not os.path.exists(full):
        pytest.skip(f"{path} not present")
    param = read_net_prototxt(full)
    for layer in param.layer:
        if layer.type == "Input" and hw is not None:
            for shape in layer.input_param.shape:
                shape.dim[2], shape.dim[3] = hw
        if layer.name in narrowed:
            layer.inner_product_param.num_output = 64
    return param


@pytest.mark.parametrize("path,hw,narrowed,batches", _nets(), ids=[n[0] for n in _nets()])
def test_public_net_onnx_equals_cct(path, hw, narrowed, batches):
    param = load_public_net(path, hw, narrowed)
    cct.set_random_seed(5)
    net = cct.Net(param, cct.TEST)
    for layer in net.layers:  # finite statistics for deep random nets
        if layer.type == "BatchNorm":
            layer.blobs[0].data[...] = 0
            layer.blobs[1].data[...] = 1
            layer.blobs[2].data[...] = 1
    model = to_onnx(net, dynamic_batch=True)
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "N"
    # A random deep net's logits reach ~1e3, so its softmax turns their round-off (1e-6 relative) into
    # a visible change of the probabilities: the logits are compared to RTOL, each softmax output
    # within its 1-Lipschitz bound of the logits' difference (the Softmax layer itself is exact, see
    # the reference cases above).
    softmax_of = {net.top_names[i][0]: net.bottom_names[i][0] for i, layer in enumerate(net.layers)
                  if layer.type == "Softmax" and net.top_names[i][0] in net.output_blob_names}
    rng = np.random.default_rng(3)
    for batch in batches:
        feeds = {}
        for name in net.input_blob_names:
            shape = (batch,) + tuple(net.blobs[name].shape[1:])
            net.blobs[name].reshape(shape)
            feeds[name] = rng.standard_normal(shape).astype(np.float32)
            net.blobs[name].data[...] = feeds[name]
        net.reshape()
        net.forward()
        outs = run_ort(model, feeds, list(softmax_of.values()))
        for blob in net.output_blob_names:
            ours = net.blobs[blob].data
            assert ours.shape[0] == batch
            checked = softmax_of.get(blob, blob)
            err = rel_err(outs[checked], net.blobs[checked].data)
            assert err <= RTOL, f"{path} batch {batch}: ONNX Runtime's {checked} differs from cct's by {err:.3g}"
            if checked != blob:
                bound = np.abs(outs[checked] - net.blobs[checked].data).max() + 1e-6
                assert np.abs(outs[blob] - ours).max() <= bound, f"{path} batch {batch}: {blob}"


# -- clean errors, files and the command ----------------------------------------------------------------
def tiny_net(layers: str, phase=cct.TEST) -> cct.Net:
    """A net of ``layers`` after an Input blob ``x`` of shape (2, 3, 4, 5)."""
    text = ('name: "t" layer { name: "x" type: "Input" top: "x" '
            'input_param { shape { dim: 2 dim: 3 dim: 4 dim: 5 } } }\n')
    param = caffe_pb2.NetParameter()
    parse_text(text + layers, param)
    return cct.Net(param, phase)


def test_dropout_in_train_phase_is_refused_by_name():
    net = tiny_net('layer { name: "drop" type: "Dropout" bottom: "x" top: "y" }', cct.TRAIN)
    with pytest.raises(LayerError, match=r"layer 'drop' \(type Dropout\).*TRAIN phase"):
        to_onnx(net)


def test_fixed_batch_reshape_is_refused_with_dynamic_batch_but_exported_without():
    net = tiny_net('layer { name: "r" type: "Reshape" bottom: "x" top: "y" '
                    'reshape_param { shape { dim: 6 dim: 20 } } }')
    with pytest.raises(LayerError, match=r"layer 'r' \(type Reshape\).*batch size cannot be dynamic"):
        to_onnx(net, dynamic_batch=True)
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 5)).astype(np.float32)
    net.blobs["x"].data[...] = x
    net.forward()
    out = run_ort(to_onnx(net), {"x": x})
    np.testing.assert_array_equal(out["y"], x.reshape(6, 20))


def test_unsupported_opset_is_a_clean_error():
    net = tiny_net('layer { name: "s" type: "Sigmoid" bottom: "x" top: "y" }')
    with pytest.raises(CctError, match="opset 12 is not supported"):
        to_onnx(net, opset=12)


@pytest.mark.parametrize("opset", [13, 18, 21])
def test_other_opsets_export_reductions_and_mvn(opset):
    net = tiny_net('layer { name: "m" type: "MVN" bottom: "x" top: "m" }\n'
                    'layer { name: "r" type: "Reduction" bottom: "m" top: "r" '
                    'reduction_param { operation: ASUM axis: 1 } }')
    x = np.random.default_rng(1).standard_normal((2, 3, 4, 5)).astype(np.float32)
    net.blobs["x"].data[...] = x
    net.forward()
    model = to_onnx(net, opset=opset)
    assert model.opset_import[0].version == opset
    centred = x - x.mean(axis=(2, 3), keepdims=True)
    naive = np.abs(centred / (np.sqrt((centred ** 2).mean(axis=(2, 3), keepdims=True)) + 1e-9)).reshape(2, -1).sum(1)
    assert rel_err(run_ort(model, {"x": x})["r"], naive) <= RTOL


def test_a_refused_export_leaves_no_file(tmp_path):
    net = tiny_net('layer { name: "f" type: "Flatten" bottom: "x" top: "y" flatten_param { axis: 0 } }')
    out = tmp_path / "m.onnx"
    with pytest.raises(LayerError, match="merges the batch axis"):
        export(net, out, dynamic_batch=True)
    assert not out.exists() and not list(tmp_path.iterdir())


def test_export_onnx_command(tmp_path):
    from cct.cli import main

    net = cct.Net(os.path.join(REPO, "models/lenet/lenet.prototxt"), cct.TEST)
    weights = tmp_path / "lenet.caffemodel"
    net.save(str(weights))
    out = tmp_path / "lenet.onnx"
    assert main(["export_onnx", "--model", os.path.join(REPO, "models/lenet/lenet.prototxt"),
                 "--weights", str(weights), "--out", str(out), "--opset", "18", "--dynamic_batch"]) == 0
    model = onnx.load(str(out))
    onnx.checker.check_model(model, full_check=True)
    assert model.opset_import[0].version == 18
    x = np.random.default_rng(2).standard_normal((4, 1, 28, 28)).astype(np.float32)
    net.blobs["data"].reshape(x.shape)
    net.blobs["data"].data[...] = x
    net.reshape()
    net.forward()
    assert rel_err(run_ort(model, {"data": x}, ["ip2"])["ip2"], net.blobs["ip2"].data) <= RTOL
    # a missing weights file: a one-line error, exit status 1, nothing written
    assert main(["export_onnx", "--model", os.path.join(REPO, "models/lenet/lenet.prototxt"),
                 "--weights", str(tmp_path / "missing.caffemodel"), "--out", str(tmp_path / "x.onnx")]) == 1
    assert not (tmp_path / "x.onnx").exists()


def test_layers_without_a_reference_case_match_cct():
    """Swish, Clip, Parameter, Silence, 3-D convolution and pooling, Power with scale 0, the in-place chain."""
    net = tiny_net(
        'layer { name: "sw" type: "Swish" bottom: "x" top: "sw" swish_param { beta: 1.5 } }\n'
        'layer { name: "cl" type: "Clip" bottom: "sw" top: "cl" clip_param { min: -0.3 max: 0.4 } }\n'
        'layer { name: "p0" type: "Power" bottom: "x" top: "p0" power_param { power: 2 scale: 0 shift: 3 } }\n'
        'layer { name: "par" type: "Parameter" top: "par" parameter_param { shape { dim: 2 dim: 3 dim: 4 dim: 5 } } }\n'
        'layer { name: "sum" type: "Eltwise" bottom: "cl" bottom: "par" bottom: "p0" top: "sum" }\n'
        'layer { name: "relu" type: "ReLU" bottom: "sum" top: "sum" relu_param { negative_slope: 0.1 } }\n'
        'layer { name: "r5" type: "Reshape" bottom: "sum" top: "v" reshape_param { shape { dim: 0 dim: 1 dim: 3 '
        'dim: 4 dim: 5 } } }\n'
        'layer { name: "c3" type: "Convolution" bottom: "v" top: "c3" convolution_param { num_output: 2 '
        'kernel_size: 2 pad: 1 stride: 2 weight_filler { type: "gaussian" std: 0.3 } '
        'bias_filler { type: "gaussian" } } }\n'
        'layer { name: "sil" type: "Silence" bottom: "c3" }\n'
        'layer { name: "pool" type: "Pooling" bottom: "sum" top: "pool" pooling_param { pool: AVE kernel_size: 3 '
        'stride: 2 pad: 1 } }')
    cct.set_random_seed(0)
    net.layers[net.layer_names.index("par")].blobs[0].data[...] = np.random.default_rng(4).standard_normal((2, 3, 4, 5))
    x = np.random.default_rng(5).standard_normal((2, 3, 4, 5)).astype(np.float32)
    net.blobs["x"].data[...] = x
    net.forward()
    model = to_onnx(net)
    assert {n.op_type for n in model.graph.node} >= {"Sigmoid", "Clip", "Conv", "Sum", "LeakyRelu", "AveragePool"}
    out = run_ort(model, {"x": x}, ["c3", "p0", "cl"])
    naive_swish = x / (1 + np.exp(-1.5 * x))
    assert rel_err(out["cl"], np.clip(naive_swish, -0.3, 0.4)) <= RTOL
    np.testing.assert_array_equal(out["p0"], np.full_like(x, 9.0))
    for blob in ("pool", "c3"):
        assert rel_err(out[blob], net.blobs[blob].data) <= RTOL, blob


@pytest.mark.parametrize("kind", ["LSTM", "RNN"])
@pytest.mark.parametrize("static,expose", [(False, False), (True, True)])
def test_recurrent_layers_unrolled_match_cct(kind, static, expose):
    """LSTM/RNN with a continuation that restarts a sequence mid-way, a static input, exposed states."""
    states = ["h_0", "c_0"] if kind == "LSTM" else ["h_0"]
    extra_tops = (["xs"] if static else []) + (states if expose else [])
    extra_shapes = (["shape { dim: 3 dim: 5 }"] if static else []) + \
        (["shape { dim: 1 dim: 3 dim: 6 }"] * len(states) if expose else [])
    inputs = ('layer { name: "in" type: "Input" top: "x" top: "cont"' + "".join(f' top: "{t}"' for t in extra_tops) +
              ' input_param { shape { dim: 4 dim: 3 dim: 2 dim: 3 } shape { dim: 4 dim: 3 } ' +
              " ".join(extra_shapes) + " } }\n")
    bottoms = ' bottom: "x" bottom: "cont"' + (' bottom: "xs"' if static else "") + \
        ("".join(f' bottom: "{s}"' for s in states) if expose else "")
    tops = ' top: "y"' + ("".join(f' top: "{s}_T"' for s in "hc"[:len(states)]) if expose else "")
    layer = (f'layer {{ name: "rec" type: "{kind}"{bottoms}{tops} recurrent_param {{ num_output: 6 '
             f'expose_hidden: {"true" if expose else "false"} weight_filler {{ type: "gaussian" std: 0.4 }} '
             f'bias_filler {{ type: "gaussian" std: 0.2 }} }} }}')
    param = caffe_pb2.NetParameter()
    parse_text('name: "rec"\n' + inputs + layer, param)
    cct.set_random_seed(1)
    net = cct.Net(param, cct.TEST)
    rng = np.random.default_rng(6)
    feeds = {}
    for name in net.input_blob_names:
        shape = net.blobs[name].shape
        feeds[name] = (np.array([[0, 0, 0], [1, 1, 0], [1, 0, 1], [1, 1, 1]], np.float32) if name == "cont"
                       else rng.standard_normal(shape).astype(np.float32))
        net.blobs[name].data[...] = feeds[name]
    net.forward()
    model = to_onnx(net, dynamic_batch=False)
    out = run_ort(model, feeds)
    assert sorted(out) == sorted(net.output_blob_names)
    for blob in net.output_blob_names:
        assert rel_err(out[blob], net.blobs[blob].data) <= RTOL, blob


@pytest.mark.parametrize("pool,height", [("MAX", 1), ("AVE", 3), ("MAX", 3)])
def test_spp_matches_cct(pool, height):
    """SPP levels with per-level padding (9x7 input: 4x4 bins need kernel 3, pad 2 / kernel 2, pad 1)."""
    param = caffe_pb2.NetParameter()
    parse_text('name: "spp" layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 dim: 9 '
               f'dim: 7 }} }} }}\nlayer {{ name: "spp" type: "SPP" bottom: "x" top: "y" spp_param {{ pool: {pool} '
               f'pyramid_height: {height} }} }}', param)
    net = cct.Net(param, cct.TEST)
    x = np.random.default_rng(8).standard_normal((2, 3, 9, 7)).astype(np.float32)
    net.blobs["x"].data[...] = x
    net.forward()
    out = run_ort(to_onnx(net, dynamic_batch=True), {"x": x})["y"]
    assert out.shape == net.blobs["y"].data.shape
    assert rel_err(out, net.blobs["y"].data) <= RTOL


@pytest.mark.skipif(not reference_available(), reason="../shared/reference not present")
@pytest.mark.parametrize("opset", [13, onnx.defs.onnx_opset_version()])
def test_oldest_and_newest_opsets_on_reference_cases(opset, monkeypatch):
    """The ops whose form changed across opsets (Split, Reduce*, Softmax, TopK, Pad, Unsqueeze, Gather)."""
    for case in ("slice_axis1_points_1_3", "softmax_axis2", "argmax_top2", "reduction_mean_axis2", "mvn",
                 "pool_ave_ceil_6x6k3s2p1", "lstm_t3_n2", "embed"):
        ref = load_case(case)
        monkeypatch.chdir(case_dir(case))
        net = cct.Net(ref.net, cct.TRAIN, weights=ref.meta.get("weights_file", "weights.caffemodel"))
        feeds = {b: ref.arrays[f"input/{b}"] for b in net.input_blob_names}
        for b, v in feeds.items():
            net.blobs[b].data[...] = v
        net.forward()
        model = to_onnx(net, opset=opset)
        assert model.opset_import[0].version == opset
        outs = run_ort(model, feeds)
        for blob, value in zip(net.output_blob_names, [o.name for o in model.graph.output]):
            assert rel_err(outs[value], net.blobs[blob].data) <= RTOL, f"{case} at opset {opset}: {blob}"


def test_mvn_of_a_two_axis_blob():
    """MVN over (N, C): each channel's 'plane' is one value, so Caffe gives 0 (not a mean over all axes)."""
    param = caffe_pb2.NetParameter()
    parse_text('name: "m" layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }\n'
               'layer { name: "mvn" type: "MVN" bottom: "x" top: "y" }', param)
    net = cct.Net(param, cct.TEST)
    x = np.random.default_rng(9).standard_normal((2, 3)).astype(np.float32)
    net.blobs["x"].data[...] = x
    net.forward()
    for opset in (17, 18):
        np.testing.assert_array_equal(run_ort(to_onnx(net, opset=opset), {"x": x})["y"], net.blobs["y"].data)


def test_batchnorm_and_scale_folded_into_one_node():
    layers = ""
    for k, (bottom, bias) in enumerate((("x", "true"), ("c0", "false"))):
        layers += (f'layer {{ name: "conv{k}" type: "Convolution" bottom: "{bottom}" top: "c{k}" convolution_param {{ '
                   f'num_output: 4 kernel_size: 3 pad: 1 weight_filler {{ type: "gaussian" std: 0.3 }} }} }}\n'
                   f'layer {{ name: "bn{k}" type: "BatchNorm" bottom: "c{k}" top: "c{k}" }}\n'
                   f'layer {{ name: "sc{k}" type: "Scale" bottom: "c{k}" top: "c{k}" scale_param {{ bias_term: {bias} '
                   f'filler {{ type: "uniform" min: 0.5 max: 1.5 }} bias_filler {{ type: "gaussian" }} }} }}\n')
    cct.set_random_seed(2)
    net = tiny_net(layers)
    for layer in net.layers:
        if layer.type == "BatchNorm":
            layer.blobs[0].data[...] = np.linspace(-1, 1, 4, dtype=np.float32)
            layer.blobs[1].data[...] = np.linspace(0.5, 2, 4, dtype=np.float32)
            layer.blobs[2].data[...] = 2  # the normaliser is applied too
    model = to_onnx(net, fold_batchnorm=True)
    ops = [n.op_type for n in model.graph.node if "/" not in n.name]  # (not bn*/mean, bn*/var: the 1/2 factor)
    assert ops.count("BatchNormalization") == 2 and "Mul" not in ops and "Add" not in ops  # Scales folded in
    assert sum(n.op_type == "Reciprocal" for n in model.graph.node) == 2
    x = np.random.default_rng(10).standard_normal((2, 3, 4, 5)).astype(np.float32)
    net.blobs["x"].data[...] = x
    net.forward()
    assert rel_err(run_ort(model, {"x": x})["c1"], net.blobs["c1"].data) <= RTOL
    assert rel_err(run_ort(to_onnx(net), {"x": x})["c1"], net.blobs["c1"].data) <= RTOL  # and not folded
