"""Drop-in details a Caffe user relies on: pycaffe's layer-named forward/backward ranges, load_hdf5 on
any file name, ``caffe.proto.caffe_pb2`` after ``import caffe``, ``cct.Net.params`` as pycaffe's dict,
the solvers exported by ``import cct``, PReLU ``channel_shared`` weights as Caffe stores them (a blob
with no axes), and fork-only prototxt fields reported with the layer and the fork they belong to."""
from __future__ import annotations

import textwrap

import numpy as np
import pytest

import caffe
import cct
from cct.errors import CctError, ProtoParseError
from cct.io import array_to_blobproto, blobproto_shape, blobproto_to_array, parse_text, read_net_prototxt
from cct.io.caffemodel import is_hdf5
from cct.proto import caffe_pb2

NET = """
name: "ranges"
force_backward: true
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 3 dim: 2 dim: 4 dim: 4 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 2 kernel_size: 3 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip_blob"
        inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.5 }
                              bias_filler { type: "gaussian" std: 0.5 } } }
layer { name: "prelu" type: "PReLU" bottom: "ip_blob" top: "out" prelu_param { channel_shared: true }
        loss_weight: 1 }
"""


@pytest.fixture
def proto(tmp_path):
    path = tmp_path / "net.prototxt"
    path.write_text(textwrap.dedent(NET))
    return str(path)


def test_forward_and_backward_ranges_take_layer_names(proto):
    caffe.set_random_seed(3)
    net = caffe.Net(proto, caffe.TRAIN)
    rng = np.random.default_rng(0)
    conv = rng.uniform(size=net.blobs["conv"].data.shape).astype(np.float32)
    net.blobs["conv"].data[...] = conv
    out = net.forward(start="ip", end="ip")  # layer 'ip' writes blob 'ip_blob'
    assert list(out) == ["ip_blob"]
    w, b = net.params["ip"][0].data, net.params["ip"][1].data
    np.testing.assert_allclose(out["ip_blob"], conv.reshape(3, -1) @ w.T + b, rtol=1e-5, atol=1e-5)

    dy = rng.uniform(size=net.blobs["ip_blob"].data.shape).astype(np.float32)
    net.blobs["ip_blob"].diff[...] = dy
    back = net.backward(start="ip", end="ip")
    assert list(back) == ["conv"]  # the end layer's bottoms
    np.testing.assert_allclose(back["conv"], (dy @ w).reshape(conv.shape), rtol=1e-5, atol=1e-5)
    with pytest.raises(KeyError, match="ip_blob"):
        net.forward(end="ip_blob")  # a blob name is not a layer name


def test_load_hdf5_reads_any_file_name(proto, tmp_path):
    net = caffe.Net(proto, caffe.TRAIN)
    for i, blobs in enumerate(net.params.values()):
        for j, b in enumerate(blobs):
            b.data[...] = np.arange(b.count, dtype=np.float32).reshape(b.data.shape) * (i + 1) + j
    no_suffix = str(tmp_path / "weights_without_suffix")
    net.save_hdf5(no_suffix)
    assert is_hdf5(no_suffix)
    other = caffe.Net(proto, caffe.TRAIN)
    other.load_hdf5(no_suffix)
    for name in net.params:
        for a, b in zip(net.params[name], other.params[name]):
            np.testing.assert_array_equal(a.data, b.data)
    # copy_from decides by content too (Caffe's H5Fis_hdf5), also through the weights= argument
    third = caffe.Net(proto, caffe.TRAIN, weights=no_suffix)
    np.testing.assert_array_equal(third.params["ip"][0].data, net.params["ip"][0].data)
    # and a binary caffemodel called .h5 is still read as what it is
    fake = str(tmp_path / "binary.h5")
    net.save(fake)
    assert not is_hdf5(fake)
    fourth = caffe.Net(proto, caffe.TRAIN, weights=fake)
    np.testing.assert_array_equal(fourth.params["conv"][0].data, net.params["conv"][0].data)
    with pytest.raises(CctError, match="not an HDF5 file"):
        other.load_hdf5(fake)


def test_caffe_proto_is_an_attribute_of_caffe():
    assert caffe.proto.caffe_pb2.NetParameter is caffe_pb2.NetParameter
    assert caffe.TRAIN == caffe.proto.caffe_pb2.TRAIN == 0


