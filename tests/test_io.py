"""Caffe file formats: legacy upgrades (V0, V1, input fields, data transformation, BatchNorm, solver_type),
.caffemodel, HDF5 weights and solver state, binaryproto, prototxt errors."""
from __future__ import annotations

import logging
import os

import h5py
import numpy as np
import pytest

from cct.errors import CctError, ProtoParseError
from cct.io import (
    array_to_blobproto,
    blobproto_to_array,
    parse_text,
    read_binaryproto,
    read_net_prototxt,
    read_solver_prototxt,
    write_binaryproto,
)
from cct.io.caffemodel import (
    legacy_shape_equals,
    read_caffemodel,
    read_weights,
    weights_from_net_param,
    write_caffemodel,
)
from cct.io.hdf5 import read_hdf5_solverstate, read_hdf5_weights, write_hdf5_solverstate, write_hdf5_weights
from cct.io.upgrade import V1_TYPE_NAMES, net_needs_upgrade, upgrade_net, upgrade_solver
from cct.paths import shared_path
from cct.proto import caffe_pb2

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data")
LENET_WEIGHTS = str(shared_path("reference", "lenet", "weights.caffemodel"))


def net_from_text(text: str) -> caffe_pb2.NetParameter:
    return parse_text(text, caffe_pb2.NetParameter(), source="test.prototxt")


def summary(net: caffe_pb2.NetParameter):
    return [(l.name, l.type, list(l.bottom), list(l.top)) for l in net.layer]


def params(layer):
    return [(p.name, p.lr_mult, p.decay_mult) for p in layer.param]


# ---------------------------------------------------------------------------------------------
# V1 prototxt
# ---------------------------------------------------------------------------------------------
def test_v1_deploy_with_input_dims_upgrades(caplog):
    with caplog.at_level(logging.INFO, logger="cct"):
        net = read_net_prototxt(os.path.join(DATA, "lenet_v1_deploy.prototxt"))
    assert not net.layers and not net.input and not net.input_dim and not net.input_shape
    assert summary(net) == [
        ("input", "Input", [], ["data"]),
        ("conv1", "Convolution", ["data"], ["conv1"]),
        ("pool1", "Pooling", ["conv1"], ["pool1"]),
        ("conv2", "Convolution", ["pool1"], ["conv2"]),
        ("pool2", "Pooling", ["conv2"], ["pool2"]),
        ("ip1", "InnerProduct", ["pool2"], ["ip1"]),
        ("relu1", "ReLU", ["ip1"], ["ip1"]),
        ("ip2", "InnerProduct", ["ip1"], ["ip2"]),
        ("prob", "Softmax", ["ip2"], ["prob"]),
    ]
    assert [list(s.dim) for s in net.layer[0].input_param.shape] == [[64, 1, 28, 28]]
    conv1 = net.layer[1]
    assert params(conv1) == [("", 1.0, 1.0), ("", 2.0, 1.0)]
    assert not conv1.param[0].HasField("decay_mult")  # only what V1 said is set
    assert conv1.convolution_param.num_output == 20
    assert list(conv1.convolution_param.kernel_size) == [5]
    assert conv1.convolution_param.weight_filler.type == "xavier"
    assert net.layer[2].pooling_param.pool == caffe_pb2.PoolingParameter.MAX
    assert net.layer[5].inner_product_param.num_output == 500
    assert not net_needs_upgrade(net)
    text = caplog.text
    assert "V1LayerParameter" in text and "input fields" in text and "lenet_v1_deploy.prototxt" in text


