"""Bad input gets a clean cct error naming where it is (file:line:col, layer, blob, iteration, item)."""
from __future__ import annotations

import numpy as np
import pytest

import cct
from cct.config import Config, using_config
from cct.errors import CctError, LayerError, MemoryBudgetError, ProtoParseError
from cct.io.blobproto import array_to_blobproto, blobproto_to_array, check_blobproto
from cct.io.prototxt import parse_text, read_net_prototxt
from cct.layers import base
from cct.layers.base import Layer, register
from cct.membudget import INT_MAX, check_blob_size, default_budget, parse_size, physical_memory
from cct.proto import caffe_pb2

INPUT = 'layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } } }\n'
IP2 = 'layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" inner_product_param { num_output: 2 } }'


def net_of(text: str, config: Config | None = None, phase=cct.TEST) -> cct.Net:
    return cct.Net(parse_text(text, caffe_pb2.NetParameter()), phase, config=config)


# -- undecodable prototxt bytes -----------------------------------------------------------------
def test_non_utf8_prototxt_names_file_line_column(tmp_path):
    path = tmp_path / "net.prototxt"
    path.write_bytes(b'name: "n"\n# comment\nlayer { \xff name: "in" type: "Input" }\n')
    with pytest.raises(ProtoParseError) as e:
        read_net_prototxt(path)
    assert str(e.value).startswith(f"{path}:3:9: invalid UTF-8 byte 0xff")
    path.write_bytes(b'name: "caf\xc3"\n')  # a truncated two-byte sequence at the end of a string
    with pytest.raises(ProtoParseError, match=rf"^{path}:1:11: invalid UTF-8 byte 0xc3"):
        read_net_prototxt(path)
    with pytest.raises(ProtoParseError, match=r"net.prototxt:1:11"):
        cct.Net(str(path), cct.TEST)


def test_utf8_prototxt_still_reads(tmp_path):
    path = tmp_path / "net.prototxt"
    path.write_bytes('name: "café"\n'.encode() + INPUT.encode())
    assert read_net_prototxt(path).name == "café"


# -- blob sizes: INT_MAX and the memory budget ----------------------------------------------------
@pytest.mark.parametrize("text,layer,blob,shape", [
    ('layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2147483647 dim: 3 } } }',
     "in", "x", [2147483647, 3]),
    (INPUT + 'layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" '
             'inner_product_param { num_output: 2147483647 } }', "ip", "ip", [2147483647, 192]),
    (INPUT + 'layer { name: "conv" type: "Convolution" bottom: "x" top: "y" '
             'convolution_param { num_output: 2 kernel_size: 3 pad: 100000 } }', "conv", "y", [2, 2, 200006, 200006]),
])
def test_huge_dimension_refused_before_allocation(text, layer, blob, shape):
    with pytest.raises(LayerError) as e:
        net_of(text)
    assert e.value.layer_name == layer
    assert f"setup: blob '{blob}' shape {shape}: blob size exceeds INT_MAX" in str(e.value)
    assert isinstance(e.value.__cause__, MemoryBudgetError)


def test_memory_budget_names_layer_blob_shape_bytes():
    text = INPUT + ('layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" '
                    'inner_product_param { num_output: 1000 } }')
    with pytest.raises(LayerError) as e:
        net_of(text, Config(memory_budget=1 << 20))
    msg = str(e.value)
    # the weights (1000 x 192 floats, data and diff) are the first blob over 1 MiB
    assert msg.startswith("layer 'ip' (type InnerProduct): setup: blob 'ip' shape [1000, 192] needs 1536000 bytes")
    assert "memory budget of 1048576 bytes (1.0 MiB" in msg
    net = net_of(text, Config(memory_budget=2 << 20))  # fits
    assert net.blobs["y"].shape == (2, 1000)
    with using_config(memory_budget=None):
        assert net_of(text).blobs["y"].shape == (2, 1000)


def test_memory_budget_on_reshape_names_layer_and_stage():
    net = net_of(INPUT + 'layer { name: "relu" type: "ReLU" bottom: "x" top: "y" }', Config(memory_budget=1 << 16))
    net.blobs["x"].reshape(4, 3, 32, 32)  # the caller's own blob: checked against the current config
    with pytest.raises(LayerError, match=r"^layer 'relu' \(type ReLU\): reshape: blob 'y' shape \[4, 3, 32, 32\] "
                                         r"needs 98304 bytes"):
        net.forward()


