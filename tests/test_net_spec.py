"""caffe.NetSpec / layers / params / to_proto, caffe.coord_map and caffe.draw, used as pycaffe scripts use them."""
import os
import sys
import types

import lmdb
import numpy as np
import pytest

import caffe
from caffe import layers as L
from caffe import params as P
from caffe.proto import caffe_pb2

DATA = os.path.join(os.path.dirname(__file__), "data", "pycaffe")


# -- the nets of pycaffe's examples and tests ------------------------------------------------
def lenet(lmdb_path, batch_size):
    """examples/01-learning-lenet.ipynb, verbatim."""
    n = caffe.NetSpec()
    n.data, n.label = L.Data(batch_size=batch_size, backend=P.Data.LMDB, source=lmdb_path,
                             transform_param=dict(scale=1. / 255), ntop=2)
    n.conv1 = L.Convolution(n.data, kernel_size=5, num_output=20, weight_filler=dict(type='xavier'))
    n.pool1 = L.Pooling(n.conv1, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.conv2 = L.Convolution(n.pool1, kernel_size=5, num_output=50, weight_filler=dict(type='xavier'))
    n.pool2 = L.Pooling(n.conv2, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.fc1 = L.InnerProduct(n.pool2, num_output=500, weight_filler=dict(type='xavier'))
    n.relu1 = L.ReLU(n.fc1, in_place=True)
    n.score = L.InnerProduct(n.relu1, num_output=10, weight_filler=dict(type='xavier'))
    n.loss = L.SoftmaxWithLoss(n.score, n.label)
    return n.to_proto()


def anon_lenet(batch_size, transform=True):
    """python/caffe/test/test_net_spec.py's anon_lenet (automatically named tops and layers)."""
    kw = dict(transform_param=dict(scale=1. / 255)) if transform else {}
    data, label = L.DummyData(shape=[dict(dim=[batch_size, 1, 28, 28]), dict(dim=[batch_size, 1, 1, 1])],
                              ntop=2, **kw)
    conv1 = L.Convolution(data, kernel_size=5, num_output=20, weight_filler=dict(type='xavier'))
    pool1 = L.Pooling(conv1, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    conv2 = L.Convolution(pool1, kernel_size=5, num_output=50, weight_filler=dict(type='xavier'))
    pool2 = L.Pooling(conv2, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    ip1 = L.InnerProduct(pool2, num_output=500, weight_filler=dict(type='xavier'))
    relu1 = L.ReLU(ip1, in_place=True)
    ip2 = L.InnerProduct(relu1, num_output=10, weight_filler=dict(type='xavier'))
    loss = L.SoftmaxWithLoss(ip2, label)
    return loss.to_proto()


def silent_net():
    n = caffe.NetSpec()
    n.data, n.data2 = L.DummyData(shape=dict(dim=3), ntop=2)
    n.silence_data = L.Silence(n.data, ntop=0)
    n.silence_data2 = L.Silence(n.data2, ntop=0)
    return n.to_proto()


def load_net(tmp_path, net_proto, name="net.prototxt"):
    path = tmp_path / name
    path.write_text(str(net_proto))
    return caffe.Net(str(path), caffe.TEST)


def write_digits_lmdb(path, n, seed=0):
    """An LMDB of n 1x28x28 uint8 Datums: class k has a bright bar in row band k (learnable)."""
    rng = np.random.default_rng(seed)
    env = lmdb.open(str(path), map_size=1 << 26)
    with env.begin(write=True) as txn:
        for i in range(n):
            label = i % 10
            img = rng.integers(0, 40, size=(1, 28, 28)).astype(np.uint8)
            img[0, 2 + 2 * label:4 + 2 * label, 4:24] = 250
            txn.put(f"{i:08d}".encode(), caffe.io.array_to_datum(img, label).SerializeToString())
    env.close()


# -- prototxt text --------------------------------------------------------------------------
def test_lenet_text_is_pycaffes():
    with open(os.path.join(DATA, "lenet_auto_train.prototxt")) as f:
        expected = f.read()
    proto = lenet("mnist_train_lmdb", 64)
    assert isinstance(proto, caffe_pb2.NetParameter)
    assert str(proto) == expected
    # the relu is in place, as in pycaffe's test
    assert proto.layer[6].bottom == proto.layer[6].top == ["fc1"]


def test_anonymous_names_are_type_and_counter():
    proto = anon_lenet(50)
    assert [l.name for l in proto.layer] == [
        "DummyData1", "Convolution1", "Pooling1", "Convolution2", "Pooling2", "InnerProduct1", "ReLU1",
        "InnerProduct2", "SoftmaxWithLoss1"]
    assert [list(l.top) for l in proto.layer] == [
        ["DummyData1", "DummyData2"], ["Convolution1"], ["Pooling1"], ["Convolution2"], ["Pooling2"],
        ["InnerProduct1"], ["InnerProduct1"], ["InnerProduct2"], ["SoftmaxWithLoss1"]]
    assert list(proto.layer[8].bottom) == ["InnerProduct2", "DummyData2"]
    assert proto.layer[0].transform_param.scale == pytest.approx(1 / 255)


def test_netspec_and_anonymous_lenet_build(tmp_path):
    n = caffe.NetSpec()
    n.data, n.label = L.DummyData(shape=[dict(dim=[2, 1, 28, 28]), dict(dim=[2, 1, 1, 1])], ntop=2)
    n.ip = L.InnerProduct(n.data, num_output=10, weight_filler=dict(type="xavier"))
    n.loss = L.SoftmaxWithLoss(n.ip, n.label)
    net = load_net(tmp_path, n.to_proto())
    assert list(net._layer_names) == ["data", "ip", "loss"]
    assert net.forward()["loss"] == pytest.approx(np.log(10), rel=1e-5)  # zero data: uniform softmax
    net = load_net(tmp_path, anon_lenet(2, transform=False), "anon.prototxt")
    assert len(net.layers) == 9


def test_pycaffe_test_net_spec_lenet_with_transform_param_loads(tmp_path):
    net = load_net(tmp_path, anon_lenet(50))
    assert len(net.layers) == 9


def test_zero_tops(tmp_path):
    proto = silent_net()
    assert [l.name for l in proto.layer] == ["data", "silence_data", "silence_data2"]
    assert [len(l.top) for l in proto.layer] == [2, 0, 0]
    net = load_net(tmp_path, proto)
    assert len(net.forward()) == 0
    # an anonymous ntop=0 layer is named from its type and the type's counter
    fn = L.Silence(L.DummyData(shape=dict(dim=[2])), ntop=0)
    assert isinstance(fn, caffe.net_spec.Function)
    n = caffe.NetSpec()
    n.s = fn
    assert [l.name for l in n.to_proto().layer] == ["DummyData1", "s"]


def test_type_error_for_non_top_input():
    data = L.DummyData(ntop=2)  # a 2-tuple of Tops
    with pytest.raises(TypeError, match=r"^Silence input 0 is not a Top \(type is <class 'tuple'>\)$"):
        L.Silence(data, ntop=0)
    L.Silence(*data, ntop=0)


def test_kwargs_routing():
    n = caffe.NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 3, 8, 8]))
    n.conv = L.Convolution(n.data, name="conv_layer", num_output=4, kernel_size=[3, 5], pad=1,
                           param=[dict(lr_mult=1, decay_mult=1), dict(lr_mult=2, decay_mult=0)],
                           weight_filler=dict(type="gaussian", std=0.01), bias_filler=dict(type="constant", value=0.2),
                           include=dict(phase=caffe.TEST), propagate_down=[False], loss_weight=0.5)
    n.deconv = L.Deconvolution(n.conv, convolution_param=dict(num_output=2, kernel_size=2, stride=2))
    n.py = L.Python(n.deconv, module="mymod", layer="MyLayer", param_str="{'a': 1}")
    n.relu = L.ReLU(n.py, negative_slope=0.1, in_place=True)
    p = n.to_proto()
    conv = p.layer[1]
    assert conv.name == "conv_layer" and list(conv.top) == ["conv"]  # name= names the layer, not the top
    assert list(conv.convolution_param.kernel_size) == [3, 5]
    assert list(conv.convolution_param.pad) == [1]  # a single value for a repeated field
    assert [(s.lr_mult, s.decay_mult) for s in conv.param] == [(1, 1), (2, 0)]
    assert conv.convolution_param.weight_filler.type == "gaussian"
    assert conv.convolution_param.weight_filler.std == pytest.approx(0.01)
    assert conv.convolution_param.bias_filler.value == pytest.approx(0.2)
    assert [r.phase for r in conv.include] == [caffe.TEST]
    assert list(conv.propagate_down) == [False] and list(conv.loss_weight) == [0.5]
    assert p.layer[2].convolution_param.stride == [2]
    assert p.layer[3].python_param.module == "mymod"
    assert p.layer[3].python_param.param_str == "{'a': 1}"
    assert p.layer[4].relu_param.negative_slope == pytest.approx(0.1)
    assert list(p.layer[4].top) == ["py"]
    assert list(p.layer[0].input_param.shape[0].dim) == [1, 3, 8, 8]
    # Deconvolution has no deconvolution_param: pycaffe fails on its kwargs, so do we
    with pytest.raises(AttributeError):
        L.Deconvolution(n.conv, num_output=2).to_proto()
    # an unknown kwarg is an error naming it
    with pytest.raises(AttributeError, match="no_such_field"):
        L.ReLU(n.data, no_such_field=3).to_proto()


def test_params_enums_and_param_name_map():
    assert P.Pooling.MAX == caffe_pb2.PoolingParameter.MAX
    assert P.Pooling.AVE == caffe_pb2.PoolingParameter.AVE
    assert P.Data.LMDB == caffe_pb2.DataParameter.LMDB
    assert P.Eltwise.SUM == caffe_pb2.EltwiseParameter.SUM
    names = caffe.net_spec.param_name_dict()
    assert names["Convolution"] == "convolution" and names["InnerProduct"] == "inner_product"
    assert names["HDF5Data"] == "hdf5_data" and names["ReLU"] == "relu" and names["Transformation"] == "transform"
    assert "Deconvolution" not in names


def test_netspec_container_behaviour():
    n = caffe.NetSpec()
    n["data"] = L.Input(shape=dict(dim=[1, 2]))
    n.ip = L.InnerProduct(n["data"], num_output=3)
    assert n.keys() == ["data", "ip"] and n.vals() == [n.data, n.ip]
    assert n["ip"] is n.ip
    with pytest.raises(KeyError):
        n["nope"]
    with pytest.raises(KeyError):
        _ = n.nope  # pycaffe raises KeyError for a missing top
    assert not hasattr(n, "nope")
    del n["ip"]
    assert n.keys() == ["data"]
    # a top shared by two layers is written once; to_proto of a Top == caffe.to_proto of it
    a = L.Input(shape=dict(dim=[1, 2]))
    b = L.Eltwise(a, a)
    assert [l.name for l in b.to_proto().layer] == ["Input1", "Eltwise1"]
    assert str(caffe.to_proto(b)) == str(b.to_proto())
    both = caffe.to_proto(L.ReLU(a), L.Sigmoid(a))
    assert [l.name for l in both.layer] == ["Input1", "ReLU1", "Sigmoid1"]


# -- LeNet from NetSpec, trained (examples/01-learning-lenet) --------------------------------------
def test_netspec_lenet_trains(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_digits_lmdb(tmp_path / "mnist_train_lmdb", 80, seed=1)
    write_digits_lmdb(tmp_path / "mnist_test_lmdb", 20, seed=2)
    with open("lenet_auto_train.prototxt", "w") as f:
        f.write(str(lenet("mnist_train_lmdb", 16)))
    with open("lenet_auto_test.prototxt", "w") as f:
        f.write(str(lenet("mnist_test_lmdb", 10)))
    with open("lenet_auto_solver.prototxt", "w") as f:
        f.write('train_net: "lenet_auto_train.prototxt"\ntest_net: "lenet_auto_test.prototxt"\n'
                'test_iter: 2\ntest_interval: 500\nbase_lr: 0.01\nmomentum: 0.9\nweight_decay: 0.0005\n'
                'lr_policy: "inv"\ngamma: 0.0001\npower: 0.75\ndisplay: 100\nmax_iter: 10000\n'
                'snapshot: 5000\nsnapshot_prefix: "lenet"\nrandom_seed: 3\n')
    caffe.set_mode_cpu()
    solver = caffe.SGDSolver("lenet_auto_solver.prototxt")
    shapes = [(k, v.data.shape) for k, v in solver.net.blobs.items()]
    assert shapes == [("data", (16, 1, 28, 28)), ("label", (16,)), ("conv1", (16, 20, 24, 24)),
                      ("pool1", (16, 20, 12, 12)), ("conv2", (16, 50, 8, 8)), ("pool2", (16, 50, 4, 4)),
                      ("fc1", (16, 500)), ("score", (16, 10)), ("loss", ())]
    assert [(k, v[0].data.shape) for k, v in solver.net.params.items()] == [
        ("conv1", (20, 1, 5, 5)), ("conv2", (50, 20, 5, 5)), ("fc1", (500, 800)), ("score", (10, 500))]
    solver.net.forward()
    solver.test_nets[0].forward()
    assert solver.test_nets[0].blobs["data"].data.shape == (10, 1, 28, 28)
    np.testing.assert_array_equal(solver.test_nets[0].blobs["label"].data, np.arange(10))
    # the data layer scaled the bytes by 1/255
    assert 0.9 < solver.net.blobs["data"].data.max() <= 1.0
    losses = []
    for _ in range(12):
        solver.step(1)
        losses.append(float(solver.net.blobs["loss"].data))
        solver.test_nets[0].forward(start="conv1")
        assert solver.test_nets[0].blobs["score"].data[:8].shape == (8, 10)
    assert solver.iter == 12
    assert np.isfinite(losses).all()
    assert np.mean(losses[-3:]) < losses[0]
    # test and train nets share the weights
    np.testing.assert_array_equal(solver.test_nets[0].params["conv1"][0].data, solver.net.params["conv1"][0].data)


# -- coord_map (python/caffe/test/test_coord_map.py's cases) ---------------------------------------
def coord_net_spec(ks=3, stride=1, pad=0, pool=2, dstride=2, dpad=0):
    n = caffe.NetSpec()
    n.data = L.Input(shape=dict(dim=[2, 1, 100, 100]))
    n.aux = L.Input(shape=dict(dim=[2, 1, 20, 20]))
    n.conv = L.Convolution(n.data, num_output=10, kernel_size=ks, stride=stride, pad=pad)
    n.pool = L.Pooling(n.conv, pool=P.Pooling.MAX, kernel_size=pool, stride=pool, pad=0)
    deconv_ks = [s * 2 for s in dstride] if isinstance(dstride, list) else dstride * 2
    n.deconv = L.Deconvolution(n.pool, num_output=10, kernel_size=deconv_ks, stride=dstride, pad=dpad)
    return n


def _deconv_to_data(**kw):
    from caffe.coord_map import coord_map_from_to

    n = coord_net_spec(**kw)
    return coord_map_from_to(n.deconv, n.data)


def test_coord_map_conv_pool_deconv_and_padding():
    ax, a, b = _deconv_to_data()
    assert (ax, a, b) == (1, 1, 0)  # identity for 2x pool, 2x deconv
    assert _deconv_to_data(pool=4, dstride=4) == (1, 1, -1)  # shift by one for 4x
    for pad in (0, 3, 7):
        assert _deconv_to_data(pad=pad) == (ax, a, b - pad)  # conv padding adds offset
        assert _deconv_to_data(dpad=pad) == (ax, a, b + pad)  # deconv padding subtracts it
        assert _deconv_to_data(pad=pad, dpad=pad) == (ax, a, b)


def test_coord_map_pass_through_multi_rect_nd():
    from caffe.coord_map import coord_map_from_to

    n = coord_net_spec()
    base = coord_map_from_to(n.deconv, n.data)
    n.relu = L.ReLU(n.deconv)
    n.conv1x1 = L.Convolution(n.relu, num_output=10, kernel_size=1, stride=1, pad=0)
    for top in (n.relu, n.conv1x1):
        assert coord_map_from_to(top, n.data) == base
    n.conv_data, n.conv_aux = L.Convolution(n.data, n.aux, ntop=2, num_output=10, kernel_size=5, stride=2, pad=0)
    assert coord_map_from_to(n.conv_data, n.data) == coord_map_from_to(n.conv_aux, n.aux)

    m3 = coord_net_spec(ks=3, stride=1, pad=0)
    m5 = coord_net_spec(ks=5, stride=2, pad=10)
    m35 = coord_net_spec(ks=[3, 5], stride=[1, 2], pad=[0, 10])
    ax3, a3, b3 = coord_map_from_to(m3.deconv, m3.data)
    ax5, a5, b5 = coord_map_from_to(m5.deconv, m5.data)
    ax35, a35, b35 = coord_map_from_to(m35.deconv, m35.data)
    assert ax3 == ax5 == ax35
    assert (a3, b3) == (a35[0], b35[0]) and (a5, b5) == (a35[1], b35[1])

    n = caffe.NetSpec()
    n.data = L.Input(shape=dict(dim=[2, 3, 100, 100, 100]))
    n.conv = L.Convolution(n.data, num_output=10, kernel_size=[3, 3, 3], stride=[1, 1, 1], pad=[0, 1, 2])
    n.pool = L.Pooling(n.conv, pool=P.Pooling.MAX, kernel_size=2, stride=2, pad=0)
    n.deconv = L.Deconvolution(n.pool, num_output=10, kernel_size=4, stride=2, pad=0)
    ax, a, b = coord_map_from_to(n.deconv, n.data)
    assert ax == 1 and len(a) == len(b) and np.all(a == 1)
    assert b[0] - 1 == b[1] and b[1] - 1 == b[2]


def test_coord_map_crop_and_errors(tmp_path):
    from caffe.coord_map import coord_map_from_to, crop

    n = coord_net_spec()
    ax, a, b = coord_map_from_to(n.deconv, n.data)
    n.crop = L.Crop(n.deconv, n.data, axis=2, offset=4)
    assert coord_map_from_to(n.crop, n.data) == (ax, a, b + 4)

    # FCN-style: crop a padded conv/deconv output back to the input; the net builds with matching shapes
    # (FCN nets give Deconvolution its convolution_param explicitly: it has no deconvolution_param)
    n = caffe.NetSpec()
    n.data = L.Input(shape=dict(dim=[2, 1, 20, 20]))
    n.conv = L.Convolution(n.data, num_output=3, kernel_size=3, pad=5)
    n.pool = L.Pooling(n.conv, pool=P.Pooling.MAX, kernel_size=2, stride=2)
    n.up = L.Deconvolution(n.pool, convolution_param=dict(num_output=3, kernel_size=4, stride=2, bias_term=False))
    n.score = crop(n.up, n.data)
    layer = n.to_proto().layer[-1]
    assert layer.type == "Crop" and list(layer.bottom) == ["up", "data"]
    assert layer.crop_param.axis == 2 and list(layer.crop_param.offset) == [5]
    net = load_net(tmp_path, n.to_proto())
    assert net.blobs["up"].data.shape == (2, 3, 30, 30)
    assert net.blobs["score"].data.shape == (2, 3, 20, 20)
    net.forward()
    np.testing.assert_array_equal(net.blobs["score"].data, net.blobs["up"].data[:, :, 5:25, 5:25])

    n = coord_net_spec()
    n.ip = L.InnerProduct(n.deconv, num_output=10)
    with pytest.raises(RuntimeError):
        coord_map_from_to(n.ip, n.data)
    n = coord_net_spec(pool=3, dstride=2)  # scale mismatch
    with pytest.raises(AssertionError):
        crop(n.deconv, n.data)
    n = coord_net_spec(dpad=10)  # output smaller than input
    with pytest.raises(AssertionError):
        crop(n.deconv, n.data)


# -- draw ------------------------------------------------------------------------------------------
def test_draw_without_pydot_names_the_extra(monkeypatch):
    import caffe.draw

    monkeypatch.setitem(sys.modules, "pydot", None)  # import pydot -> ImportError
    with pytest.raises(ImportError, match=r"pip install cct\[draw\]"):
        caffe.draw.get_pydot_graph(lenet("x", 1), "LR")


def _fake_pydot():
    mod = types.ModuleType("pydot")

    class Node:
        def __init__(self, name, **attrs):
            self.name, self.attrs = name, attrs

    class Edge:
        def __init__(self, src, dst, **attrs):
            self.src, self.dst, self.attrs = src, dst, attrs

    class Dot:
        def __init__(self, name, **attrs):
            self.name, self.attrs, self.nodes, self.edges = name, attrs, [], []

        def add_node(self, node):
            self.nodes.append(node)

        def add_edge(self, edge):
            self.edges.append(edge)

        def create(self, format="png"):
            return f"{format}:{self.name}:{len(self.nodes)}:{len(self.edges)}".encode()

    mod.Node, mod.Edge, mod.Dot = Node, Edge, Dot
    return mod


def test_draw_graph_structure(monkeypatch, tmp_path):
    import caffe.draw

    monkeypatch.setitem(sys.modules, "pydot", _fake_pydot())
    net = lenet("mnist_train_lmdb", 64)
    net.name = "LeNet"
    g = caffe.draw.get_pydot_graph(net, "TB")
    assert g.name == "LeNet" and g.attrs == {"graph_type": "digraph", "rankdir": "TB"}
    labels = {n.name for n in g.nodes}
    assert '"conv1 (Convolution) kernel size: 5 stride: 1 pad: 0"' in labels
    assert '"pool1 (Pooling MAX) kernel size: 2 stride: 2 pad: 0"' in labels
    assert '"relu1 (ReLU)"' in labels and "fc1" in labels
    relu = next(n for n in g.nodes if n.name == '"relu1 (ReLU)"')
    assert relu.attrs["fillcolor"] == "#90EE90"  # in-place neuron layer
    edge_labels = {(e.src.name, e.dst.name): e.attrs["label"] for e in g.edges}
    assert edge_labels[('"data (Data)"', "data")] == "Batch 64"
    assert edge_labels[('"conv1 (Convolution) kernel size: 5 stride: 1 pad: 0"', "conv1")] == "20"
    assert len(g.edges) == sum(len(l.bottom) + len(l.top) for l in net.layer)
    # horizontal layouts separate label parts with newlines; phase filtering
    g = caffe.draw.get_pydot_graph(net, "LR")
    assert '"conv1\\n(Convolution)\\nkernel size: 5\\nstride: 1\\npad: 0"' in {n.name for n in g.nodes}
    net.layer[1].include.add().phase = caffe.TRAIN
    assert len(caffe.draw.get_pydot_graph(net, "LR", phase=caffe.TEST).nodes) < len(g.nodes)
    out = tmp_path / "lenet.svg"
    caffe.draw.draw_net_to_file(net, str(out), "LR")
    assert out.read_bytes().startswith(b"svg:LeNet:")


@pytest.mark.skipif(not os.environ.get("CCT_TEST_PYDOT"), reason="real pydot/graphviz drawing: set CCT_TEST_PYDOT=1")
def test_draw_with_real_pydot(tmp_path):  # pragma: no cover - optional extra
    import caffe.draw

    caffe.draw.draw_net_to_file(lenet("x", 1), str(tmp_path / "net.raw"))
    assert (tmp_path / "net.raw").stat().st_size > 0