def test_v1_train_test_upgrades_data_params_rules_and_param_specs():
    net = read_net_prototxt(os.path.join(DATA, "lenet_v1_train_test.prototxt"))
    assert [l.type for l in net.layer] == ["Data", "Data", "Convolution", "Pooling", "InnerProduct", "Accuracy",
                                           "SoftmaxWithLoss"]
    train, test = net.layer[0], net.layer[1]
    assert [r.phase for r in train.include] == [caffe_pb2.TRAIN]
    assert [r.phase for r in test.include] == [caffe_pb2.TEST]
    # transformation fields moved out of data_param
    for layer in (train, test):
        for f in ("scale", "mean_file", "crop_size", "mirror"):
            assert not layer.data_param.HasField(f)
        assert layer.transform_param.scale == pytest.approx(0.00390625)
        assert layer.data_param.backend == caffe_pb2.DataParameter.LMDB
    assert train.transform_param.HasField("mirror") and not train.transform_param.mirror
    assert test.transform_param.crop_size == 24 and test.transform_param.mean_file == "mean.binaryproto"
    assert train.data_param.batch_size == 64 and test.data_param.batch_size == 100
    conv1 = net.layer[2]
    assert params(conv1) == [("conv1_w", 1.0, 1.0), ("conv1_b", 2.0, 0.0)]
    assert conv1.param[0].share_mode == caffe_pb2.ParamSpec.PERMISSIVE
    assert not conv1.param[1].HasField("share_mode")
    loss = net.layer[6]
    assert list(loss.loss_weight) == [1.0]
    assert [list(r.stage) for r in loss.exclude] == [["deploy"]]


def test_v1_every_layer_type_maps_to_a_registered_name():
    for value in caffe_pb2.V1LayerParameter.LayerType.values():
        assert value in V1_TYPE_NAMES
    assert V1_TYPE_NAMES[caffe_pb2.V1LayerParameter.SOFTMAX_LOSS] == "SoftmaxWithLoss"
    assert V1_TYPE_NAMES[caffe_pb2.V1LayerParameter.DECONVOLUTION] == "Deconvolution"


def test_v1_carries_every_sub_message():
    v1 = caffe_pb2.NetParameter()
    l = v1.layers.add(name="x", type=caffe_pb2.V1LayerParameter.ELTWISE)
    l.eltwise_param.operation = caffe_pb2.EltwiseParameter.MAX
    l.loss_param.ignore_label = 3
    l.transform_param.mean_value.append(4.0)
    l.threshold_param.threshold = 0.25
    l.dummy_data_param.num.append(2)
    upgrade_net(v1)
    out = v1.layer[0]
    assert out.eltwise_param.operation == caffe_pb2.EltwiseParameter.MAX
    assert out.loss_param.ignore_label == 3
    assert list(out.transform_param.mean_value) == [4.0]
    assert out.threshold_param.threshold == 0.25
    assert list(out.dummy_data_param.num) == [2]


def test_v1_weight_decay_longer_than_blobs_lr_and_names_only():
    net = net_from_text("""
      layers { name: "ip" type: INNER_PRODUCT bottom: "x" top: "y"
               weight_decay: 0.5 weight_decay: 0 param: "w" param: "b" param: "c" }""")
    upgrade_net(net)
    assert params(net.layer[0]) == [("w", 1.0, 0.5), ("b", 1.0, 0.0), ("c", 1.0, 1.0)]


def test_mixed_layer_and_layers_is_an_error():
    net = net_from_text('layer { name: "a" type: "ReLU" } layers { name: "b" type: RELU }')
    with pytest.raises(ProtoParseError, match="mixes"):
        upgrade_net(net, source="mixed.prototxt")


