"""The net graph: NetState rules, splits, in-place layers, backward analysis, sharing, weights I/O."""
import numpy as np
import pytest

import cct
from cct.errors import LayerError, NetError, ProtoParseError
from cct.io.prototxt import parse_text
from cct.net import filter_net, insert_splits
from cct.proto import caffe_pb2


def net_param(text: str) -> caffe_pb2.NetParameter:
    return parse_text(text, caffe_pb2.NetParameter())


MLP = """
name: "mlp"
layer { name: "data" type: "Input" top: "data" top: "target"
        input_param { shape { dim: 4 dim: 3 } shape { dim: 4 dim: 2 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
        inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.5 }
                              bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
        inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "ip2" bottom: "target" top: "loss" }
"""


def test_state_rules_filter_layers():
    p = net_param("""
    layer { name: "a" type: "Input" top: "x" input_param { shape { dim: 1 } } include { phase: TRAIN } }
    layer { name: "b" type: "Input" top: "x" input_param { shape { dim: 2 } } include { phase: TEST } }
    layer { name: "c" type: "ReLU" bottom: "x" top: "y" include { min_level: 2 } }
    layer { name: "d" type: "ReLU" bottom: "x" top: "z" include { stage: "s1" stage: "s2" } }
    layer { name: "e" type: "ReLU" bottom: "x" top: "w" exclude { not_stage: "s1" } }
    """)
    def names(phase, level=0, stages=()):
        st = caffe_pb2.NetState(phase=phase, level=level, stage=list(stages))
        return [l.name for l in filter_net(p, st).layer]
    assert names(caffe_pb2.TRAIN) == ["a"]
    assert names(caffe_pb2.TEST, level=2) == ["b", "c"]
    assert names(caffe_pb2.TEST, stages=["s1"]) == ["b", "e"]
    assert names(caffe_pb2.TEST, stages=["s1", "s2"]) == ["b", "d", "e"]


def test_include_and_exclude_together_is_an_error():
    p = net_param('layer { name: "a" type: "ReLU" include { phase: TRAIN } exclude { phase: TEST } }')
    with pytest.raises(NetError, match="layer 'a'.*not both"):
        filter_net(p, caffe_pb2.NetState())


def test_insert_splits_names_like_caffe():
    p = net_param("""
    layer { name: "data" type: "Input" top: "data" top: "label" }
    layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" }
    layer { name: "acc" type: "Accuracy" bottom: "ip" bottom: "label" top: "acc" }
    layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
    """)
    out = insert_splits(p)
    assert [l.name for l in out.layer] == ["data", "label_data_1_split", "ip", "ip_ip_0_split", "acc", "loss"]
    assert list(out.layer[3].top) == ["ip_ip_0_split_0", "ip_ip_0_split_1"]
    assert list(out.layer[4].bottom) == ["ip_ip_0_split_0", "label_data_1_split_0"]
    assert list(out.layer[5].bottom) == ["ip_ip_0_split_1", "label_data_1_split_1"]


def test_split_diffs_are_summed():
    p = net_param("""
    force_backward: true
    layer { name: "data" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }
    layer { name: "a" type: "Power" bottom: "x" top: "a" power_param { scale: 2 } }
    layer { name: "b" type: "Power" bottom: "x" top: "b" power_param { scale: 3 } }
    layer { name: "s" type: "Eltwise" bottom: "a" bottom: "b" top: "s" }
    layer { name: "r" type: "Reduction" bottom: "s" top: "r" loss_weight: 1 }
    """)
    net = cct.Net(p, cct.TRAIN)
    net.blobs["x"].data[...] = np.arange(6).reshape(2, 3)
    loss = net.forward()
    assert loss == pytest.approx(5 * 15)
    net.backward()
    np.testing.assert_allclose(net.blobs["x"].diff, np.full((2, 3), 5.0))


