"""``import caffe`` used the way pycaffe scripts use it: classification, net surgery, training loops,
Python layers, weights round trips, feeding blobs, partial forward/backward, MemoryData, misuse."""
import textwrap
import time

import h5py
import numpy as np
import pytest
from PIL import Image

import caffe

# -- nets ------------------------------------------------------------------------------------------
DEPLOY = """
name: "tiny"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 4 dim: 3 dim: 6 dim: 6 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 }
                              bias_filler { type: "gaussian" std: 0.5 } } }
layer { name: "prob" type: "Softmax" bottom: "ip" top: "prob" }
"""

# pycaffe's net_surgery example in miniature: fc6 (InnerProduct) becomes fc6-conv (Convolution)
FC_NET = """
name: "fc"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 2 dim: 6 dim: 6 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 3 kernel_size: 3 weight_filler { type: "gaussian" std: 0.3 }
                            bias_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "fc6" type: "InnerProduct" bottom: "conv1" top: "fc6"
        inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.3 }
                              bias_filler { type: "gaussian" std: 0.3 } } }
"""
FULL_CONV_NET = """
name: "fullconv"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 2 dim: 8 dim: 8 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 3 kernel_size: 3 } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "fc6-conv" type: "Convolution" bottom: "conv1" top: "fc6-conv"
        convolution_param { num_output: 4 kernel_size: 4 } }
"""


def softmax(z):
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def write(path, text):
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.fixture
def tiny(tmp_path):
    """(prototxt, caffemodel) of the tiny classifier, weights saved first as a pycaffe user would."""
    proto = write(tmp_path / "deploy.prototxt", DEPLOY)
    caffe.set_random_seed(5)
    net = caffe.Net(proto, caffe.TEST)
    weights = str(tmp_path / "tiny.caffemodel")
    net.save(weights)
    return proto, weights


def reference_prob(proto, weights, x):
    """softmax(W x + b) computed directly from the saved weights."""
    net = caffe.Net(proto, weights, caffe.TEST)
    w, b = net.params["ip"][0].data, net.params["ip"][1].data
    return softmax(x.reshape(len(x), -1) @ w.T + b)