# ---------------------------------------------------------------------------------------------
# V0 prototxt
# ---------------------------------------------------------------------------------------------
def test_v0_upgrades_with_padding_folded_into_conv(caplog):
    with caplog.at_level(logging.INFO, logger="cct"):
        net = read_net_prototxt(os.path.join(DATA, "caffenet_v0.prototxt"))
    assert summary(net) == [
        ("data", "Data", [], ["data", "label"]),
        ("conv1", "Convolution", ["data"], ["conv1"]),
        ("relu1", "ReLU", ["conv1"], ["conv1"]),
        ("pool1", "Pooling", ["conv1"], ["pool1"]),
        ("norm1", "LRN", ["pool1"], ["norm1"]),
        ("conv2", "Convolution", ["norm1"], ["conv2"]),  # pad2 folded away, bottom rewired
        ("fc8", "InnerProduct", ["conv2"], ["fc8"]),
        ("drop8", "Dropout", ["fc8"], ["fc8"]),
        ("loss", "SoftmaxWithLoss", ["fc8", "label"], []),
    ]
    data = net.layer[0]
    assert data.data_param.source.endswith("train-leveldb") and data.data_param.batch_size == 256
    assert data.transform_param.crop_size == 227 and data.transform_param.mirror
    assert data.transform_param.mean_file.endswith("image_mean.binaryproto")
    assert data.transform_param.scale == 1.0
    conv1, conv2 = net.layer[1], net.layer[5]
    cp = conv1.convolution_param
    assert (cp.num_output, list(cp.kernel_size), list(cp.stride), list(cp.pad)) == (96, [11], [4], [])
    assert cp.weight_filler.type == "gaussian" and cp.weight_filler.std == pytest.approx(0.01)
    assert params(conv1) == [("", 1.0, 1.0), ("", 2.0, 0.0)]
    cp2 = conv2.convolution_param
    assert (cp2.num_output, cp2.group, list(cp2.pad), list(cp2.kernel_size)) == (256, 2, [2], [5])
    assert cp2.bias_filler.value == 1.0
    pp = net.layer[3].pooling_param
    assert (pp.pool, pp.kernel_size, pp.stride) == (caffe_pb2.PoolingParameter.MAX, 3, 2)
    lrn = net.layer[4].lrn_param
    assert (lrn.local_size, lrn.alpha, lrn.beta) == (5, pytest.approx(1e-4), 0.75)
    assert net.layer[7].dropout_param.dropout_ratio == 0.5
    assert "padding layer 'pad2'" in caplog.text and "V0LayerParameter" in caplog.text


def test_v0_padding_into_pool_and_net_inputs():
    net = net_from_text("""
      input: "data" input_dim: 1 input_dim: 3 input_dim: 8 input_dim: 8
      layers { layer { name: "pad" type: "padding" pad: 1 } bottom: "data" top: "padded" }
      layers { layer { name: "pool" type: "pool" pool: AVE kernelsize: 3 stride: 1 } bottom: "padded" top: "p" }
      layers { layer { name: "cat" type: "concat" concat_dim: 1 } bottom: "p" bottom: "data" top: "c" }""")
    upgrade_net(net, source="v0.prototxt")
    assert summary(net) == [("input", "Input", [], ["data"]), ("pool", "Pooling", ["data"], ["p"]),
                            ("cat", "Concat", ["p", "data"], ["c"])]
    pp = net.layer[1].pooling_param
    assert (pp.pool, pp.pad, pp.kernel_size, pp.stride) == (caffe_pb2.PoolingParameter.AVE, 1, 3, 1)
    assert net.layer[2].concat_param.concat_dim == 1


def test_v0_errors_name_source_and_layer():
    bad_type = net_from_text('layers { layer { name: "weird" type: "warp" } top: "x" }')
    with pytest.raises(ProtoParseError, match=r"v0\.prototxt: layer 'weird': unknown V0 layer type 'warp'"):
        upgrade_net(bad_type, source="v0.prototxt")
    pad_into_relu = net_from_text("""
      input: "d" input_dim: 1 input_dim: 1 input_dim: 1 input_dim: 1
      layers { layer { name: "pad" type: "padding" pad: 1 } bottom: "d" top: "p" }
      layers { layer { name: "r" type: "relu" } bottom: "p" top: "r" }""")
    with pytest.raises(ProtoParseError, match=r"layer 'r'.*padding layer 'pad'"):
        upgrade_net(pad_into_relu, source="v0.prototxt")
    unknown_bottom = net_from_text('layers { layer { name: "r" type: "relu" } bottom: "nope" top: "r" }')
    with pytest.raises(ProtoParseError, match=r"layer 'r'.*'nope'"):
        upgrade_net(unknown_bottom, source="v0.prototxt")


def test_v0_field_of_wrong_layer_type_is_reported(caplog):
    net = net_from_text('layers { layer { name: "r" type: "relu" num_output: 3 } top: "r" }')
    with caplog.at_level(logging.WARNING, logger="cct"):
        upgrade_net(net, source="v0.prototxt")
    assert net.layer[0].type == "ReLU"
    assert "layer 'r'" in caplog.text and "num_output" in caplog.text