def test_mlp_builds_and_backward_analysis():
    net = cct.Net(net_param(MLP), cct.TRAIN)
    assert net.layer_names == ["data", "ip1", "relu1", "ip2", "loss"]
    assert net.input_blob_names == ["data", "target"]
    assert net.output_blob_names == ["loss"]
    assert net.blob_loss_weights == {"loss": 1.0}
    assert net.layer_need_backward == [False, True, True, True, True]
    # Input blobs get no gradient without force_backward; the label input neither.
    assert net.bottom_need_backward[1] == [False]
    assert net.bottom_need_backward[4] == [True, False]
    assert net.params_lr == [1.0, 1.0, 1.0, 2.0]
    assert net.params_weight_decay == [1.0, 1.0, 1.0, 0.0]
    assert len(net.learnable_params) == 4


def test_force_backward_reaches_inputs_but_not_labels():
    p = net_param(MLP.replace('name: "mlp"', 'name: "mlp" force_backward: true'))
    net = cct.Net(p, cct.TRAIN)
    assert net.bottom_need_backward[1] == [True]
    assert net.bottom_need_backward[4] == [True, True]  # EuclideanLoss allows it on both bottoms


def test_mlp_gradient_matches_finite_differences():
    p = net_param(MLP.replace('name: "mlp"', 'name: "mlp" force_backward: true'))
    net = cct.Net(p, cct.TRAIN, dtype=np.float64)
    rng = np.random.default_rng(0)
    net.blobs["data"].data[...] = rng.standard_normal((4, 3))
    net.blobs["target"].data[...] = rng.standard_normal((4, 2))
    net.forward()
    net.clear_param_diffs()
    net.backward()
    w = net.layer_by_name("ip1").blobs[0]
    analytic = w.diff.copy()
    eps = 1e-6
    for idx in [(0, 0), (2, 1), (4, 2)]:
        x0 = w.data[idx]
        w.data[idx] = x0 + eps
        fp = net.forward()
        w.data[idx] = x0 - eps
        fm = net.forward()
        w.data[idx] = x0
        assert analytic[idx] == pytest.approx((fp - fm) / (2 * eps), rel=1e-5, abs=1e-8)


def test_unknown_bottom_names_layer():
    p = net_param('layer { name: "r" type: "ReLU" bottom: "nope" top: "y" }')
    with pytest.raises(NetError, match=r"Unknown bottom blob 'nope' \(layer 'r', bottom index 0\)"):
        cct.Net(p, cct.TRAIN)


def test_unknown_layer_type_lists_registered_types():
    p = net_param('layer { name: "mystery" type: "Frobnicate" top: "y" }')
    with pytest.raises(LayerError, match="layer 'mystery'.*Frobnicate.*Registered types:.*Convolution"):
        cct.Net(p, cct.TRAIN)


def test_top_produced_twice_is_an_error():
    p = net_param("""
    layer { name: "a" type: "Input" top: "x" input_param { shape { dim: 1 } } }
    layer { name: "b" type: "Input" top: "x" input_param { shape { dim: 1 } } }
    """)
    with pytest.raises(NetError, match="Top blob 'x' produced by multiple sources"):
        cct.Net(p, cct.TRAIN)


SIAMESE = """
layer { name: "data" type: "Input" top: "a" top: "b" input_param { shape { dim: 2 dim: 3 } } }
layer { name: "ip_a" type: "InnerProduct" bottom: "a" top: "fa"
        param { name: "w" lr_mult: 1 } param { name: "bias" lr_mult: 2 }
        inner_product_param { num_output: 4 weight_filler { type: "gaussian" } } }
layer { name: "ip_b" type: "InnerProduct" bottom: "b" top: "fb"
        param { name: "w" lr_mult: 1 } param { name: "bias" lr_mult: 2 }
        inner_product_param { num_output: NOUT weight_filler { type: "gaussian" } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "fa" bottom: "fb" top: "loss" }
"""


