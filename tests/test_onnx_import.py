"""ONNX import (cct.onnx.import_onnx, ``cct import_onnx``): round trips and PyTorch-style graphs.

* export -> import of the reference unit cases and of public nets: the imported net has the same layers
  (type, effective parameters) with weights bit for bit, and cct's forward on it equals the original's (and
  ONNX Runtime's); the exporter's multi-node forms (MVN, ArgMax, Reduction, Embed, Crop, Threshold, Swish,
  two-bottom Scale/Bias, BatchNorm with a moving-average factor, the recorded Exp/Log/Flatten/LRN/SPP)
  come back as the one layer they were; the unrolled LSTM/RNN/LSTMUnit are refused by name.
* Hand-built graphs in the patterns PyTorch's exporter writes (Pad before Conv, Gemm with transB 0/1,
  BatchNormalization with an affine part, broadcast Mul/Add constants, ceil-mode MaxPool, ...): the
  imported net's cct forward equals ONNX Runtime's on the same input.
* Plain-ONNX forms of those layers (ArgMax, Reduce*, Gather, Greater + Cast, Slice, SiLU, SE gates).
* Ops with no exact BVLC layer are errors naming the node and op; nothing is written then.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from refcase import case_dir, load_case, reference_available
from test_onnx_export import REFUSED_CASES, REPO, RTOL, UNIT_CASES, load_public_net, rel_err, run_ort, tiny_net

import cct
from cct.io.caffemodel import read_caffemodel
from cct.io.prototxt import parse_text, read_net_prototxt
from cct.proto import caffe_pb2

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from cct.onnx import OnnxImportError, from_onnx, import_onnx, to_onnx  # noqa: E402

# exportable cases whose ONNX form uses ops without a BVLC layer of their own (the exporter's
# decompositions): the importer must name the op it cannot map
NOT_IMPORTABLE = {"lstm_t3_n2": "LSTM", "rnn_t3_n2": "RNN", "lstmunit": "LSTMUnit"}  # unrolled: refused


def imported_net(model) -> tuple[cct.Net, caffe_pb2.NetParameter]:
    net_param, weights = from_onnx(model)
    net = cct.Net(net_param, cct.TEST)
    net.copy_from(weights)
    return net, net_param


def forward(net: cct.Net, feeds: dict) -> None:
    for name, value in feeds.items():
        net.blobs[name].reshape(value.shape)
        net.blobs[name].data[...] = value
    net.reshape()
    net.forward()


def assert_same_weights(original: cct.Net, imported: cct.Net, skip=()) -> int:
    """Every parameter blob of ``original`` is in the layer of the same name of ``imported``, bit for bit."""
    compared = 0
    for layer in original.layers:
        if not layer.blobs or layer.name in skip:
            continue
        assert layer.name in imported.layer_names, f"layer {layer.name} lost in the round trip"
        twin = imported.layers[imported.layer_names.index(layer.name)]
        assert len(twin.blobs) == len(layer.blobs)
        for a, b in zip(layer.blobs, twin.blobs):
            assert a.shape == b.shape and a.data.tobytes() == b.data.tobytes(), f"{layer.name}: weights differ"
            compared += 1
    return compared


# layer types whose parameters must come back with the same effective values (the exporter's multi-node forms)
PARAMS_COMPARED = {"MVN": "mvn_param", "ArgMax": "argmax_param", "Reduction": "reduction_param",
                   "Embed": "embed_param", "Crop": "crop_param", "Threshold": "threshold_param",
                   "Scale": "scale_param", "Bias": "bias_param", "BatchNorm": "batch_norm_param",
                   "Exp": "exp_param", "Log": "log_param", "Flatten": "flatten_param", "Swish": "swish_param",
                   "LRN": "lrn_param", "SPP": "spp_param"}


def effective_params(net: cct.Net, lp: caffe_pb2.LayerParameter) -> dict:
    """The effective value of every field of ``lp``'s own parameter message (defaults filled in, axes made
    non-negative, Crop's offsets one per cropped axis, fillers left out): what the layer computes with."""
    msg = getattr(lp, PARAMS_COMPARED[lp.type])
    rank = len(net.blobs[lp.bottom[0]].shape)
    out = {}
    for field in msg.DESCRIPTOR.fields:
        if field.message_type is not None:  # fillers: how a blob starts, not what the layer computes
            continue
        value = getattr(msg, field.name)
        if not isinstance(value, (int, float, str)):  # a repeated field
            value = list(value)
        if field.name == "axis" and (lp.type != "ArgMax" or msg.HasField("axis")):
            value %= rank
        out[field.name] = value
    if lp.type == "Crop":
        out["offset"] = [out["offset"][0] if len(out["offset"]) == 1 else out["offset"][i] if out["offset"] else 0
                         for i in range(rank - out["axis"])]
    if lp.type == "ArgMax" and not msg.HasField("axis"):
        out["axis"] = None
    return out