# ---------------------------------------------------------------------------------------------
# input fields, BatchNorm, data fields of current layers
# ---------------------------------------------------------------------------------------------
def test_input_shape_upgrade_puts_input_layer_first():
    net = net_from_text("""
      input: "a" input_shape { dim: 2 dim: 3 } input: "b" input_shape { dim: 2 }
      layer { name: "e" type: "Eltwise" bottom: "a" bottom: "a" top: "s" }""")
    upgrade_net(net)
    assert summary(net)[0] == ("input", "Input", [], ["a", "b"])
    assert [list(s.dim) for s in net.layer[0].input_param.shape] == [[2, 3], [2]]
    assert net.layer[1].name == "e"


def test_input_without_shape_is_just_dropped():
    # what legacy .caffemodel files hold
    net = net_from_text('input: "data" layer { name: "r" type: "ReLU" bottom: "data" top: "r" }')
    upgrade_net(net)
    assert not net.input and summary(net) == [("r", "ReLU", ["data"], ["r"])]


@pytest.mark.parametrize("text, match", [
    ('input: "a" input_dim: 1 input_dim: 2', "input_dim"),
    ('input: "a" input: "b" input_shape { dim: 1 }', "input_shape"),
    ('input: "a" input_shape { dim: 1 } input_dim: 1 input_dim: 1 input_dim: 1 input_dim: 1', "not both"),
])
def test_bad_input_fields_raise(text, match):
    with pytest.raises(ProtoParseError, match=match):
        upgrade_net(net_from_text(text), source="in.prototxt")


def test_batchnorm_with_three_param_specs_gets_zero_lr_and_decay(caplog):
    net = net_from_text("""
      layer { name: "bn" type: "BatchNorm" bottom: "x" top: "x"
              param { lr_mult: 1 decay_mult: 1 name: "m" } param { lr_mult: 1 } param { lr_mult: 0 } }
      layer { name: "bn2" type: "BatchNorm" bottom: "x" top: "x" param { lr_mult: 0 } }
      layer { name: "conv" type: "Convolution" param { lr_mult: 1 } param { lr_mult: 2 } param { lr_mult: 3 } }""")
    with caplog.at_level(logging.INFO, logger="cct"):
        upgrade_net(net, source="bn.prototxt")
    assert params(net.layer[0]) == [("m", 0.0, 0.0), ("", 0.0, 0.0), ("", 0.0, 0.0)]
    assert params(net.layer[1]) == [("", 0.0, 1.0)]  # not 3 specs: left to the layer's own check
    assert params(net.layer[2]) == [("", 1.0, 1.0), ("", 2.0, 1.0), ("", 3.0, 1.0)]
    assert "layer 'bn'" in caplog.text


def test_current_data_layer_with_legacy_transform_fields_warns(caplog):
    net = net_from_text('layer { name: "d" type: "Data" top: "x" data_param { scale: 0.5 } }')
    with caplog.at_level(logging.WARNING, logger="cct"):
        upgrade_net(net, source="d.prototxt")
    assert net.layer[0].data_param.scale == 0.5 and not net.layer[0].HasField("transform_param")
    assert "layer 'd'" in caplog.text and "data_param.scale" in caplog.text


def test_current_net_is_unchanged():
    path = str(shared_path("caffe-models", "mnist", "lenet_train_test.prototxt"))
    if not os.path.exists(path):
        pytest.skip("shared caffe-models not available")
    from cct.io import read_text_file

    raw = read_text_file(path, caffe_pb2.NetParameter())
    assert read_net_prototxt(path) == raw


# ---------------------------------------------------------------------------------------------
# solver
# ---------------------------------------------------------------------------------------------
def test_solver_type_enum_upgrade(tmp_path):
    s = read_solver_prototxt(os.path.join(DATA, "lenet_solver_v1.prototxt"))
    assert s.type == "Nesterov" and not s.HasField("solver_type")
    assert s.snapshot_prefix == os.path.join(DATA, "lenet_solver_v1")
    names = {"SGD": "SGD", "NESTEROV": "Nesterov", "ADAGRAD": "AdaGrad", "RMSPROP": "RMSProp",
             "ADADELTA": "AdaDelta", "ADAM": "Adam"}
    for enum, name in names.items():
        s = parse_text(f"solver_type: {enum}", caffe_pb2.SolverParameter())
        assert upgrade_solver(s).type == name
    untouched = upgrade_solver(parse_text('type: "Adam"', caffe_pb2.SolverParameter()))
    assert untouched.type == "Adam" and not untouched.HasField("snapshot_prefix")