def test_param_sharing_by_name():
    net = cct.Net(net_param(SIAMESE.replace("NOUT", "4")), cct.TRAIN)
    wa, wb = net.layer_by_name("ip_a").blobs[0], net.layer_by_name("ip_b").blobs[0]
    assert len(net.learnable_params) == 2
    assert net.param_owners == [-1, -1, 0, 1]
    wa.data[0, 0] = 42.0
    assert wb.data[0, 0] == 42.0
    rng = np.random.default_rng(1)
    net.blobs["a"].data[...] = rng.standard_normal((2, 3))
    net.blobs["b"].data[...] = rng.standard_normal((2, 3))
    net.forward()
    net.clear_param_diffs()
    net.backward()
    assert np.shares_memory(wa.diff, wb.diff)


def test_param_sharing_shape_mismatch_names_layers():
    with pytest.raises(NetError, match="Cannot share param 'w' owned by layer 'ip_a' with layer 'ip_b'"):
        cct.Net(net_param(SIAMESE.replace("NOUT", "5")), cct.TRAIN)


def test_shared_lr_mult_mismatch():
    text = SIAMESE.replace("NOUT", "4")
    spec = 'param { name: "bias" lr_mult: 2 }'
    i = text.rfind(spec)
    text = text[:i] + 'param { name: "bias" lr_mult: 3 }' + text[i + len(spec):]
    with pytest.raises(NetError, match="Shared param 'bias' has mismatched lr_mult"):
        cct.Net(net_param(text), cct.TRAIN)


def test_forward_from_to_and_reshape():
    net = cct.Net(net_param(MLP), cct.TRAIN)
    net.blobs["data"].data[...] = 1.0
    net.forward(end="ip1")
    first = net.blobs["ip1"].data.copy()
    net.forward(start="relu1")
    np.testing.assert_array_equal(net.blobs["ip1"].data, np.maximum(first, 0))
    net.blobs["data"].reshape((7, 3))
    net.blobs["target"].reshape((7, 2))
    net.reshape()
    assert net.blobs["ip2"].shape == (7, 2)
    with pytest.raises(KeyError, match="Unknown layer name 'nope'"):
        net.forward(start="nope")


def test_save_and_copy_from_by_name(tmp_path):
    net = cct.Net(net_param(MLP), cct.TRAIN)
    path = tmp_path / "w.caffemodel"
    net.save(path)
    other = cct.Net(net_param(MLP.replace('"ip2"', '"ip2_renamed"')), cct.TRAIN)
    other.copy_from(str(path))  # ip2 is ignored (renamed), ip1 copied
    np.testing.assert_array_equal(other.layer_by_name("ip1").blobs[0].data, net.layer_by_name("ip1").blobs[0].data)
    bad = cct.Net(net_param(MLP.replace("num_output: 5", "num_output: 6")), cct.TRAIN)
    with pytest.raises(NetError, match="Cannot copy param 0 weights from layer 'ip1'; shape mismatch"):
        bad.copy_from(str(path))
    # the saved file is a NetParameter that round-trips byte-identically
    raw = path.read_bytes()
    assert caffe_pb2.NetParameter.FromString(raw).SerializeToString() == raw


def test_share_weights_with_test_net():
    train = cct.Net(net_param(MLP), cct.TRAIN)
    test = cct.Net(net_param(MLP), cct.TEST)
    test.share_weights_with(train)
    train.layer_by_name("ip1").blobs[0].data[...] = 3.0
    assert np.all(test.layer_by_name("ip1").blobs[0].data == 3.0)


def test_prototxt_syntax_error_has_file_line_column(tmp_path):
    path = tmp_path / "bad.prototxt"
    path.write_text('name: "x"\nlayer {\n  name: "a"\n  type: ReLU\n}\n')
    with pytest.raises(ProtoParseError, match=r"bad\.prototxt:4:\d+"):
        cct.Net(str(path), cct.TRAIN)


def test_debug_info_logs(caplog):
    p = net_param(MLP.replace('name: "mlp"', 'name: "mlp" debug_info: true'))
    net = cct.Net(p, cct.TRAIN)
    with caplog.at_level("INFO", logger="cct"):
        net.forward()
        net.backward()
    text = caplog.text
    assert "[Forward] Layer ip1, top blob ip1 data:" in text
    assert "[Backward] Layer ip2, bottom blob ip1 diff:" in text