# -- classification of an image ----------------------------------------------------------------------
def test_classify_png_with_transformer_and_classifier(tiny, tmp_path):
    proto, weights = tiny
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=(10, 12, 3), dtype=np.uint8)
    png = tmp_path / "cat.png"
    Image.fromarray(pixels).save(png)

    im = caffe.io.load_image(str(png))
    assert im.shape == (10, 12, 3) and im.dtype == np.float32
    np.testing.assert_allclose(im, pixels / 255.0, atol=1e-6)

    mean = np.array([104.0, 117.0, 123.0])
    # the 00-classification notebook's way: a Net and a Transformer
    net = caffe.Net(proto, weights, caffe.TEST)
    transformer = caffe.io.Transformer({"data": net.blobs["data"].data.shape})
    transformer.set_transpose("data", (2, 0, 1))
    transformer.set_mean("data", mean)
    transformer.set_raw_scale("data", 255)
    transformer.set_channel_swap("data", (2, 1, 0))
    transformer.set_input_scale("data", 0.01)
    net.blobs["data"].reshape(1, 3, 6, 6)
    net.reshape()
    small = caffe.io.resize_image(im, (6, 6))
    net.blobs["data"].data[...] = transformer.preprocess("data", im)
    out = net.forward()
    manual = (small.transpose(2, 0, 1)[[2, 1, 0]] * 255 - mean[:, None, None]) * 0.01
    np.testing.assert_allclose(net.blobs["data"].data[0], manual, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["prob"], reference_prob(proto, weights, manual[None]), rtol=1e-5)
    assert out["prob"].argmax() == reference_prob(proto, weights, manual[None]).argmax()

    # caffe.Classifier: resize to image_dims, 10 crops (oversample) or the center crop
    clf = caffe.Classifier(proto, weights, image_dims=(8, 8), mean=mean, raw_scale=255, channel_swap=(2, 1, 0),
                           input_scale=0.01)
    resized = caffe.io.resize_image(im, (8, 8))

    def prep(crop):
        return (crop.transpose(2, 0, 1)[[2, 1, 0]] * 255 - mean[:, None, None]) * 0.01

    corners = [(0, 0), (0, 2), (2, 0), (2, 2), (1, 1)]
    crops = [resized[i:i + 6, j:j + 6] for i, j in corners]
    crops += [c[:, ::-1] for c in crops]
    expected = reference_prob(proto, weights, np.stack([prep(c) for c in crops])).mean(0)
    pred = clf.predict([im])  # 10 crops, batch 4: the last batch is padded
    assert pred.shape == (1, 5)
    np.testing.assert_allclose(pred[0], expected, rtol=1e-5, atol=1e-6)

    center = reference_prob(proto, weights, prep(resized[1:7, 1:7])[None])
    np.testing.assert_allclose(clf.predict([im], oversample=False), center, rtol=1e-5, atol=1e-6)

    two = clf.predict([im, im[::-1]], oversample=True)
    assert two.shape == (2, 5)
    np.testing.assert_allclose(two[0], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(two.sum(1), 1, rtol=1e-5)


def test_detector_windows(tiny, tmp_path):
    proto, weights = tiny
    pixels = np.random.default_rng(1).integers(0, 256, size=(12, 14, 3), dtype=np.uint8)
    png = str(tmp_path / "scene.png")
    Image.fromarray(pixels).save(png)
    det = caffe.Detector(proto, weights, raw_scale=255, input_scale=1 / 255.)
    windows = [np.array([0, 0, 6, 6]), np.array([2, 3, 10, 13])]
    dets = det.detect_windows([(png, windows)])
    assert [d["filename"] for d in dets] == [png, png]
    im = caffe.io.load_image(png)
    for d, w in zip(dets, windows):
        x = caffe.io.resize_image(im[w[0]:w[2], w[1]:w[3]], (6, 6)).transpose(2, 0, 1)
        np.testing.assert_allclose(d["prediction"], reference_prob(proto, weights, x[None])[0], rtol=1e-5,
                                   atol=1e-7)
    assert list(det.crop_dims) == [6, 6, 3]
    # context padding: the crop keeps the net's input size, the padding is the (image-space) mean
    det = caffe.Detector(proto, weights, raw_scale=255, mean=np.array([51.0, 102.0, 153.0]), context_pad=1)
    crop = det.crop(im, np.array([0, 0, 4, 4]))
    assert crop.shape == (6, 6, 3)
    np.testing.assert_allclose(crop[0, 0], [0.2, 0.4, 0.6], rtol=1e-6)  # out of the image: mean / raw_scale


# -- net surgery -------------------------------------------------------------------------------------
def test_net_surgery_fc_to_fully_convolutional(tmp_path):
    fc_proto = write(tmp_path / "fc.prototxt", FC_NET)
    conv_proto = write(tmp_path / "fullconv.prototxt", FULL_CONV_NET)
    caffe.set_random_seed(11)
    net = caffe.Net(fc_proto, caffe.TEST)
    weights = str(tmp_path / "fc.caffemodel")
    net.save(weights)

    params = ["fc6"]
    fc_params = {pr: (net.params[pr][0].data, net.params[pr][1].data) for pr in params}
    assert fc_params["fc6"][0].shape == (4, 48) and fc_params["fc6"][1].shape == (4,)
    # layers of the same name (conv1) get their weights from the file; fc6-conv is new
    net_full_conv = caffe.Net(conv_proto, weights, caffe.TEST)
    params_full_conv = ["fc6-conv"]
    conv_params = {pr: (net_full_conv.params[pr][0].data, net_full_conv.params[pr][1].data)
                   for pr in params_full_conv}
    assert conv_params["fc6-conv"][0].shape == (4, 3, 4, 4)
    np.testing.assert_array_equal(net_full_conv.params["conv1"][0].data, net.params["conv1"][0].data)
    for pr, pr_conv in zip(params, params_full_conv):
        conv_params[pr_conv][0].flat = fc_params[pr][0].flat  # flat unrolls the arrays
        conv_params[pr_conv][1][...] = fc_params[pr][1]
    surgery = str(tmp_path / "fullconv.caffemodel")
    net_full_conv.save(surgery)

    x = np.random.default_rng(2).standard_normal((1, 2, 8, 8)).astype(np.float32)
    reloaded = caffe.Net(conv_proto, caffe.TEST, weights=surgery)
    out = reloaded.forward(data=x)["fc6-conv"]
    assert out.shape == (1, 4, 3, 3)
    for i in range(3):
        for j in range(3):
            net.blobs["data"].data[...] = x[:, :, i:i + 6, j:j + 6]
            net.forward()
            np.testing.assert_allclose(out[0, :, i, j], net.blobs["fc6"].data[0], rtol=1e-4, atol=1e-5)


def test_copy_params_between_nets_and_share_with(tiny):
    proto, weights = tiny
    a = caffe.Net(proto, weights, caffe.TEST)
    caffe.set_random_seed(99)
    b = caffe.Net(proto, caffe.TEST)
    assert not np.array_equal(a.params["ip"][0].data, b.params["ip"][0].data)
    for name in a.params:
        for i in range(len(a.params[name])):
            b.params[name][i].data[...] = a.params[name][i].data
    x = np.random.default_rng(3).standard_normal((4, 3, 6, 6)).astype(np.float32)
    np.testing.assert_array_equal(a.forward(data=x)["prob"], b.forward(data=x)["prob"])
    c = caffe.Net(proto, caffe.TEST)
    c.copy_from(weights)
    np.testing.assert_array_equal(c.params["ip"][1].data, a.params["ip"][1].data)
    d = caffe.Net(proto, caffe.TEST)
    d.share_with(a)
    a.params["ip"][0].data[0, 0] = 42.0
    assert d.params["ip"][0].data[0, 0] == 42.0


# -- weights round trips ----------------------------------------------------------------------------
def test_save_and_reload_weights_all_forms(tiny, tmp_path):
    proto, weights = tiny
    net = caffe.Net(proto, caffe.TEST)
    net.params["ip"][0].data[...] = np.arange(5 * 108, dtype=np.float32).reshape(5, 108) / 1000
    net.params["ip"][1].data[...] = [1, 2, 3, 4, 5]
    path = str(tmp_path / "mine.caffemodel")
    net.save(path)
    forms = [caffe.Net(proto, path, caffe.TEST), caffe.Net(proto, caffe.TEST, weights=path),
             caffe.Net(network_file=proto, phase=caffe.TEST, weights=path)]
    for other in forms:
        assert list(other.params) == ["ip"]
        for i in range(2):
            np.testing.assert_array_equal(other.params["ip"][i].data, net.params["ip"][i].data)
    h5 = str(tmp_path / "mine.h5")
    net.save_hdf5(h5)
    other = caffe.Net(proto, caffe.TEST)
    other.load_hdf5(h5)
    np.testing.assert_array_equal(other.params["ip"][0].data, net.params["ip"][0].data)
    with pytest.raises(TypeError):
        caffe.Net(proto)  # no phase


# -- feeding blobs, shapes, partial passes ---------------------------------------------------------
def test_blob_data_aliasing_feeds_the_net(tiny):
    proto, weights = tiny
    net = caffe.Net(proto, weights, caffe.TEST)
    x = np.random.default_rng(4).standard_normal((4, 3, 6, 6)).astype(np.float32)
    data = net.blobs["data"].data  # a view held before forward
    data[...] = x
    assert net.blobs["data"].data is data
    out = net.forward()
    assert list(out) == ["prob"] and out["prob"] is net.blobs["prob"].data
    np.testing.assert_allclose(out["prob"], reference_prob(proto, weights, x), rtol=1e-5)
    np.testing.assert_allclose(net.forward(data=x * 2)["prob"], reference_prob(proto, weights, x * 2), rtol=1e-5)
    np.testing.assert_array_equal(data, x * 2)


def test_blob_shape_properties_and_reshape(tiny):
    proto, weights = tiny
    net = caffe.Net(proto, weights, caffe.TEST)
    blob = net.blobs["data"]
    assert blob.shape == (4, 3, 6, 6) and blob.count == 432
    assert (blob.num, blob.channels, blob.height, blob.width) == (4, 3, 6, 6)
    assert net.blobs["prob"].shape == (4, 5) and net.blobs["prob"].height == 1
    assert net.inputs == ["data"] and net.outputs == ["prob"]
    assert list(net.blobs) == ["data", "ip", "prob"]
    assert list(net.layer_dict) == ["data", "ip", "prob"] and net._layer_names == ["data", "ip", "prob"]
    assert net.top_names["ip"] == ["ip"] and net.bottom_names["prob"] == ["ip"]
    assert [l.type for l in net.layers] == ["Input", "InnerProduct", "Softmax"]
    blob.reshape(2, 3, 6, 6)
    net.reshape()
    assert net.blobs["prob"].data.shape == (2, 5)
    x = np.ones((2, 3, 6, 6), np.float32)
    np.testing.assert_allclose(net.forward(data=x)["prob"], reference_prob(proto, weights, x), rtol=1e-5)


def test_forward_start_end_and_backward_diffs(tmp_path):
    proto = write(tmp_path / "fb.prototxt", """
        name: "fb"
        force_backward: true
        layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 } } }
        layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1"
                inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 1 } } }
        layer { name: "relu" type: "ReLU" bottom: "ip1" top: "r" }
        layer { name: "ip2" type: "InnerProduct" bottom: "r" top: "ip2"
                inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 1 } } }
        """)
    caffe.set_random_seed(8)
    net = caffe.Net(proto, caffe.TRAIN)
    w1, b1 = net.params["ip1"][0].data, net.params["ip1"][1].data
    w2, b2 = net.params["ip2"][0].data, net.params["ip2"][1].data
    x = np.random.default_rng(5).standard_normal((2, 3)).astype(np.float32)
    net.blobs["data"].data[...] = x
    out = net.forward(end="ip1")
    assert list(out) == ["ip1"]
    np.testing.assert_allclose(out["ip1"], x @ w1.T + b1, rtol=1e-5, atol=1e-6)
    assert not net.blobs["ip2"].data.any()  # not run yet
    out = net.forward(start="relu", blobs=["r"])
    assert set(out) == {"ip2", "r"}
    r = np.maximum(x @ w1.T + b1, 0)
    np.testing.assert_allclose(out["ip2"], r @ w2.T + b2, rtol=1e-5, atol=1e-5)

    g = np.array([[1.0, -2.0], [0.5, 3.0]], np.float32)
    diffs = net.backward(ip2=g, diffs=["r"])
    assert set(diffs) == {"data", "r"}
    np.testing.assert_allclose(diffs["r"], g @ w2, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(diffs["data"], ((g @ w2) * (r > 0)) @ w1, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(net.params["ip2"][0].diff, g.T @ r, rtol=1e-5, atol=1e-5)
    # backward(start=, end=) over a range of layers
    net.clear_param_diffs()
    net.blobs["ip2"].diff[...] = g
    d = net.backward(start="ip2", end="ip2")
    assert list(d) == ["r"]  # layer names; the end layer's bottoms come back, as in pycaffe
    np.testing.assert_allclose(d["r"], g @ w2, rtol=1e-5, atol=1e-6)
    with pytest.raises(Exception, match="do not match"):
        net.backward(r=g)

    # forward_backward_all: 3 items in batches of 2 (the last one padded)
    x3 = np.random.default_rng(6).standard_normal((3, 3)).astype(np.float32)
    g3 = np.random.default_rng(7).standard_normal((3, 2)).astype(np.float32)
    outs, diffs = net.forward_backward_all(data=x3, ip2=g3)
    r3 = np.maximum(x3 @ w1.T + b1, 0)
    np.testing.assert_allclose(outs["ip2"], r3 @ w2.T + b2, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(diffs["data"], ((g3 @ w2) * (r3 > 0)) @ w1, rtol=1e-5, atol=1e-5)


def test_forward_all_and_forward_backward_all(tiny):
    proto, weights = tiny
    net = caffe.Net(proto, weights, caffe.TEST)
    x = np.random.default_rng(6).standard_normal((10, 3, 6, 6)).astype(np.float32)
    out = net.forward_all(data=x)  # batches of 4: 4 + 4 + 2 (padded)
    assert out["prob"].shape == (10, 5)
    np.testing.assert_allclose(out["prob"], reference_prob(proto, weights, x), rtol=1e-5, atol=1e-7)
    out = net.forward_all(blobs=["ip"], data=x[:8])
    assert set(out) == {"prob", "ip"} and out["ip"].shape == (8, 5)


def test_set_input_arrays_with_memory_data(tmp_path):
    proto = write(tmp_path / "mem.prototxt", """
        layer { name: "data" type: "MemoryData" top: "data" top: "label"
                memory_data_param { batch_size: 2 channels: 1 height: 1 width: 3 } }
        layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
                inner_product_param { num_output: 2 weight_filler { type: "constant" value: 1 } } }
        """)
    net = caffe.Net(proto, caffe.TEST)
    data = np.arange(12, dtype=np.float32).reshape(4, 1, 1, 3)
    labels = np.array([1, 0, 1, 0], dtype=np.float32)
    net.set_input_arrays(data, labels)
    net.forward()
    np.testing.assert_array_equal(net.blobs["data"].data, data[:2])
    np.testing.assert_array_equal(net.blobs["label"].data.ravel(), labels[:2])
    np.testing.assert_allclose(net.blobs["ip"].data, np.repeat(data[:2].sum((1, 2, 3))[:, None], 2, 1))
    net.forward()
    np.testing.assert_array_equal(net.blobs["data"].data, data[2:])
    np.testing.assert_array_equal(net.blobs["label"].data.ravel(), labels[2:])

    other = caffe.Net(write(tmp_path / "in.prototxt", DEPLOY), caffe.TEST)
    with pytest.raises(Exception, match="MemoryData"):
        other.set_input_arrays(data, labels)


# -- misuse fails like pycaffe ----------------------------------------------------------------------
def test_wrong_use_fails_clearly(tiny):
    proto, weights = tiny
    net = caffe.Net(proto, weights, caffe.TEST)
    with pytest.raises(KeyError, match="nope"):
        net.blobs["nope"]
    with pytest.raises(KeyError, match="prob"):
        net.params["prob"]  # a layer without params
    with pytest.raises(Exception, match="not batch sized"):
        net.forward(data=np.zeros((3, 3, 6, 6), np.float32))
    with pytest.raises(ValueError, match=r"\[4, 3, 6, 6\]"):
        net.forward(data=np.zeros((4, 3, 1, 1), np.float32))  # would broadcast silently with data[...] = x
    with pytest.raises(Exception, match="do not match"):
        net.forward(image=np.zeros((4, 3, 6, 6), np.float32))
    with pytest.raises(KeyError, match="conv9"):
        net.forward(start="conv9")
    t = caffe.io.Transformer({"data": net.blobs["data"].data.shape})
    with pytest.raises(Exception, match="label is not one of the net inputs"):
        t.set_mean("label", np.zeros(3))
    with pytest.raises(Exception, match="image is not one of the net inputs"):
        t.preprocess("image", np.zeros((6, 6, 3)))
    with pytest.raises(Exception, match="deploy.prototxt.missing"):
        caffe.Net(proto + ".missing", caffe.TEST)


# -- training --------------------------------------------------------------------------------------
TRAIN_VAL = """
name: "logreg"
layer { name: "data" type: "HDF5Data" top: "data" top: "label" include { phase: TRAIN }
        hdf5_data_param { source: "train.txt" batch_size: 8 } }
layer { name: "data" type: "HDF5Data" top: "data" top: "label" include { phase: TEST }
        hdf5_data_param { source: "test.txt" batch_size: 8 } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
layer { name: "accuracy" type: "Accuracy" bottom: "ip" bottom: "label" top: "accuracy" include { phase: TEST } }
"""

SOLVER = """
net: "train_val.prototxt"
test_iter: 4
test_interval: 1000
base_lr: 0.5
momentum: 0.9
lr_policy: "fixed"
display: 0
max_iter: 1000
snapshot_prefix: "logreg"
random_seed: 1
"""


def make_logreg_data(tmp_path):
    rng = np.random.default_rng(7)
    w = rng.standard_normal((3, 4))
    for name in ("train", "test"):
        x = rng.standard_normal((32, 4)).astype(np.float32)
        y = (x @ w.T).argmax(1).astype(np.float32)
        with h5py.File(tmp_path / f"{name}.h5", "w") as f:
            f["data"], f["label"] = x, y
        (tmp_path / f"{name}.txt").write_text(str(tmp_path / f"{name}.h5") + "\n")


def test_training_loop_with_step_and_test_nets(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_logreg_data(tmp_path)
    write(tmp_path / "train_val.prototxt", TRAIN_VAL)
    write(tmp_path / "solver.prototxt", SOLVER)
    caffe.set_mode_cpu()
    solver = caffe.SGDSolver("solver.prototxt")
    assert isinstance(solver.net, caffe.Net) and len(solver.test_nets) == 1
    assert solver.net.phase == caffe.TRAIN and solver.test_nets[0].phase == caffe.TEST
    losses = []
    for _ in range(40):
        solver.step(1)
        losses.append(float(solver.net.blobs["loss"].data))
    assert solver.iter == 40
    assert np.mean(losses[-8:]) < 0.5 * np.mean(losses[:4])
    accuracy = 0.0
    for _ in range(4):
        out = solver.test_nets[0].forward()
        assert set(out) == {"loss", "accuracy"}
        accuracy += float(out["accuracy"]) / 4
    assert accuracy > 0.75
    # the wrappers see the solver's own nets (weights shared with the test net)
    np.testing.assert_array_equal(solver.net.params["ip"][0].data, solver.test_nets[0].params["ip"][0].data)

    s = caffe.get_solver("solver.prototxt")
    assert isinstance(s, caffe.SGDSolver) and s.iter == 0
    assert caffe.AdamSolver("solver.prototxt").type == "Adam"


PYLOSS = '''
import caffe
import numpy as np


class EuclideanLossLayer(caffe.Layer):
    """pycaffe's examples/pycaffe/layers/pyloss.py"""

    def setup(self, bottom, top):
        if len(bottom) != 2:
            raise Exception("Need two inputs to compute distance.")

    def reshape(self, bottom, top):
        if bottom[0].count != bottom[1].count:
            raise Exception("Inputs must have the same dimension.")
        self.diff = np.zeros_like(bottom[0].data, dtype=np.float32)
        top[0].reshape(1)

    def forward(self, bottom, top):
        self.diff[...] = bottom[0].data - bottom[1].data
        top[0].data[...] = np.sum(self.diff ** 2) / bottom[0].num / 2.

    def backward(self, top, propagate_down, bottom):
        for i in range(2):
            if not propagate_down[i]:
                continue
            sign = 1 if i == 0 else -1
            bottom[i].diff[...] = sign * self.diff / bottom[i].num
'''

REGRESSION = """
name: "regress"
layer { name: "data" type: "HDF5Data" top: "data" top: "target" hdf5_data_param { source: "reg.txt" batch_size: 5 } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.1 } } }
LOSS
"""


def test_python_loss_layer_trains_like_the_builtin(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyloss_cct_test.py").write_text(PYLOSS)
    monkeypatch.syspath_prepend(str(tmp_path))  # Caffe finds python_param.module on sys.path
    rng = np.random.default_rng(9)
    x = rng.standard_normal((20, 3)).astype(np.float32)
    y = (x @ rng.standard_normal((3, 2)) + 0.5).astype(np.float32)
    with h5py.File(tmp_path / "reg.h5", "w") as f:
        f["data"], f["target"] = x, y
    (tmp_path / "reg.txt").write_text("reg.h5\n")
    py = ('layer { type: "Python" name: "loss" top: "loss" bottom: "ip" bottom: "target"\n'
          '  python_param { module: "pyloss_cct_test" layer: "EuclideanLossLayer" }\n  loss_weight: 1 }')
    builtin = 'layer { type: "EuclideanLoss" name: "loss" top: "loss" bottom: "ip" bottom: "target" }'
    solvers = []
    for name, loss in (("py", py), ("builtin", builtin)):
        write(tmp_path / f"{name}.prototxt", REGRESSION.replace("LOSS", loss))
        write(tmp_path / f"{name}_solver.prototxt",
              f'train_net: "{name}.prototxt"\nbase_lr: 0.05\nlr_policy: "fixed"\nmomentum: 0.9\n'
              f'display: 0\nmax_iter: 100\nsnapshot_prefix: "{name}"\n')
        solvers.append(caffe.SGDSolver(f"{name}_solver.prototxt"))
    py_solver, ref_solver = solvers
    assert py_solver.net.layers[-1].type == "Python"
    for i in range(2):  # same start
        py_solver.net.params["ip"][i].data[...] = ref_solver.net.params["ip"][i].data
    py_losses, ref_losses = [], []
    for _ in range(25):
        py_solver.step(1)
        ref_solver.step(1)
        py_losses.append(float(np.squeeze(py_solver.net.blobs["loss"].data)))
        ref_losses.append(float(ref_solver.net.blobs["loss"].data))
    np.testing.assert_allclose(py_losses, ref_losses, rtol=1e-4, atol=1e-6)
    for i in range(2):
        np.testing.assert_allclose(py_solver.net.params["ip"][i].data, ref_solver.net.params["ip"][i].data,
                                   rtol=1e-4, atol=1e-5)
    assert py_losses[-1] < 0.2 * py_losses[0]


# -- module-level API ---------------------------------------------------------------------------------
def test_module_level_functions():
    assert caffe.TRAIN == 0 and caffe.TEST == 1
    assert "Convolution" in caffe.layer_type_list() and "Python" in caffe.layer_type_list()
    caffe.set_mode_cpu()
    caffe.set_device(0)
    caffe.set_random_seed(3)
    caffe.log("a log line from pycaffe")
    t = caffe.Timer()
    t.start()
    time.sleep(0.01)
    t.stop()
    assert 10 <= t.ms < 10_000  # the 10 ms slept, in milliseconds
    assert caffe.solver_count() == 1 and caffe.solver_rank() == 0 and not caffe.has_nccl()
    from caffe.proto import caffe_pb2

    assert caffe_pb2.NetParameter().DESCRIPTOR.full_name == "caffe.NetParameter"
    assert issubclass(caffe.Layer, object) and hasattr(caffe.Layer, "forward")


# -- python/caffe/test/test_net.py's cases -----------------------------------------------------------
def simple_net_file(tmp_path, num_output):
    """test_net.cpp's simple net, as pycaffe's test_net.py writes it."""
    return write(tmp_path / "simple.prototxt", """name: 'testnet' force_backward: true
    layer { type: 'DummyData' name: 'data' top: 'data' top: 'label'
      dummy_data_param { num: 5 channels: 2 height: 3 width: 4
        num: 5 channels: 1 height: 1 width: 1
        data_filler { type: 'gaussian' std: 1 }
        data_filler { type: 'constant' } } }
    layer { type: 'Convolution' name: 'conv' bottom: 'data' top: 'conv'
      convolution_param { num_output: 11 kernel_size: 2 pad: 3
        weight_filler { type: 'gaussian' std: 1 }
        bias_filler { type: 'constant' value: 2 } }
        param { decay_mult: 1 } param { decay_mult: 0 }
        }
    layer { type: 'InnerProduct' name: 'ip' bottom: 'conv' top: 'ip'
      inner_product_param { num_output: """ + str(num_output) + """
        weight_filler { type: 'gaussian' std: 2.5 }
        bias_filler { type: 'constant' value: -3 } } }
    layer { type: 'SoftmaxWithLoss' name: 'loss' bottom: 'ip' bottom: 'label'
      top: 'loss' }""")


def test_pycaffe_test_net_cases(tmp_path):
    net_file = simple_net_file(tmp_path, 13)
    net = caffe.Net(net_file, caffe.TRAIN)
    net.blobs["label"].data[...] = np.random.randint(13, size=net.blobs["label"].data.shape)
    assert net.inputs == [] and net.outputs == ["loss"]
    assert list(net.layer_dict) == list(net._layer_names)
    for name, layer in net.layer_dict.items():
        assert layer.type == net.layers[net._layer_names.index(name)].type
    assert net.top_names == {"data": ["data", "label"], "conv": ["conv"], "ip": ["ip"], "loss": ["loss"]}
    assert net.bottom_names == {"data": [], "conv": ["data"], "ip": ["conv"], "loss": ["ip", "label"]}
    assert net.blob_loss_weights["loss"] == 1 and net.blob_loss_weights["ip"] == 0
    net.forward()
    net.backward()
    assert all(np.any(p.diff) for ps in net.params.values() for p in ps)
    assert np.any(net.blobs["data"].diff)  # force_backward reaches the data
    net.clear_param_diffs()
    assert not any(np.any(p.diff) for ps in net.params.values() for p in ps)
    # holding blob data beyond the life of the net is fine
    params = sum(map(list, net.params.values()), [])
    blobs = list(net.blobs.values())
    saved = str(tmp_path / "simple.caffemodel")
    net.save(saved)
    del net
    total = sum(p.data.sum() + p.diff.sum() for p in params) + sum(b.data.sum() + b.diff.sum() for b in blobs)
    assert np.isfinite(total)
    net2 = caffe.Net(net_file, saved, caffe.TRAIN)
    for p, q in zip(params, sum(map(list, net2.params.values()), [])):
        assert abs(p.data - q.data).sum() == 0


LEVELS_NET = """
layer { name: "data" type: "DummyData" top: "data" dummy_data_param { shape { dim: 1 dim: 1 dim: 10 dim: 10 } } }
layer { name: "NoLevel" type: "InnerProduct" bottom: "data" top: "NoLevel" inner_product_param { num_output: 1 } }
layer { name: "Level0Only" type: "InnerProduct" bottom: "data" top: "Level0Only"
        include { min_level: 0 max_level: 0 } inner_product_param { num_output: 1 } }
layer { name: "Level1Only" type: "InnerProduct" bottom: "data" top: "Level1Only"
        include { min_level: 1 max_level: 1 } inner_product_param { num_output: 1 } }
layer { name: "Level>=1" type: "InnerProduct" bottom: "data" top: "Level>=1"
        include { min_level: 1 } inner_product_param { num_output: 1 } }
layer { name: "A" type: "InnerProduct" bottom: "data" top: "A" include { stage: "A" }
        inner_product_param { num_output: 1 } }
layer { name: "AandB" type: "InnerProduct" bottom: "data" top: "AandB" include { stage: "A" stage: "B" }
        inner_product_param { num_output: 1 } }
layer { name: "train" type: "InnerProduct" bottom: "data" top: "train" include { phase: TRAIN }
        inner_product_param { num_output: 1 } }
"""


def test_levels_stages_phases(tmp_path):
    path = write(tmp_path / "levels.prototxt", LEVELS_NET)

    def blobs(net):
        return [b for b in net.blobs if "data" not in b]

    assert blobs(caffe.Net(path, caffe.TEST)) == ["NoLevel", "Level0Only"]
    assert blobs(caffe.Net(path, caffe.TEST, level=1)) == ["NoLevel", "Level1Only", "Level>=1"]
    assert blobs(caffe.Net(path, caffe.TEST, stages=["A"])) == ["NoLevel", "Level0Only", "A"]
    assert blobs(caffe.Net(path, caffe.TEST, stages=["A", "B"])) == ["NoLevel", "Level0Only", "A", "AandB"]
    assert blobs(caffe.Net(path, caffe.TRAIN)) == ["NoLevel", "Level0Only", "train"]


# -- python/caffe/test/test_solver.py's cases --------------------------------------------------------
@pytest.fixture
def simple_solver(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    net_f = simple_net_file(tmp_path, 13)
    solver_f = write(tmp_path / "solver.prototxt", """net: '""" + net_f + """'
        test_iter: 10 test_interval: 10 base_lr: 0.01 momentum: 0.9
        weight_decay: 0.0005 lr_policy: 'inv' gamma: 0.0001 power: 0.75
        display: 100 max_iter: 100 snapshot_after_train: false
        snapshot_prefix: "model" """)
    solver = caffe.SGDSolver(solver_f)
    caffe.get_solver(solver_f)  # also make sure get_solver runs
    caffe.set_mode_cpu()
    for net in [solver.net] + solver.test_nets:
        net.blobs["label"].data[...] = np.random.randint(13, size=net.blobs["label"].data.shape)
    return solver


def test_solver_solve(simple_solver):
    assert simple_solver.iter == 0
    simple_solver.solve()
    assert simple_solver.iter == 100


def test_solver_apply_update(simple_solver):
    net = simple_solver.net
    data = net.layers[1].blobs[0].data[...]
    data[...] = 0  # reset the conv weights
    net.layers[1].blobs[0].diff[...] = 1
    simple_solver.apply_update()  # the initial learning rate is 0.01
    assert (data - -0.01 * np.ones(data.shape)).max() < 1e-7


def test_solver_nets_outlive_the_solver(simple_solver):
    nets = [simple_solver.net] + list(simple_solver.test_nets)
    assert len(nets) == 2
    del simple_solver
    total = 0
    for net in nets:
        for ps in net.params.values():
            for p in ps:
                total += p.data.sum() + p.diff.sum()
        for bl in net.blobs.values():
            total += bl.data.sum() + bl.diff.sum()
    assert np.isfinite(total)


def test_solver_snapshot(simple_solver, tmp_path):
    simple_solver.snapshot()
    for fn in ("model_iter_0.caffemodel", "model_iter_0.solverstate"):
        assert (tmp_path / fn).is_file()
    simple_solver.step(2)
    simple_solver.restore("model_iter_0.solverstate")
    assert simple_solver.iter == 0


# -- python/caffe/test/test_python_layer.py's cases ---------------------------------------------------
PYLAYERS = '''
import caffe


class SimpleLayer(caffe.Layer):
    """A layer that just multiplies by ten"""

    def setup(self, bottom, top):
        pass

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = 10 * bottom[0].data

    def backward(self, top, propagate_down, bottom):
        bottom[0].diff[...] = 10 * top[0].diff


class ExceptionLayer(caffe.Layer):
    """A layer for checking exceptions from Python"""

    def setup(self, bottom, top):
        raise RuntimeError


class SimpleParamLayer(caffe.Layer):
    """A layer that multiplies by the numeric value of its param_str"""

    def setup(self, bottom, top):
        try:
            self.value = float(self.param_str)
        except ValueError:
            raise ValueError("Parameter string must be a legible float")

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = self.value * bottom[0].data

    def backward(self, top, propagate_down, bottom):
        bottom[0].diff[...] = self.value * top[0].diff


class ParameterLayer(caffe.Layer):
    """A layer with one learnable parameter"""

    def setup(self, bottom, top):
        self.blobs.add_blob(1)
        self.blobs[0].data[0] = 0

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        pass

    def backward(self, top, propagate_down, bottom):
        self.blobs[0].diff[0] = 1


class PhaseLayer(caffe.Layer):
    """A layer for checking attribute `phase`"""

    def setup(self, bottom, top):
        pass

    def reshape(self, bootom, top):
        top[0].reshape()

    def forward(self, bottom, top):
        top[0].data[()] = self.phase

    def set_value(self, v):  # a method scripts call through net.layers[i]
        self.extra = v
'''


@pytest.fixture
def pylayers(tmp_path, monkeypatch):
    (tmp_path / "pylayers_cct_test.py").write_text(PYLAYERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def python_net_file(tmp_path, layer, name="py.prototxt", param_str=None, three=True):
    ps = f" param_str: '{param_str}'" if param_str is not None else ""
    layers = "".join(
        f"layer {{ type: 'Python' name: '{n}' bottom: '{b}' top: '{n}'\n"
        f"  python_param {{ module: 'pylayers_cct_test' layer: '{layer}'{ps} }} }}\n"
        for n, b in ([("one", "data"), ("two", "one"), ("three", "two")] if three else [("layer", "data")]))
    return write(tmp_path / name, "name: 'pythonnet' force_backward: true\n"
                                  "input: 'data' input_shape { dim: 10 dim: 9 dim: 8 }\n" + layers)


def test_python_layer_forward_backward(pylayers):
    net = caffe.Net(python_net_file(pylayers, "SimpleLayer"), caffe.TRAIN)
    x = 8
    net.blobs["data"].data[...] = x
    net.forward()
    assert (net.blobs["three"].data == 10 ** 3 * x).all()
    net.blobs["three"].diff[...] = x
    net.backward()
    assert (net.blobs["data"].diff == 10 ** 3 * x).all()
    # reshape propagates through python layers
    s = 4
    net.blobs["data"].reshape(s, s, s, s)
    net.forward()
    for blob in net.blobs.values():
        assert blob.data.shape == (s, s, s, s)


def test_python_layer_exception_and_param_str(pylayers):
    with pytest.raises(RuntimeError):
        caffe.Net(python_net_file(pylayers, "ExceptionLayer", "exc.prototxt"), caffe.TEST)
    net = caffe.Net(python_net_file(pylayers, "SimpleParamLayer", "param.prototxt", param_str="10"), caffe.TRAIN)
    net.blobs["data"].data[...] = 3
    net.forward()
    assert (net.blobs["three"].data == 10 ** 3 * 3).all()


def test_python_layer_parameter_save_load_share(pylayers):
    net_file = python_net_file(pylayers, "ParameterLayer", "param_layer.prototxt", three=False)
    net = caffe.Net(net_file, caffe.TRAIN)
    net.forward()
    net.backward()
    layer = net.layers[list(net._layer_names).index("layer")]
    assert layer.blobs[0].data[0] == 0 and layer.blobs[0].diff[0] == 1
    layer.blobs[0].data[0] += layer.blobs[0].diff[0]
    assert layer.blobs[0].data[0] == 1
    assert net.params["layer"][0].data[0] == 1  # net.params sees the same storage
    weights = str(pylayers / "param_layer.caffemodel")
    net.save(weights)
    layer.blobs[0].data[0] = -1
    net.copy_from(weights)
    assert layer.blobs[0].data[0] == 1
    net2 = caffe.Net(net_file, caffe.TRAIN)
    net2.share_with(net)
    assert net2.layers[list(net2._layer_names).index("layer")].blobs[0].data[0] == 1


def test_python_layer_phase_and_user_object(pylayers):
    net_file = python_net_file(pylayers, "PhaseLayer", "phase.prototxt", three=False)
    for phase in (caffe.TRAIN, caffe.TEST):
        net = caffe.Net(net_file, phase)
        net.forward()
        assert net.blobs["layer"].data[()] == phase
    # net.layers hands out the user's layer object (py-faster-rcnn's solver.net.layers[0].set_roidb(...))
    layer = net.layer_dict["layer"]
    assert type(layer).__name__ == "PhaseLayer" and isinstance(layer, caffe.Layer)
    layer.set_value(5)
    assert net.layers[1].extra == 5 and layer.type == "Python"