def test_solver_type_and_solver_type_both_set_is_an_error():
    s = parse_text('solver_type: ADAM type: "Adam"', caffe_pb2.SolverParameter())
    with pytest.raises(ProtoParseError, match=r"s\.prototxt.*solver_type.*type"):
        upgrade_solver(s, source="s.prototxt")


def test_solver_snapshot_prefix_directory(tmp_path):
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    f = tmp_path / "my_solver.prototxt"
    f.write_text(f'base_lr: 0.1 snapshot_prefix: "{snaps}"')
    assert read_solver_prototxt(f).snapshot_prefix == os.path.join(str(snaps), "my_solver")
    f.write_text('base_lr: 0.1 snapshot_prefix: "lenet"')
    assert read_solver_prototxt(f).snapshot_prefix == "lenet"


# ---------------------------------------------------------------------------------------------
# .caffemodel
# ---------------------------------------------------------------------------------------------
def make_v1_caffemodel() -> caffe_pb2.NetParameter:
    """An old V1 caffemodel: `layers` with enum types, legacy 4-D blob dims, inputs without shape."""
    rng = np.random.default_rng(0)
    net = caffe_pb2.NetParameter(name="old")
    net.input.append("data")
    conv = net.layers.add(name="conv1", type=caffe_pb2.V1LayerParameter.CONVOLUTION, bottom=["data"], top=["c"])
    conv.blobs_lr.extend([1, 2])
    conv.convolution_param.num_output = 4
    conv.blobs.append(array_to_blobproto(rng.standard_normal((4, 3, 2, 2)), legacy_4d=True))
    conv.blobs.append(array_to_blobproto(rng.standard_normal(4), legacy_4d=True))  # (1, 1, 1, 4)
    net.layers.add(name="relu", type=caffe_pb2.V1LayerParameter.RELU, bottom=["c"], top=["c"])
    ip = net.layers.add(name="ip", type=caffe_pb2.V1LayerParameter.INNER_PRODUCT, bottom=["c"], top=["y"])
    ip.blobs.append(array_to_blobproto(rng.standard_normal((5, 16)), legacy_4d=True))  # (1, 1, 5, 16)
    return net


def test_v1_caffemodel_reads_upgraded(tmp_path):
    src = make_v1_caffemodel()
    path = tmp_path / "old.caffemodel"
    write_caffemodel(path, src)
    net = read_caffemodel(path)
    assert summary(net) == [("conv1", "Convolution", ["data"], ["c"]), ("relu", "ReLU", ["c"], ["c"]),
                            ("ip", "InnerProduct", ["c"], ["y"])]
    assert params(net.layer[0]) == [("", 1.0, 1.0), ("", 2.0, 1.0)]
    w = read_weights(path)
    assert list(w) == ["conv1", "relu", "ip"]
    assert [a.shape for a in w["conv1"]] == [(4, 3, 2, 2), (1, 1, 1, 4)]
    assert w["relu"] == []
    assert w["ip"][0].shape == (1, 1, 5, 16) and w["ip"][0].dtype == np.float32
    np.testing.assert_array_equal(w["conv1"][0], blobproto_to_array(src.layers[0].blobs[0]))
    assert legacy_shape_equals(w["conv1"][1].shape, (4,))
    assert legacy_shape_equals(w["ip"][0].shape, (5, 16))
    assert not legacy_shape_equals(w["ip"][0].shape, (16, 5))
    assert not legacy_shape_equals((1, 2, 3, 4, 5), (2, 3, 4, 5))