def test_check_blob_size_and_parse_size(monkeypatch):
    check_blob_size("b", (INT_MAX,), 1, None, arrays=1)
    with pytest.raises(MemoryBudgetError, match=r"blob 'b' shape \[2, 1073741824\]: "
                                                 r"blob size exceeds INT_MAX \(2147483648 elements\)"):
        check_blob_size("b", (2, 1 << 30), 1, None)
    with pytest.raises(MemoryBudgetError, match="needs 16 bytes"):
        check_blob_size("b", (2,), 4, 15)
    assert parse_size("8G") == 8 << 30 and parse_size("512M") == 512 << 20 and parse_size("1.5GiB") == 3 << 29
    assert parse_size("123") == 123 and parse_size("0") is None and parse_size("off") is None
    with pytest.raises(MemoryBudgetError, match="CCT_MEMORY_BUDGET: cannot read 'lots'"):
        parse_size("lots")
    monkeypatch.setenv("CCT_MEMORY_BUDGET", "3M")
    assert default_budget() == 3 << 20 and Config().memory_budget == 3 << 20
    monkeypatch.delenv("CCT_MEMORY_BUDGET")
    assert default_budget() == physical_memory() and physical_memory() > 1 << 28


# -- errors inside a layer's forward/backward name the layer ------------------------------------
class _Failing(Layer):
    """Raises plain Python errors: IndexError in forward (layer "fails_forward"), ZeroDivisionError in backward."""

    def reshape(self, bottom, top):
        top[0].reshape(bottom[0].shape)

    def forward(self, bottom, top):
        if self.name == "fails_forward":
            top[0].data[...] = bottom[0].data[(99,)]  # IndexError: index 99 is out of bounds
        top[0].data[...] = bottom[0].data

    def backward(self, top, propagate_down, bottom):
        raise ZeroDivisionError("division by zero in a layer's own code")


@pytest.fixture
def failing_layer():
    register("CctTestFailing")(_Failing)
    yield
    base._REGISTRY.pop("CctTestFailing", None)


def test_forward_and_backward_errors_name_the_layer(failing_layer):
    text = ('force_backward: true\n' + INPUT
            + 'layer { name: "%s" type: "CctTestFailing" bottom: "x" top: "y" }\n'
              'layer { name: "loss" type: "Reduction" bottom: "y" top: "loss" loss_weight: 1 }\n')
    net = net_of(text % "fails_forward")
    with pytest.raises(LayerError, match=r"^layer 'fails_forward' \(type CctTestFailing\): forward: IndexError: ") as e:
        net.forward()
    assert isinstance(e.value.__cause__, IndexError)
    net = net_of(text % "fails_backward")
    net.forward()
    with pytest.raises(LayerError, match=r"^layer 'fails_backward' \(type CctTestFailing\): backward: "
                                         r"ZeroDivisionError: division by zero in a layer's own code$"):
        net.backward()


# -- caffemodel blobs checked as Caffe's Blob::FromProto does ------------------------------------
def _proto(shape=(2, 3), **fields) -> caffe_pb2.BlobProto:
    p = array_to_blobproto(np.arange(np.prod(shape), dtype=np.float32).reshape(shape))
    for name, values in fields.items():
        getattr(p, name).extend(values)
    return p


@pytest.mark.parametrize("field,n", [("diff", 5), ("diff", 7), ("double_diff", 5), ("double_data", 1)])
def test_blobproto_wrong_length_rejected(field, n):
    with pytest.raises(CctError, match=rf"BlobProto {field} holds {n} values but its shape \[2, 3\] needs 6"):
        blobproto_to_array(_proto(**{field: [0.5] * n}))