@pytest.mark.skipif(not reference_available(), reason="../shared/reference not present")
@pytest.mark.parametrize("case", [c for c in UNIT_CASES if c not in REFUSED_CASES])
def test_reference_case_round_trip(case, monkeypatch):
    ref = load_case(case)
    monkeypatch.chdir(case_dir(case))
    phase = caffe_pb2.TRAIN if ref.meta["phase"] == "TRAIN" else caffe_pb2.TEST
    net = cct.Net(ref.net, phase, weights=ref.meta.get("weights_file", "weights.caffemodel"))
    feeds = {b: ref.arrays[f"input/{b}"] for b in net.input_blob_names}
    forward(net, feeds)
    model = to_onnx(net)
    if case in NOT_IMPORTABLE:
        with pytest.raises(OnnxImportError, match=rf"ONNX node '.*' \(op \w+\): .*part of an unrolled "
                                                  rf"{NOT_IMPORTABLE[case]} layer '\w+'"):
            from_onnx(model)
        return
    back, param = imported_net(model)
    forward(back, feeds)
    graph_outputs = [o.name for o in model.graph.output]
    ort_out = run_ort(model, feeds)
    for blob, value in zip(net.output_blob_names, graph_outputs):
        assert rel_err(back.blobs[value].data, net.blobs[blob].data) <= 1e-6, f"{case}: {blob}"
        assert rel_err(back.blobs[value].data, ort_out[value]) <= RTOL, f"{case}: {blob} vs ONNX Runtime"
    if case == "batchnorm_global_stats":  # the moving-average factor is not 1: the raw blobs come back
        assert net.layers[-1].blobs[2].data[0] not in (0, 1)
    assert_same_weights(net, back)
    for lp in ref.net.layer:
        if lp.type in PARAMS_COMPARED:
            twin = next(t for t in param.layer if t.name == lp.name)
            assert twin.type == lp.type and len(twin.bottom) == len(lp.bottom), f"{case}: layer {lp.name}"
            assert effective_params(back, twin) == effective_params(net, lp), f"{case}: {lp.name}'s parameters"
    # layer for layer: the same types in the same order (a TEST-phase Dropout, an identity, comes back as the
    # Split that copies the graph output it feeds)
    assert [{"Dropout": "Split"}.get(lp.type, lp.type) for lp in ref.net.layer] == [lp.type for lp in param.layer]


@pytest.mark.parametrize("path,hw,narrowed", [
    ("zoo/squeezenet11_deploy.prototxt", (67, 67), ()),
    ("zoo/mobilenet_v2.prototxt", (64, 64), ()),
    ("zoo/fcn8s_deploy.prototxt", (32, 32), ("conv", "fc")),  # Crop (Deconvolution outputs cut to a blob)
    ("models/lenet/lenet.prototxt", None, ()),
    ("models/caffenet/deploy.prototxt", None, ("fc6", "fc7")),
])
def test_public_net_round_trip(path, hw, narrowed):
    param = load_public_net(path, hw, narrowed if "fc6" in narrowed else ())
    for lp in param.layer:  # FCN-8s: the VGG convolutions 8 wide (its 4096-wide fc6 alone is 400 MB)
        if lp.type == "Convolution" and lp.name.startswith(tuple(n for n in narrowed if n != "fc6")):
            lp.convolution_param.num_output = 8
    cct.set_random_seed(7)
    net = cct.Net(param, cct.TEST)
    rng = np.random.default_rng(1)
    for layer in net.layers:
        if layer.type == "BatchNorm":  # trained statistics: the moving-average factor is not 1
            layer.blobs[0].data[...] = np.linspace(-1, 1, layer.blobs[0].count, dtype=np.float32)
            layer.blobs[1].data[...] = np.linspace(0.5, 2, layer.blobs[1].count, dtype=np.float32)
            layer.blobs[2].data[...] = 0.9
        elif layer.blobs and not np.any(layer.blobs[0].data):  # a deploy net without fillers: random weights
            for b in layer.blobs:
                b.data[...] = rng.standard_normal(b.shape).astype(np.float32) * 0.3
    model = to_onnx(net, dynamic_batch=True)
    back, _ = imported_net(model)
    assert assert_same_weights(net, back) == sum(len(layer.blobs) for layer in net.layers)
    feeds = {n: rng.standard_normal((2,) + tuple(net.blobs[n].shape[1:])).astype(np.float32)
             for n in net.input_blob_names}
    forward(net, feeds)
    forward(back, feeds)
    for blob in net.output_blob_names:
        assert np.abs(net.blobs[blob].data).max() > 0
        np.testing.assert_array_equal(back.blobs[blob].data, net.blobs[blob].data)


# -- graphs as PyTorch exports them -----------------------------------------------------------------------
def _const(name: str, array) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array, dtype=np.float32 if np.asarray(array).dtype.kind == "f"
                                              else np.int64), name)