def test_caffemodel_round_trip_is_byte_identical(tmp_path):
    rng = np.random.default_rng(1)
    net = caffe_pb2.NetParameter(name="n")
    l = net.layer.add(name="ip", type="InnerProduct", bottom=["x"], top=["y"])
    l.inner_product_param.num_output = 3
    l.blobs.append(array_to_blobproto(rng.standard_normal((3, 7))))
    l.blobs.append(array_to_blobproto(rng.standard_normal(3), diff=rng.standard_normal(3)))
    net.layer.add(name="r", type="ReLU", bottom=["y"], top=["y"])
    path = tmp_path / "n.caffemodel"
    write_caffemodel(path, net)
    raw = path.read_bytes()
    assert raw == net.SerializeToString()
    back = read_caffemodel(path)
    assert back == net
    assert back.SerializeToString() == raw
    write_caffemodel(path, back)
    assert path.read_bytes() == raw
    assert [f for f in os.listdir(tmp_path) if f.startswith(".tmp")] == []
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask  # as a plain open() would create it


def test_array_to_blobproto_matches_field_by_field_construction():
    rng = np.random.default_rng(2)
    a, d = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 4))
    expected = caffe_pb2.BlobProto()
    expected.shape.dim.extend([2, 3, 4])
    expected.data.extend(a.astype(np.float32).ravel().tolist())
    expected.diff.extend(d.astype(np.float32).ravel().tolist())
    assert array_to_blobproto(a, d) == expected
    expected.ClearField("diff")
    assert array_to_blobproto(a).SerializeToString() == expected.SerializeToString()
    empty = caffe_pb2.BlobProto()
    empty.shape.dim.append(0)
    assert array_to_blobproto(np.zeros((0,))) == empty


def test_reference_lenet_weights():
    if not os.path.exists(LENET_WEIGHTS):
        pytest.skip("shared reference weights not available")
    w = read_weights(LENET_WEIGHTS)
    assert list(w) == ["mnist", "conv1", "pool1", "conv2", "pool2", "ip1", "relu1", "ip2", "loss"]
    shapes = {k: [a.shape for a in v] for k, v in w.items() if v}
    assert shapes == {"conv1": [(20, 1, 5, 5), (20,)], "conv2": [(50, 20, 5, 5), (50,)],
                      "ip1": [(500, 800), (500,)], "ip2": [(10, 500), (10,)]}
    assert all(a.dtype == np.float32 for v in w.values() for a in v)
    npz = os.path.join(os.path.dirname(LENET_WEIGHTS), "arrays.npz")
    ref = np.load(npz)
    if "param/conv1/0" in ref.files:
        np.testing.assert_array_equal(w["conv1"][0], ref["param/conv1/0"])
    # Caffe's own file round-trips byte for byte through our parser/serializer.
    raw = open(LENET_WEIGHTS, "rb").read()
    assert read_caffemodel(LENET_WEIGHTS).SerializeToString() == raw