def test_blobproto_checks_as_caffe():
    np.testing.assert_array_equal(blobproto_to_array(_proto(diff=[1] * 6), return_diff=True), np.ones((2, 3)))
    np.testing.assert_array_equal(blobproto_to_array(_proto(double_data=[2] * 6)), np.full((2, 3), 2))
    assert check_blobproto(_proto(double_diff=[1] * 6, diff=[1] * 3)) == (2, 3)  # double_diff wins, as in Caffe
    legacy = _proto((6,))
    legacy.num, legacy.channels, legacy.height, legacy.width = 1, 1, 2, 3  # legacy fields win over shape
    assert blobproto_to_array(legacy).shape == (1, 1, 2, 3)
    bad = caffe_pb2.BlobProto()
    bad.shape.dim.extend([-1, 2])
    with pytest.raises(CctError, match="negative dimension"):
        check_blobproto(bad)
    bad.shape.dim[:] = [65536, 65536]
    with pytest.raises(CctError, match="exceeds INT_MAX"):
        check_blobproto(bad)
    bad.shape.dim[:] = [1] * 33
    with pytest.raises(CctError, match="33 axes"):
        check_blobproto(bad)


def test_caffemodel_with_wrong_diff_length_is_rejected(tmp_path):
    text = INPUT + IP2
    net = net_of(text)
    proto = net.to_proto(write_diff=True)
    del proto.layer[1].blobs[1].diff[-1]
    path = tmp_path / "w.caffemodel"
    path.write_bytes(proto.SerializeToString())
    with pytest.raises(CctError, match=rf"^{path}: layer 'ip': BlobProto diff holds 1 values but its shape \[2\] "
                                       r"needs 2"):
        net.copy_from(str(path))
    proto.layer[1].blobs[1].diff.append(0.0)
    path.write_bytes(proto.SerializeToString())
    net.copy_from(str(path))


# -- labels out of range: the iteration and the item ---------------------------------------------
SOLVER_NET = """
layer { name: "data" type: "DummyData" top: "x" top: "label"
  dummy_data_param { shape { dim: 4 dim: 5 } shape { dim: 4 }
                     data_filler { type: "gaussian" } data_filler { type: "constant" value: %s } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" inner_product_param { num_output: 3 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "y" bottom: "label" top: "loss" }
"""


def test_label_out_of_range_names_item_and_iteration():
    net = net_of(INPUT + 'layer { name: "lab" type: "Input" top: "l" input_param { shape { dim: 2 } } }\n'
                 + IP2.replace("num_output: 2", "num_output: 5") + "\n"
                 'layer { name: "acc" type: "Accuracy" bottom: "y" bottom: "l" top: "a" }\n')
    net.blobs["l"].data[...] = [1, 9]
    with pytest.raises(LayerError, match=r"^layer 'acc' \(type Accuracy\): label value 9 out of range \[0, 5\) "
                                         r"at item 1 of the batch \(bottom\[1\]\)$"):
        net.forward()
    from cct.solver import get_solver

    param = parse_text('base_lr: 0.1 lr_policy: "fixed" max_iter: 3 snapshot_after_train: false',
                       caffe_pb2.SolverParameter())
    parse_text(SOLVER_NET % 3, param.net_param)
    param.solver_mode = caffe_pb2.SolverParameter.CPU
    with pytest.raises(LayerError, match=r"^layer 'loss' \(type SoftmaxWithLoss\): label value 3 out of range "
                                         r"\[0, 3\) at item 0 of the batch \(bottom\[1\]\) "
                                         r"\(train net, iteration 0\)$"):
        get_solver(param).solve()


# -- damaged HDF5 ---------------------------------------------------------------------------------
def test_damaged_hdf5_weights_clean_error(tmp_path):
    text = INPUT + IP2
    net = net_of(text)
    good = tmp_path / "w.caffemodel.h5"
    net.save_hdf5(str(good))
    raw = good.read_bytes()
    damaged = 0
    for start in range(0, len(raw), 97):  # zero a run of bytes everywhere in the file, one place at a time
        path = tmp_path / f"d{start}.h5"
        path.write_bytes(raw[:start] + bytes(len(raw[start:start + 48])) + raw[start + 48:])
        try:
            net.copy_from(str(path))
        except CctError as e:
            damaged += "damaged HDF5 file" in str(e) or "not a readable HDF5 file" in str(e)
            assert str(path) in str(e)
    assert damaged > 0