def test_cct_net_params_is_pycaffes_dict_and_learnable_params_the_flat_list(proto):
    net = cct.Net(proto, cct.TRAIN)
    assert list(net.params) == ["conv", "ip", "prelu"]
    assert [b.shape for b in net.params["ip"]] == [(5, 8), (5,)]
    assert net.params["prelu"][0].shape == ()
    flat = [b for blobs in net.params.values() for b in blobs]
    assert len(net.learnable_params) == 5
    assert all(a is b for a, b in zip(net.learnable_params, flat))


def test_import_cct_exports_the_solvers(tmp_path, proto):
    assert cct.get_solver is cct.solver.get_solver
    for name in ("SGD", "Nesterov", "AdaGrad", "RMSProp", "AdaDelta", "Adam"):
        assert getattr(cct, f"{name}Solver").type == name
    solver_file = tmp_path / "solver.prototxt"
    solver_file.write_text(f'net: "{proto}" base_lr: 0.1 lr_policy: "fixed" max_iter: 2 display: 0 '
                           f'snapshot_after_train: false type: "Adam"')
    s = cct.get_solver(str(solver_file))
    assert isinstance(s, cct.AdamSolver)
    s.net.blobs["data"].data[...] = 1.0
    before = s.net.params["ip"][0].data.copy()
    s.step(1)
    assert s.iter == 1 and not np.array_equal(before, s.net.params["ip"][0].data)
    assert isinstance(cct.SGDSolver(str(solver_file)), cct.SGDSolver)


def test_prelu_channel_shared_weights_are_0d_like_caffe(proto, tmp_path):
    net = cct.Net(proto, cct.TRAIN)
    slope = net.params["prelu"][0]
    slope.data[...] = 0.125
    path = str(tmp_path / "w.caffemodel")
    net.save(path)
    saved = caffe_pb2.NetParameter.FromString(open(path, "rb").read())
    (blob,) = next(l for l in saved.layer if l.name == "prelu").blobs
    # Caffe's Blob::ToProto writes no shape for a blob with no axes: one value, no dims
    assert not blob.HasField("shape") and list(blob.data) == [0.125]
    assert blobproto_shape(blob) == ()
    other = cct.Net(proto, cct.TRAIN, weights=path)
    assert other.params["prelu"][0].shape == () and float(other.params["prelu"][0].data) == 0.125
    h5 = str(tmp_path / "w.h5")
    net.save_hdf5(h5)
    third = cct.Net(proto, cct.TRAIN, weights=h5)
    assert float(third.params["prelu"][0].data) == 0.125


def test_blobproto_shapes_as_caffe_reads_them():
    legacy = caffe_pb2.BlobProto(num=1, channels=1, height=1, width=3, data=[1, 2, 3])
    legacy.shape.dim.extend([3])  # the legacy 4-D dims win over shape, as in Blob::FromProto
    assert blobproto_shape(legacy) == (1, 1, 1, 3)
    assert blobproto_to_array(caffe_pb2.BlobProto(data=[7.0])).shape == ()
    with pytest.raises(CctError, match="holds 2 values"):
        blobproto_to_array(caffe_pb2.BlobProto(data=[1.0, 2.0]))
    assert blobproto_to_array(array_to_blobproto(np.float32(4.5))) == np.float32(4.5)


FORK_CASES = [
    ("permute_param { order: 0 order: 2 order: 3 order: 1 }", "Permute", "permute_param", "SSD"),
    ("shuffle_channel_param { group: 3 }", "ShuffleChannel", "shuffle_channel_param", "ShuffleNet"),
    ("bn_param { slope_filler { type: 'constant' value: 1 } }", "BN", "bn_param", "PSPNet"),
    ("pooling_param { pool: MAX kernel_size: 3 stride: 2 ceil_mode: false }", "Pooling", "ceil_mode",
     "round_mode: FLOOR"),
]