def test_caffemodel_errors(tmp_path):
    missing = tmp_path / "nope.caffemodel"
    with pytest.raises(CctError, match="nope.caffemodel"):
        read_caffemodel(missing)
    with pytest.raises(CctError, match="nope.caffemodel"):
        read_weights(missing)
    garbage = tmp_path / "garbage.caffemodel"
    garbage.write_bytes(b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff")
    with pytest.raises(ProtoParseError, match="garbage.caffemodel"):
        read_caffemodel(garbage)
    text = tmp_path / "net.caffemodel"
    text.write_bytes(b'name: "LeNet"\nlayer { name: "x" }\n')
    with pytest.raises(ProtoParseError, match="net.caffemodel"):
        read_caffemodel(text)
    bad_count = caffe_pb2.NetParameter()
    b = bad_count.layer.add(name="ip").blobs.add()
    b.shape.dim.extend([2, 2])
    b.data.extend([1.0, 2.0, 3.0])
    write_caffemodel(tmp_path / "bad.caffemodel", bad_count)
    with pytest.raises(CctError, match=r"bad\.caffemodel.*layer 'ip'"):
        read_weights(tmp_path / "bad.caffemodel")


def test_caffemodel_larger_than_64mb(tmp_path):
    big = np.arange(17_000_000, dtype=np.float32)  # 68 MB of floats
    net = caffe_pb2.NetParameter(name="big")
    net.layer.add(name="ip", type="InnerProduct").blobs.append(array_to_blobproto(big.reshape(1000, 17000)))
    path = tmp_path / "big.caffemodel"
    write_caffemodel(path, net)
    del net
    assert os.path.getsize(path) > 64 * 1024 * 1024
    w = weights_from_net_param(read_caffemodel(path))
    assert w["ip"][0].shape == (1000, 17000)
    assert w["ip"][0][-1, -1] == 16_999_999.0 and w["ip"][0][0, 5] == 5.0


def test_read_weights_dispatches_on_extension(tmp_path):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    for ext in (".h5", ".hdf5", ".H5"):
        p = tmp_path / f"w{ext}"
        write_hdf5_weights(p, [("ip", [a])])
        np.testing.assert_array_equal(read_weights(p)["ip"][0], a)


# ---------------------------------------------------------------------------------------------
# HDF5 weights and solver state
# ---------------------------------------------------------------------------------------------
def test_hdf5_weights_layout_and_round_trip(tmp_path):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((4, 3, 2, 2)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    w2 = rng.standard_normal((5, 4)).astype(np.float64)  # written as float32, as Caffe's float net
    layers = [("data", []), ("conv1", [w, b]), ("relu1", []), ("inception/1x1", [w2]), ("shared", [None, b])]
    diffs = [(n, [np.full(np.shape(a if a is not None else b), 0.5) for a in arrs]) for n, arrs in layers]
    path = tmp_path / "w.caffemodel.h5"
    write_hdf5_weights(path, layers, diffs)
    with h5py.File(path, "r") as f:
        assert set(f) == {"data", "diff"}
        assert set(f["data"]) == {"data", "conv1", "relu1", "inception", "shared"}
        assert list(f["data/conv1"]) == ["0", "1"] and len(f["data/relu1"]) == 0
        assert f["data/conv1/0"].dtype == np.float32 and f["data/conv1/0"].shape == (4, 3, 2, 2)
        assert f["data/inception/1x1/0"].dtype == np.float32
        assert list(f["data/shared"]) == ["1"] and list(f["diff/shared"]) == ["0", "1"]
    got = read_hdf5_weights(path)
    assert list(got) == sorted(got)  # HDF5 name order, as Caffe's reader iterates
    assert set(got) == {"data", "conv1", "relu1", "inception/1x1", "shared"}
    np.testing.assert_array_equal(got["conv1"][0], w)
    np.testing.assert_array_equal(got["conv1"][1], b)
    np.testing.assert_array_equal(got["inception/1x1"][0], w2.astype(np.float32))
    assert got["relu1"] == [] and got["data"] == []
    assert got["shared"][0] is None
    np.testing.assert_array_equal(got["shared"][1], b)
    d = read_hdf5_weights(path, diff=True)
    assert d["shared"][0].shape == (4,) and np.all(d["conv1"][0] == 0.5)
    assert [f for f in os.listdir(tmp_path) if f.startswith(".tmp")] == []


def test_hdf5_weights_without_diff_and_errors(tmp_path):
    path = tmp_path / "w.h5"
    write_hdf5_weights(path, [("ip", [np.ones((2, 2))])])
    with h5py.File(path, "r") as f:
        assert list(f) == ["data"]
    with pytest.raises(ProtoParseError, match="diff"):
        read_hdf5_weights(path, diff=True)
    with pytest.raises(CctError, match="missing.h5"):
        read_hdf5_weights(tmp_path / "missing.h5")
    not_h5 = tmp_path / "not.h5"
    not_h5.write_bytes(b"hello")
    with pytest.raises(ProtoParseError, match="not.h5"):
        read_hdf5_weights(not_h5)


def test_hdf5_weights_written_by_h5py_like_caffe(tmp_path):
    # A file laid out as Caffe's Net::ToHDF5 writes it, created independently of our writer.
    path = tmp_path / "caffe.h5"
    with h5py.File(path, "w") as f:
        g = f.create_group("data")
        g.create_group("conv1").create_dataset("0", data=np.ones((2, 1, 3, 3), np.float32))
        g["conv1"].create_dataset("1", data=np.zeros(2, np.float32))
        g.create_group("pool1")
    got = read_weights(path)
    assert list(got) == ["conv1", "pool1"]
    assert [a.shape for a in got["conv1"]] == [(2, 1, 3, 3), (2,)]


def test_hdf5_solverstate_layout_and_round_trip(tmp_path):
    rng = np.random.default_rng(4)
    history = [rng.standard_normal((3, 2)).astype(np.float32), np.zeros(3, np.float32)]
    path = tmp_path / "lenet_iter_100.solverstate.h5"
    write_hdf5_solverstate(path, 100, "lenet_iter_100.caffemodel.h5", 2, history)
    with h5py.File(path, "r") as f:
        assert set(f) == {"iter", "learned_net", "current_step", "history"}
        assert f["iter"].shape == () and f["iter"].dtype == np.int32 and f["iter"][()] == 100
        assert f["current_step"].shape == () and f["current_step"][()] == 2
        tid = f["learned_net"].id.get_type()
        assert f["learned_net"].shape == ()
        assert tid.get_size() == len("lenet_iter_100.caffemodel.h5") + 1
        assert tid.get_strpad() == h5py.h5t.STR_NULLTERM and not tid.is_variable_str()
        assert list(f["history"]) == ["0", "1"] and f["history/0"].dtype == np.float32
    st = read_hdf5_solverstate(path)
    assert st["iter"] == 100 and st["current_step"] == 2
    assert st["learned_net"] == "lenet_iter_100.caffemodel.h5"
    assert len(st["history"]) == 2
    np.testing.assert_array_equal(st["history"][0], history[0])
    assert [f for f in os.listdir(tmp_path) if f.startswith(".tmp")] == []


def test_hdf5_solverstate_read_variants_and_errors(tmp_path):
    path = tmp_path / "s.h5"
    with h5py.File(path, "w") as f:  # variable-length string, as another writer might store it
        f["iter"] = np.int32(7)
        f["current_step"] = np.int32(0)
        f["learned_net"] = "w.caffemodel"
        f.create_group("history")
    st = read_hdf5_solverstate(path)
    assert (st["iter"], st["learned_net"], st["history"]) == (7, "w.caffemodel", [])
    with h5py.File(path, "a") as f:
        del f["history"]
    with pytest.raises(ProtoParseError, match=r"s\.h5.*history"):
        read_hdf5_solverstate(path)


# ---------------------------------------------------------------------------------------------
# prototxt errors, binaryproto
# ---------------------------------------------------------------------------------------------
def test_prototxt_syntax_error_names_file_line_column(tmp_path):
    path = tmp_path / "broken.prototxt"
    path.write_text('name: "x"\nlayer {\n  name: "a"\n  tpye: "ReLU"\n}\n')
    with pytest.raises(ProtoParseError) as e:
        read_net_prototxt(path)
    assert f"{path}:4:" in str(e.value) and "tpye" in str(e.value)
    path.write_text('layer {\n  name: "a"\n')
    with pytest.raises(ProtoParseError, match=r"broken\.prototxt:\d+:\d+"):
        read_net_prototxt(path)


def test_missing_prototxt_names_path(tmp_path):
    with pytest.raises(CctError, match="no_such_net.prototxt"):
        read_net_prototxt(tmp_path / "no_such_net.prototxt")
    with pytest.raises(CctError, match="no_such_solver.prototxt"):
        read_solver_prototxt(tmp_path / "no_such_solver.prototxt")


def test_binaryproto_round_trip(tmp_path):
    mean = np.random.default_rng(5).standard_normal((1, 3, 4, 5)).astype(np.float32)
    path = tmp_path / "mean.binaryproto"
    write_binaryproto(path, array_to_blobproto(mean, legacy_4d=True))
    raw = path.read_bytes()
    proto = read_binaryproto(path)
    assert proto.SerializeToString() == raw
    assert (proto.num, proto.channels, proto.height, proto.width) == (1, 3, 4, 5)
    np.testing.assert_array_equal(blobproto_to_array(proto), mean)
    write_binaryproto(path, array_to_blobproto(mean[0]))
    np.testing.assert_array_equal(blobproto_to_array(read_binaryproto(path)), mean[0])
    with pytest.raises(CctError, match="nomean.binaryproto"):
        read_binaryproto(tmp_path / "nomean.binaryproto")