def _model(nodes, inits, in_shape, out_shape, opset=17):
    graph = helper.make_graph(nodes, "torchlike", [helper.make_tensor_value_info("x", TensorProto.FLOAT, in_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def test_pytorch_style_graph_imports_and_matches_onnx_runtime():
    rng = np.random.default_rng(0)
    w1, b1 = rng.standard_normal((4, 3, 3, 3)), rng.standard_normal(4)
    gamma, beta = rng.uniform(0.5, 2, 4), rng.standard_normal(4)
    mean, var = rng.standard_normal(4), rng.uniform(0.5, 2, 4)
    s, t = rng.standard_normal((4, 1, 1)), rng.standard_normal((4, 1, 1))
    wfc, bfc = rng.standard_normal((5, 4 * 7 * 7)), rng.standard_normal(5)
    wfc2 = rng.standard_normal((5, 6))
    nodes = [
        helper.make_node("Pad", ["x", "pads"], ["xp"], name="pad1", mode="constant"),
        helper.make_node("Conv", ["xp", "w1", "b1"], ["c1"], name="conv1", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "gamma", "beta", "mean", "var"], ["bn"], name="bn1",
                         epsilon=1e-5),
        helper.make_node("Mul", ["bn", "s"], ["sc"], name="scale1"),
        helper.make_node("Add", ["sc", "t"], ["sb"], name="scale1_bias"),
        helper.make_node("LeakyRelu", ["sb"], ["r"], name="relu1", alpha=0.2),
        helper.make_node("MaxPool", ["r"], ["p"], name="pool1", kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1),
        helper.make_node("AveragePool", ["p"], ["a"], name="pool2", kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                         count_include_pad=1),
        helper.make_node("Add", ["a", "p"], ["res"], name="residual"),
        helper.make_node("Flatten", ["res"], ["f"], name="flat", axis=1),
        helper.make_node("Gemm", ["f", "wfc", "bfc"], ["g"], name="fc1", transB=1),
        helper.make_node("Gemm", ["g", "wfc2"], ["g2"], name="fc2"),
        helper.make_node("Softmax", ["g2"], ["y"], name="prob", axis=1),
    ]
    inits = [_const("pads", np.array([0, 0, 1, 1, 0, 0, 1, 1])), _const("w1", w1), _const("b1", b1),
             _const("gamma", gamma), _const("beta", beta), _const("mean", mean), _const("var", var),
             _const("s", s), _const("t", t), _const("wfc", wfc), _const("bfc", bfc),
             _const("wfc2", wfc2)]  # fc2: Gemm with transB 0 (W stored K x N) -> InnerProduct transpose: true
    model = _model(nodes, inits, [2, 3, 12, 12], [2, 6])
    net, param = imported_net(model)
    types = [lp.type for lp in param.layer]
    assert types == ["Input", "Convolution", "BatchNorm", "Scale", "Scale", "ReLU", "Pooling", "Pooling", "Eltwise",
                     "InnerProduct", "InnerProduct", "Softmax"]
    conv = param.layer[1].convolution_param
    assert (conv.pad_h, conv.pad_w) == (2, 2)  # Pad folded into the Conv's own padding
    assert param.layer[10].inner_product_param.transpose
    x = rng.standard_normal((2, 3, 12, 12)).astype(np.float32)
    forward(net, {"x": x})
    ours = run_ort(model, {"x": x}, ["g2", "p"])
    assert rel_err(net.blobs["p"].data, ours["p"]) <= RTOL  # ceil-mode MaxPool: the same 6x6 windows
    assert rel_err(net.blobs["g2"].data, ours["g2"]) <= RTOL
    assert rel_err(net.blobs["y"].data, ours["y"]) <= RTOL
    weights = {lp.name: lp for lp in net.to_proto().layer}
    assert np.asarray(weights["fc1"].blobs[0].data, np.float32).tobytes() == wfc.astype(np.float32).tobytes()


@pytest.mark.parametrize("nodes,inits,out_shape,match", [
    ([helper.make_node("Transpose", ["x"], ["y"], name="tr", perm=[0, 1, 3, 2])], [], [1, 3, 8, 8],
     r"ONNX node 'tr' \(op Transpose\): no BVLC Caffe layer"),
    ([helper.make_node("Conv", ["x", "w"], ["y"], name="c", kernel_shape=[3, 3], pads=[0, 0, 1, 1])],
     [_const("w", np.ones((2, 3, 3, 3)))], [1, 2, 7, 7], r"ONNX node 'c' \(op Conv\): asymmetric pads"),
    ([helper.make_node("AveragePool", ["x"], ["y"], name="ap", kernel_shape=[3, 3], pads=[1, 1, 1, 1])], [],
     [1, 3, 8, 8],
     r"ONNX node 'ap' \(op AveragePool\): .*no exact Caffe AVE divisor"),
    ([helper.make_node("Div", ["x", "k"], ["y"], name="d")], [_const("k", np.float32(3))], [1, 3, 8, 8],
     r"ONNX node 'd' \(op Div\)"),
])
def test_unmappable_ops_are_named(nodes, inits, out_shape, match, tmp_path):
    model = _model(nodes, inits, [1, 3, 8, 8], out_shape)
    with pytest.raises(OnnxImportError, match=match):
        from_onnx(model)
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    with pytest.raises(OnnxImportError):
        import_onnx(path, tmp_path / "m.prototxt", tmp_path / "m.caffemodel")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_import_onnx_command(tmp_path):
    from cct.cli import main

    lenet = os.path.join(REPO, "models/lenet/lenet.prototxt")
    net = cct.Net(lenet, cct.TEST)
    cct.onnx.export(net, tmp_path / "lenet.onnx")
    assert main(["import_onnx", str(tmp_path / "lenet.onnx"), "--out_model", str(tmp_path / "l.prototxt"),
                 "--out_weights", str(tmp_path / "l.caffemodel")]) == 0
    back = cct.Net(str(tmp_path / "l.prototxt"), cct.TEST, weights=str(tmp_path / "l.caffemodel"))
    assert [lp.type for lp in read_net_prototxt(str(tmp_path / "l.prototxt")).layer] == \
        [lp.type for lp in read_net_prototxt(lenet).layer]
    assert {lp.name for lp in read_caffemodel(str(tmp_path / "l.caffemodel")).layer} >= {"conv1", "conv2", "ip1",
                                                                                             "ip2"}
    assert assert_same_weights(net, back) == 8
    (tmp_path / "junk.onnx").write_bytes(b"not an onnx model")
    assert main(["import_onnx", str(tmp_path / "junk.onnx"), "--out_model", str(tmp_path / "j.prototxt"),
                 "--out_weights", str(tmp_path / "j.caffemodel")]) == 1
    assert not (tmp_path / "j.prototxt").exists() and not (tmp_path / "j.caffemodel").exists()


def test_constant_power_round_trips_as_a_constant():
    net = tiny_net('layer { name: "p0" type: "Power" bottom: "x" top: "p0" '
                    'power_param { power: 2 scale: 0 shift: 3 } }')
    model = to_onnx(net)
    back, param = imported_net(model)
    assert [lp.type for lp in param.layer] == ["Input", "Power"]
    x = np.full((2, 3, 4, 5), np.nan, np.float32)  # Caffe writes the constant whatever x holds
    forward(back, {"x": x})
    np.testing.assert_array_equal(back.blobs["p0"].data, np.full_like(x, 9.0))
    np.testing.assert_array_equal(run_ort(model, {"x": x})["p0"], np.full_like(x, 9.0))


@pytest.mark.parametrize("ctm,nearest,factors,exact", [
    ("asymmetric", "floor", (2, 2), True),            # PyTorch's nn.Upsample(scale_factor=2)
    ("half_pixel", "round_prefer_floor", (3, 2), True),  # ONNX's defaults
    ("asymmetric", "round_prefer_floor", (3, 3), False),  # source 2/3 rounds up to pixel 1
    ("asymmetric", "round_prefer_floor", (2, 1), True),  # 1/2 ties to the floor: still a copy
    ("align_corners", "round_prefer_floor", (2, 2), False),
])
def test_nearest_resize_imports_as_deconvolution_only_when_exact(ctm, nearest, factors, exact):
    nodes = [helper.make_node("Resize", ["x", "", "scales"], ["y"], name="up", mode="nearest",
                              coordinate_transformation_mode=ctm, nearest_mode=nearest)]
    model = _model(nodes, [_const("scales", np.array([1, 1, *factors], np.float32))], [2, 3, 4, 5],
                   [2, 3, 4 * factors[0], 5 * factors[1]])
    if not exact:
        with pytest.raises(OnnxImportError, match=r"ONNX node 'up' \(op Resize\).*does not copy each pixel"):
            from_onnx(model)
        return
    net, param = imported_net(model)
    assert [lp.type for lp in param.layer] == ["Input", "Deconvolution"]
    x = np.random.default_rng(2).standard_normal((2, 3, 4, 5)).astype(np.float32)
    forward(net, {"x": x})
    expected = x.repeat(factors[0], axis=2).repeat(factors[1], axis=3)
    np.testing.assert_array_equal(run_ort(model, {"x": x})["y"], expected)
    np.testing.assert_array_equal(net.blobs["y"].data, expected)


def test_subtracting_constants_imports_as_bias_and_power():
    mean = np.random.default_rng(3).standard_normal((3, 1, 1))
    nodes = [helper.make_node("Sub", ["x", "mean"], ["c"], name="center"),
             helper.make_node("Sub", ["c", "half"], ["y"], name="shift")]
    model = _model(nodes, [_const("mean", mean), _const("half", np.float32(0.5))], [2, 3, 4, 5], [2, 3, 4, 5])
    net, param = imported_net(model)
    assert [lp.type for lp in param.layer] == ["Input", "Bias", "Power"]
    x = np.random.default_rng(4).standard_normal((2, 3, 4, 5)).astype(np.float32)
    forward(net, {"x": x})
    np.testing.assert_array_equal(net.blobs["y"].data, run_ort(model, {"x": x})["y"])


# -- the exporter's multi-node forms and their plain-ONNX equivalents ----------------------------------------
def _round_trip(net: cct.Net, feeds: dict, **export_args) -> tuple[cct.Net, caffe_pb2.NetParameter]:
    """Export ``net``, import it back: cct's forward on the import equals the original's bit for bit and ONNX
    Runtime's to RTOL; every parameter blob comes back bit for bit."""
    model = to_onnx(net, **export_args)
    back, param = imported_net(model)
    forward(net, feeds)
    forward(back, feeds)
    ort_out = run_ort(model, feeds)
    for blob in net.output_blob_names:
        np.testing.assert_array_equal(back.blobs[blob].data, net.blobs[blob].data)
        assert rel_err(ort_out[blob], net.blobs[blob].data) <= RTOL
    return back, param


@pytest.mark.parametrize("factor", [0.37, 0.0])
@pytest.mark.parametrize("fold", [False, True])
def test_batchnorm_moving_average_factor_round_trips_bit_identical(factor, fold):
    net = tiny_net('layer { name: "bn" type: "BatchNorm" bottom: "x" top: "b" }\n'
                   'layer { name: "sc" type: "Scale" bottom: "b" top: "y" scale_param { bias_term: true '
                   'filler { type: "uniform" min: 0.5 max: 1.5 } bias_filler { type: "gaussian" } } }')
    bn = net.layers[1]
    bn.blobs[0].data[...] = np.linspace(-1, 1, 3, dtype=np.float32)
    bn.blobs[1].data[...] = np.linspace(0.5, 2, 3, dtype=np.float32)
    bn.blobs[2].data[...] = factor
    x = np.random.default_rng(5).standard_normal((2, 3, 4, 5)).astype(np.float32)
    back, param = _round_trip(net, {"x": x}, fold_batchnorm=fold)
    twin = back.layers[back.layer_names.index("bn")]
    for a, b in zip(bn.blobs, twin.blobs):  # the raw running sums and the factor, not mean / factor
        assert a.data.tobytes() == b.data.tobytes()
    if not fold:
        assert [lp.type for lp in param.layer] == ["Input", "BatchNorm", "Scale"]
        assert_same_weights(net, back)


@pytest.mark.parametrize("opset", [13, 17])
def test_crop_keeps_its_reference_blob_and_a_dynamic_batch(opset):
    text = ('name: "c" layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 3 dim: 4 dim: 9 dim: 8 } } }'
            'layer { name: "r" type: "Input" top: "r" input_param { shape { dim: 2 dim: 3 dim: 5 dim: 6 } } }'
            'layer { name: "crop0" type: "Crop" bottom: "x" bottom: "r" top: "c0" '
            'crop_param { axis: 0 offset: 0 offset: 1 offset: 2 offset: 1 } }'
            'layer { name: "crop2" type: "Crop" bottom: "x" bottom: "r" top: "c2" crop_param { offset: 2 offset: 1 } }'
            'layer { name: "pool" type: "Pooling" bottom: "c2" top: "p" pooling_param { pool: MAX kernel_size: 2 '
            'stride: 2 } }')
    param = caffe_pb2.NetParameter()
    parse_text(text, param)
    net = cct.Net(param, cct.TEST)
    rng = np.random.default_rng(6)
    feeds = {"x": rng.standard_normal((3, 4, 9, 8)).astype(np.float32),
             "r": rng.standard_normal((2, 3, 5, 6)).astype(np.float32)}
    back, imported = _round_trip(net, feeds, opset=opset, dynamic_batch=True)
    crops = [lp for lp in imported.layer if lp.type == "Crop"]
    assert [list(lp.bottom) for lp in crops] == [["x", "r"], ["x", "r"]]
    assert [effective_params(back, lp) for lp in crops] == \
        [{"axis": 0, "offset": [0, 1, 2, 1]}, {"axis": 2, "offset": [2, 1]}]
    np.testing.assert_array_equal(back.blobs["c0"].data, feeds["x"][0:2, 1:4, 2:7, 1:7])


def test_plain_onnx_forms_of_argmax_reduction_embed_threshold():
    rng = np.random.default_rng(8)
    table, bias = rng.standard_normal((10, 4)), rng.standard_normal(4)
    nodes = [
        helper.make_node("ArgMax", ["x"], ["am"], name="argmax", axis=1, keepdims=1, select_last_index=1),
        helper.make_node("Cast", ["am"], ["amf"], name="amf", to=TensorProto.FLOAT),
        helper.make_node("ArgMax", ["x"], ["am2"], name="argmax2", axis=3, keepdims=0, select_last_index=1),
        helper.make_node("Cast", ["am2"], ["am2f"], name="am2f", to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["x", "axes"], ["rs"], name="rsum", keepdims=1),
        helper.make_node("ReduceL1", ["x"], ["rl"], name="rl1", axes=[1, 2, 3], keepdims=0),
        helper.make_node("Mul", ["rl", "half"], ["rlc"], name="rl1_coeff"),
        helper.make_node("Greater", ["x", "t"], ["gt"], name="thr"),
        helper.make_node("Cast", ["gt"], ["th"], name="thr_cast", to=TensorProto.FLOAT),
        helper.make_node("Abs", ["x"], ["ax"], name="abs"),
        helper.make_node("Cast", ["ax"], ["idx"], name="emb", to=TensorProto.INT64),
        helper.make_node("Gather", ["table", "idx"], ["g"], name="gather", axis=0),
        helper.make_node("Add", ["g", "bias"], ["emb_out"], name="emb_bias"),
        helper.make_node("Sigmoid", ["x"], ["sig"], name="silu"),  # PyTorch's SiLU
        helper.make_node("Mul", ["sig", "x"], ["silu_out"], name="silu_mul"),
    ]
    outs = {"amf": [2, 1, 4, 5], "am2f": [2, 3, 4], "rs": [2, 3, 1, 1], "rlc": [2], "th": [2, 3, 4, 5],
            "emb_out": [2, 3, 4, 5, 4], "silu_out": [2, 3, 4, 5]}
    graph = helper.make_graph(nodes, "plain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4, 5])],
                              [helper.make_tensor_value_info(k, TensorProto.FLOAT, v) for k, v in outs.items()],
                              [_const("axes", np.array([2, 3])), _const("half", np.float32(0.5)),
                               _const("t", np.float32(0.25)), _const("table", table), _const("bias", bias)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    net, param = imported_net(model)
    types = {lp.name: lp.type for lp in param.layer}
    assert [types[n] for n in ("argmax", "argmax2", "rsum", "rl1", "thr", "emb", "silu")] == \
        ["ArgMax", "ArgMax", "Reduction", "Reduction", "Threshold", "Embed", "Swish"]
    assert param.layer[[lp.name for lp in param.layer].index("rl1")].reduction_param.coeff == 0.5
    x = rng.integers(0, 10, (2, 3, 4, 5)).astype(np.float32)  # ties on both ArgMax axes; valid table rows
    forward(net, {"x": x})
    ours = run_ort(model, {"x": x})
    for name in outs:
        np.testing.assert_allclose(net.blobs[name].data, ours[name], rtol=RTOL, atol=0, err_msg=name)
    # Caffe's ArgMax picks the last of equal maxima, as select_last_index 1
    expected = x.shape[1] - 1 - np.argmax(x[:, ::-1], axis=1)
    np.testing.assert_array_equal(net.blobs["amf"].data[:, 0], expected)


@pytest.mark.parametrize("nodes,inits,out_shape,match", [
    ([helper.make_node("ArgMax", ["x"], ["a"], name="am", axis=1),
      helper.make_node("Cast", ["a"], ["y"], name="c", to=TensorProto.FLOAT)], [], [1, 1, 8, 8],
     r"ONNX node 'am' \(op ArgMax\): select_last_index 0 picks the first of equal maxima"),
    ([helper.make_node("ReduceMean", ["x"], ["y"], name="rm", axes=[1, 2], keepdims=1)], [], [1, 1, 1, 8],
     r"ONNX node 'rm' \(op ReduceMean\): reduces axes \[1, 2\]"),
    ([helper.make_node("Slice", ["x", "s", "e", "a", "st"], ["y"], name="sl")],
     [_const("s", np.array([1])), _const("e", np.array([8])), _const("a", np.array([2])), _const("st", np.array([2]))],
     [1, 3, 4, 8], r"ONNX node 'sl' \(op Slice\): steps \[2\]"),
    ([helper.make_node("Greater", ["x", "k"], ["g"], name="gt"),
      helper.make_node("Not", ["g"], ["n"], name="not"),
      helper.make_node("Cast", ["n"], ["y"], name="c", to=TensorProto.FLOAT)], [_const("k", np.float32(0))],
     [1, 3, 8, 8], r"ONNX node 'gt' \(op Greater\)"),
])
def test_unmappable_forms_of_the_new_ops_are_named(nodes, inits, out_shape, match):
    with pytest.raises(OnnxImportError, match=match):
        from_onnx(_model(nodes, inits, [1, 3, 8, 8], out_shape))


@pytest.mark.parametrize("gate_first", [False, True])
def test_squeeze_excitation_gate_imports_as_two_bottom_scale(gate_first):
    rng = np.random.default_rng(11)
    w, b = rng.standard_normal((3, 3, 1, 1)), rng.standard_normal(3)
    nodes = [helper.make_node("GlobalAveragePool", ["x"], ["gap"], name="squeeze"),
             helper.make_node("Conv", ["gap", "w", "b"], ["z"], name="excite", kernel_shape=[1, 1]),
             helper.make_node("Sigmoid", ["z"], ["gate"], name="gate"),
             helper.make_node("Mul", ["gate", "x"] if gate_first else ["x", "gate"], ["y"], name="se"),
             helper.make_node("Add", ["y", "bias_blob"], ["y2"], name="shift"),
             helper.make_node("ReduceMean", ["x"], ["bias_blob"], name="chan_mean", axes=[2, 3], keepdims=1)]
    nodes = nodes[:4] + [nodes[5], nodes[4]]
    graph = helper.make_graph(nodes, "se", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 4, 5])],
                              [helper.make_tensor_value_info("y2", TensorProto.FLOAT, ["N", 3, 4, 5])],
                              [_const("w", w), _const("b", b)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    net, param = imported_net(model)
    by_name = {lp.name: lp for lp in param.layer}
    assert by_name["se"].type == "Scale" and by_name["se"].scale_param.axis == 0
    assert by_name["shift"].type == "Bias" and by_name["shift"].bias_param.axis == 0
    x = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    forward(net, {"x": x})
    assert rel_err(net.blobs["y2"].data, run_ort(model, {"x": x})["y2"]) <= RTOL
    # a blob broadcast in the middle (1 on the channel axis, full spatial axes) has no Caffe Scale
    bad = _model([helper.make_node("Conv", ["x", "wc"], ["m"], name="rows", kernel_shape=[8, 1]),  # (1, 3, 1, 8)
                  helper.make_node("Mul", ["x", "m"], ["y"], name="mid")],
                 [_const("wc", rng.standard_normal((3, 3, 8, 1)))], [1, 3, 8, 8], [1, 3, 8, 8])
    with pytest.raises(OnnxImportError, match=r"ONNX node 'mid' \(op Mul\): a blob of shape \[1, 3, 1, 8\]"):
        from_onnx(bad)


@pytest.mark.parametrize("dynamic", [False, True])
def test_two_bottom_scale_and_bias_round_trip(dynamic):
    # (with a dynamic batch every input's axis 0 is the batch: the operands then span it, at axis 0)
    second, axis, bias = ("dim: 2 dim: 3", 0, "false") if dynamic else ("dim: 3 dim: 4", 1, "true")
    text = ('name: "s" layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 dim: 4 dim: 5 } } }'
            f'layer {{ name: "g" type: "Input" top: "g" input_param {{ shape {{ {second} }} }} }}'
            'layer { name: "h" type: "Input" top: "h" input_param { shape { dim: 2 dim: 3 dim: 4 } } }'
            f'layer {{ name: "sc" type: "Scale" bottom: "x" bottom: "g" top: "y" scale_param {{ axis: {axis} '
            f'bias_term: {bias} bias_filler {{ type: "gaussian" }} }} }}'
            'layer { name: "b" type: "Bias" bottom: "y" bottom: "h" top: "z" bias_param { axis: 0 } }')
    param = caffe_pb2.NetParameter()
    parse_text(text, param)
    cct.set_random_seed(4)
    net = cct.Net(param, cct.TEST)
    rng = np.random.default_rng(12)
    feeds = {n: rng.standard_normal(net.blobs[n].shape).astype(np.float32) for n in ("x", "g", "h")}
    back, imported = _round_trip(net, feeds, dynamic_batch=dynamic)
    assert [(lp.type, list(lp.bottom)) for lp in imported.layer[3:]] == [("Scale", ["x", "g"]), ("Bias", ["y", "h"])]
    for lp in param.layer[3:]:
        twin = imported.layer[[t.name for t in imported.layer].index(lp.name)]
        assert effective_params(back, twin) == effective_params(net, lp)
    assert_same_weights(net, back)


def test_slice_of_constant_bounds_imports_as_caffe_slices():
    nodes = [helper.make_node("Slice", ["x", "s", "e", "a"], ["y"], name="sl")]
    # x[:, 1:3, :, 2:-1] (ends past the size and negative: ONNX's clamping), axes given out of order
    inits = [_const("s", np.array([2, 1, 0])), _const("e", np.array([-1, 3, 2 ** 62])),
             _const("a", np.array([3, 1, 2]))]
    model = _model(nodes, inits, [2, 4, 5, 6], [2, 2, 5, 3])
    net, param = imported_net(model)
    assert [lp.type for lp in param.layer] == ["Input", "Slice", "Slice", "Silence"]
    x = np.random.default_rng(13).standard_normal((2, 4, 5, 6)).astype(np.float32)
    forward(net, {"x": x})
    np.testing.assert_array_equal(net.blobs["y"].data, x[:, 1:3, :, 2:-1])
    np.testing.assert_array_equal(run_ort(model, {"x": x})["y"], x[:, 1:3, :, 2:-1])


def test_parameter_swish_clip_round_trip_layer_for_layer():
    net = tiny_net('layer { name: "p" type: "Parameter" top: "p" parameter_param { shape { dim: 2 dim: 3 } } }\n'
                   'layer { name: "sw" type: "Swish" bottom: "x" top: "s" swish_param { beta: 1.5 } }\n'
                   'layer { name: "sw1" type: "Swish" bottom: "s" top: "s1" }\n'
                   'layer { name: "clip" type: "Clip" bottom: "s1" top: "c" clip_param { min: -0.5 max: 0.75 } }')
    net.layers[1].blobs[0].data[...] = np.random.default_rng(14).standard_normal((2, 3)).astype(np.float32)
    x = np.random.default_rng(15).standard_normal((2, 3, 4, 5)).astype(np.float32)
    back, param = _round_trip(net, {"x": x})
    assert [(lp.name, lp.type) for lp in param.layer] == [("x", "Input"), ("p", "Parameter"), ("sw", "Swish"),
                                                         ("sw1", "Swish"), ("clip", "Clip")]
    assert param.layer[2].swish_param.beta == 1.5 and not param.layer[3].HasField("swish_param")
    assert list(param.layer[1].parameter_param.shape.dim) == [2, 3]
    assert (param.layer[4].clip_param.min, param.layer[4].clip_param.max) == (-0.5, 0.75)
    assert assert_same_weights(net, back) == 1
    np.testing.assert_array_equal(back.blobs["p"].data, net.layers[1].blobs[0].data)


def test_recorded_exp_layer_is_taken_only_where_its_parameters_give_the_nodes():
    net = tiny_net('layer { name: "e" type: "Exp" bottom: "x" top: "e" exp_param { base: 2 scale: 0.5 shift: 0.1 } }')
    model = to_onnx(net)
    assert [lp.type for lp in from_onnx(model)[0].layer] == ["Input", "Exp"]
    head = next(n for n in model.graph.node if n.doc_string)
    head.doc_string = head.doc_string.replace("base: 2", "base: 3")  # a record the constants contradict
    net_param = from_onnx(model)[0]
    assert [lp.type for lp in net_param.layer] == ["Input", "Power", "Exp", "Power"]  # the nodes, one by one
    back = cct.Net(net_param, cct.TEST)
    x = np.random.default_rng(16).standard_normal((2, 3, 4, 5)).astype(np.float32)
    forward(back, {"x": x})
    forward(net, {"x": x})
    assert rel_err(back.blobs["e"].data, net.blobs["e"].data) <= RTOL


def test_recorded_layer_that_cannot_be_built_is_not_trusted():
    net = tiny_net('layer { name: "lrn" type: "LRN" bottom: "x" top: "y" lrn_param { local_size: 3 alpha: 0.3 '
                   'norm_region: WITHIN_CHANNEL } }')
    model = to_onnx(net)
    assert [lp.type for lp in from_onnx(model)[0].layer] == ["Input", "LRN"]
    head = next(n for n in model.graph.node if n.doc_string)
    head.doc_string = head.doc_string.replace("local_size: 3", "local_size: 4")  # even: Caffe refuses it
    assert "LRN" not in [lp.type for lp in from_onnx(model)[0].layer]
    head.doc_string = "cct layer: this is not prototxt {"
    assert "LRN" not in [lp.type for lp in from_onnx(model)[0].layer]


@pytest.mark.parametrize("opset", [13, 18])
def test_reduce_forms_round_trip_at_the_oldest_and_newer_opsets(opset):
    # Reduce* take their axes as an attribute before opset 18 (ReduceSum from 13) and as an input from 18
    net = tiny_net('layer { name: "mvn" type: "MVN" bottom: "x" top: "m" mvn_param { across_channels: true } }\n'
                   'layer { name: "red" type: "Reduction" bottom: "m" top: "r" reduction_param { operation: MEAN '
                   'axis: 2 coeff: 3 } }\n'
                   'layer { name: "sq" type: "Reduction" bottom: "x" top: "q" reduction_param { operation: SUMSQ '
                   'axis: 1 } }\n'
                   'layer { name: "am" type: "ArgMax" bottom: "r" top: "a" argmax_param { top_k: 2 } }')
    x = np.random.default_rng(17).standard_normal((2, 3, 4, 5)).astype(np.float32)
    back, param = _round_trip(net, {"x": x}, opset=opset)
    assert [lp.type for lp in param.layer] == ["Input", "MVN", "Reduction", "Reduction", "ArgMax"]
    original = {lp.name: lp for lp in net.to_proto().layer}
    for twin in param.layer[1:]:
        assert effective_params(back, twin) == effective_params(net, original[twin.name]), twin.name