@pytest.mark.parametrize("body,ltype,field,mention", FORK_CASES)
def test_fork_only_fields_name_file_line_layer_field_and_fork(tmp_path, body, ltype, field, mention):
    path = tmp_path / "fork.prototxt"
    path.write_text(textwrap.dedent(f"""\
        name: "forknet"
        layer {{ name: "data" type: "Input" top: "data" input_param {{ shape {{ dim: 1 dim: 3 dim: 8 dim: 8 }} }} }}
        layer {{
          name: "fork_layer"
          type: "{ltype}"
          bottom: "data"
          top: "out"
          {body}
        }}
        """))
    with pytest.raises(ProtoParseError) as info:
        read_net_prototxt(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}:8:")
    assert f"layer 'fork_layer' (type {ltype})" in msg
    assert f"'{field}'" in msg and mention in msg and "not to BVLC Caffe" in msg


def test_unknown_field_names_the_layer_even_when_its_name_comes_later():
    text = 'layer {\n  type: "Convolution"\n  convolution_param { num_output: 1 kernal_size: 3 }\n  name: "c1"\n}\n'
    with pytest.raises(ProtoParseError) as info:
        parse_text(text, caffe_pb2.NetParameter(), "x.prototxt")
    msg = str(info.value)
    assert msg.startswith("x.prototxt:3:")
    assert "layer 'c1' (type Convolution)" in msg and "'kernal_size' is not a field of BVLC Caffe's " \
        "ConvolutionParameter" in msg
    with pytest.raises(ProtoParseError, match=r"x.prototxt:1:1: .*Expected identifier"):
        parse_text("{", caffe_pb2.NetParameter(), "x.prototxt")  # other syntax errors unchanged


def test_caffe_io_is_a_float64_wrapper_of_cct_conversions():
    blob = caffe_pb2.BlobProto(num=1, channels=2, height=1, width=2, data=[0.1, 0.2, 0.3, 0.4])
    arr = caffe.io.blobproto_to_array(blob)
    assert arr.dtype == np.float64 and arr.shape == (1, 2, 1, 2)
    np.testing.assert_array_equal(arr, blobproto_to_array(blob).astype(np.float64))  # float32 values
    assert caffe.io.blobproto_to_array(caffe_pb2.BlobProto(data=[123.0])) == 123  # no shape: 0-d
    with pytest.raises(ValueError):
        caffe.io.blobproto_to_array(caffe_pb2.BlobProto(data=[1.0, 2.0]))  # no shape, two values
    x = np.arange(6, dtype=np.float64).reshape(2, 3) / 7
    assert caffe.io.array_to_blobproto(x) == array_to_blobproto(x)
    back = caffe.io.blobprotovector_str_to_arraylist(caffe.io.arraylist_to_blobprotovector_str([x, x[0]]))
    np.testing.assert_array_equal(back[0], x.astype(np.float32))
    assert back[1].shape == (3,)

    pixels = np.arange(12, dtype=np.uint8).reshape(3, 2, 2)
    d = caffe.io.array_to_datum(pixels)
    assert not d.HasField("label") and caffe.io.array_to_datum(pixels, label=0).HasField("label")
    out = caffe.io.datum_to_array(d)
    assert out.dtype == np.uint8 and out.flags.writeable
    np.testing.assert_array_equal(out, pixels)
    floats = caffe.io.datum_to_array(caffe.io.array_to_datum(pixels / 3.0, label=4))
    assert floats.dtype == np.float64
    np.testing.assert_array_equal(floats, (pixels / 3.0).astype(np.float32))
    with pytest.raises(ValueError, match="Incorrect array shape"):
        caffe.io.array_to_datum(np.zeros((2, 2)))


@pytest.mark.parametrize("ltype,mention", [("ReLU6", "Clip with min: 0 max: 6"), ("PriorBox", "SSD"),
                                           ("ConvolutionDepthwise", "group = num_output")])
def test_fork_only_layer_types_say_where_they_come_from(tmp_path, ltype, mention):
    path = tmp_path / "fork_type.prototxt"
    path.write_text('layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 2 } } }\n'
                    f'layer {{ name: "odd" type: "{ltype}" bottom: "data" top: "out" }}\n')
    with pytest.raises(cct.LayerError) as info:
        cct.Net(str(path), cct.TEST)
    msg = str(info.value)
    assert f"layer 'odd' (type {ltype}): unknown layer type '{ltype}'" in msg
    assert "not of BVLC Caffe" in msg and mention in msg
