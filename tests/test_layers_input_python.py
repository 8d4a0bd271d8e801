"""Input, DummyData, MemoryData (cct/layers/input.py) and the Python layer (cct/layers/python_layer.py)."""
import textwrap

import numpy as np
import pytest

from cct import rng
from cct.blob import Blob
from cct.errors import LayerError
from cct.io import parse_text
from cct.layers import create_layer
from cct.layers.python_layer import PyBlob, PythonLayer
from cct.proto import caffe_pb2
from cct.testing import check_gradient, make_blob


def make_layer(text: str, phase=None):
    p = caffe_pb2.LayerParameter()
    parse_text(text, p)
    if not p.name:
        p.name = "L"
    if phase is not None:
        p.phase = phase
    return create_layer(p)


def tops(n, dtype=np.float32):
    return [Blob((), dtype=dtype, name=f"t{i}") for i in range(n)]


# ----------------------------------------------------------------------------------------------
# Input
def test_input_shapes_per_top_one_or_none():
    t = tops(2)
    make_layer('type: "Input" input_param { shape { dim: 2 dim: 3 } shape { dim: 4 } }').setup([], t)
    assert [b.shape for b in t] == [(2, 3), (4,)]
    t = tops(3)
    make_layer('type: "Input" input_param { shape { dim: 5 dim: 1 dim: 2 } }').setup([], t)
    assert all(b.shape == (5, 1, 2) for b in t)
    t = tops(1)
    t[0].reshape((7, 2))
    layer = make_layer('type: "Input"')
    layer.setup([], t)
    t[0].reshape((3, 3))  # pycaffe's blob.reshape: kept, Input's reshape is a no-op
    layer.reshape([], t)
    layer.forward([], t)
    layer.backward(t, [], [])
    assert t[0].shape == (3, 3)


def test_input_shape_count_error():
    layer = make_layer('name: "in" type: "Input" input_param { shape { dim: 1 } shape { dim: 2 } }')
    with pytest.raises(LayerError, match="'in'.*3 tops vs. 2 shapes"):
        layer.setup([], tops(3))
    with pytest.raises(LayerError, match="bottom"):
        make_layer('type: "Input"').setup([Blob((1,))], tops(1))


# ----------------------------------------------------------------------------------------------
# DummyData
def test_dummy_data_constant_filled_once_random_refilled():
    layer = make_layer('''type: "DummyData" dummy_data_param {
        shape { dim: 2 dim: 3 } shape { dim: 4 }
        data_filler { type: "constant" value: 1.5 } data_filler { type: "gaussian" std: 1 } }''')
    t = tops(2)
    rng.set_random_seed(3)
    layer.setup([], t)
    assert t[0].shape == (2, 3) and t[1].shape == (4,)
    assert np.all(t[0].data == 1.5)
    assert np.all(t[1].data == 0)  # non-constant fillers only fill at forward (Caffe's refill_)
    layer.forward([], t)
    first = t[1].data.copy()
    assert np.all(first != 0)
    t[0].data[...] = 9  # constant tops are not refilled
    layer.forward([], t)
    assert np.all(t[0].data == 9)
    assert not np.array_equal(first, t[1].data)


def test_dummy_data_defaults_and_legacy_dims():
    layer = make_layer('type: "DummyData" dummy_data_param { num: 2 channels: 3 height: 1 width: 4 '
                       'num: 5 channels: 1 height: 1 width: 1 }')
    t = tops(2)
    layer.setup([], t)
    layer.forward([], t)
    assert t[0].shape == (2, 3, 1, 4) and t[1].shape == (5, 1, 1, 1)
    assert np.all(t[0].data == 0) and np.all(t[1].data == 0)
    # one uniform filler for all tops
    layer = make_layer('type: "DummyData" dummy_data_param { shape { dim: 10 } '
                       'data_filler { type: "uniform" min: 2 max: 3 } }')
    t = tops(2)
    layer.setup([], t)
    layer.forward([], t)
    for b in t:
        assert b.shape == (10,) and np.all((b.data >= 2) & (b.data <= 3))


@pytest.mark.parametrize("text,msg", [
    ('shape { dim: 1 } data_filler { } data_filler { } data_filler { }', "data fillers"),
    ('shape { dim: 1 } num: 1 channels: 1 height: 1 width: 1', "both shape and legacy"),
    ('num: 1 num: 1 num: 1 channels: 1 height: 1 width: 1', "'num'"),
    ('shape { dim: 1 } shape { dim: 1 } shape { dim: 1 }', "'shape' once"),
    ('shape { dim: 1 } data_filler { type: "nope" }', "unknown filler"),
])
def test_dummy_data_errors(text, msg):
    layer = make_layer(f'name: "dd" type: "DummyData" dummy_data_param {{ {text} }}')
    with pytest.raises(LayerError, match=msg):
        layer.setup([], tops(2))


# ----------------------------------------------------------------------------------------------
# MemoryData
MD = 'name: "md" type: "MemoryData" memory_data_param { batch_size: 2 channels: 3 height: 2 width: 1 }'


def test_memory_data_serves_batches_and_wraps():
    layer = make_layer(MD)
    t = tops(2)
    layer.setup([], t)
    assert t[0].shape == (2, 3, 2, 1) and t[1].shape == (2,)
    data = np.arange(6 * 6, dtype=np.float32).reshape(6, 3, 2, 1)
    lab = np.arange(6, dtype=np.float32) + 10
    layer.set_input_arrays(data, lab)
    for step in range(4):
        layer.reshape([], t)
        layer.forward([], t)
        i = (2 * step) % 6
        np.testing.assert_array_equal(t[0].data, data[i:i + 2])
        assert t[1].shape == (2, 1, 1, 1)  # Caffe reshapes the label top to (N, 1, 1, 1) in forward
        np.testing.assert_array_equal(t[1].data.reshape(-1), lab[i:i + 2])
    # reset() restarts at row 0 with the first n rows
    layer.reset(data[2:], lab[2:], 2)
    layer.forward([], t)
    np.testing.assert_array_equal(t[0].data, data[2:4])
    layer.forward([], t)
    np.testing.assert_array_equal(t[0].data, data[2:4])


def test_memory_data_errors():
    layer = make_layer(MD)
    t = tops(2)
    layer.setup([], t)
    with pytest.raises(LayerError, match="reset"):
        layer.forward([], t)
    good = np.zeros((4, 3, 2, 1), np.float32)
    lab = np.zeros(4, np.float32)
    with pytest.raises(LayerError, match="multiple of batch size"):
        layer.set_input_arrays(good[:3], lab[:3])
    with pytest.raises(LayerError, match="wrong number of channels"):
        layer.set_input_arrays(np.zeros((4, 2, 2, 1), np.float32), lab)
    with pytest.raises(LayerError, match="wrong height"):
        layer.set_input_arrays(np.zeros((4, 3, 1, 1), np.float32), lab)
    with pytest.raises(LayerError, match="must be float32"):
        layer.set_input_arrays(good.astype(np.int32), lab)
    with pytest.raises(LayerError, match="4-d"):
        layer.set_input_arrays(good.reshape(4, 6), lab)
    with pytest.raises(LayerError, match="C contiguous"):
        layer.set_input_arrays(np.asfortranarray(np.zeros((4, 3, 2, 2), np.float32))[..., :1], lab)
    with pytest.raises(LayerError, match="same first dimension"):
        layer.set_input_arrays(good, np.zeros(2, np.float32))
    with pytest.raises(LayerError, match="multiple of batch size"):
        layer.reset(good, lab, 3)
    with pytest.raises(LayerError, match="'md'.*positive"):
        make_layer('name: "md" type: "MemoryData" memory_data_param { batch_size: 2 channels: 3 }')
    with pytest.raises(LayerError, match="transform_param"):
        make_layer(MD + ' transform_param { scale: 0.5 }')
    make_layer(MD + ' transform_param { scale: 1 }')  # trivial: accepted
    with pytest.raises(LayerError, match="2 top"):
        make_layer(MD).setup([], tops(1))


# ----------------------------------------------------------------------------------------------
# Python layer
MODULE = textwrap.dedent('''
    import numpy as np
    from cct.layers.python_layer import PythonLayer


    class ScaleLayer(PythonLayer):
        """y = w * x + offset (offset from param_str), learnable scalar w."""

        def setup(self, bottom, top):
            self.offset = float(self.param_str or 0)
            self.seen_phase = self.phase
            self.blobs.add_blob(1)
            self.blobs[0].data[...] = 1.5

        def reshape(self, bottom, top):
            top[0].reshape(*bottom[0].data.shape)

        def forward(self, bottom, top):
            top[0].data[...] = self.blobs[0].data[0] * bottom[0].data + self.offset

        def backward(self, top, propagate_down, bottom):
            if propagate_down[0]:
                bottom[0].diff[...] = self.blobs[0].data[0] * top[0].diff
            self.blobs[0].diff[0] += (top[0].diff * bottom[0].data).sum()


    class SumSqLoss(PythonLayer):
        def reshape(self, bottom, top):
            top[0].reshape([])

        def forward(self, bottom, top):
            top[0].data[...] = (bottom[0].data ** 2).sum() / 2

        def backward(self, top, propagate_down, bottom):
            bottom[0].diff[...] = bottom[0].data * top[0].diff


    class Legacy4D(PythonLayer):
        def setup(self, bottom, top):
            b = bottom[0]
            self.dims = (b.num, b.channels, b.height, b.width, b.count, tuple(b.shape))

        def reshape(self, bottom, top):
            top[0].reshape(bottom[0].num, bottom[0].count // bottom[0].num)

        def forward(self, bottom, top):
            top[0].data[...] = bottom[0].data.reshape(top[0].data.shape)
''')


@pytest.fixture
def pymodule(tmp_path, monkeypatch):
    name = f"cct_test_pylayer_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def py_layer(module, cls, extra="", phase=None):
    return make_layer(f'name: "py" type: "Python" python_param {{ module: "{module}" layer: "{cls}" {extra} }}',
                      phase=phase)


def test_python_layer_forward_backward_param_str_phase(pymodule):
    layer = py_layer(pymodule, "ScaleLayer", 'param_str: "0.25"', phase=caffe_pb2.TEST)
    x = np.random.default_rng(0).standard_normal((2, 3))
    b, t = make_blob(x), Blob((), dtype=np.float64)
    layer.setup([b], [t])
    user = layer.user
    assert isinstance(user, PythonLayer)
    assert user.param_str == "0.25" and user.phase == caffe_pb2.TEST == user.seen_phase
    assert len(layer.blobs) == 1 and layer.blobs[0].shape == (1,) and layer.blobs[0].dtype == np.float64
    layer.reshape([b], [t])
    layer.forward([b], [t])
    np.testing.assert_allclose(t.data, 1.5 * x + 0.25)
    check_gradient(layer, [b], [t], setup=False)
    assert layer.loss_weight(0) == 0.0


def test_python_layer_gradient_from_setup(pymodule):
    x = np.random.default_rng(1).standard_normal((3, 2))
    check_gradient(py_layer(pymodule, "ScaleLayer"), [make_blob(x)], [Blob((), dtype=np.float64)])


def test_python_loss_layer_weight_from_prototxt(pymodule):
    layer = make_layer(f'name: "pl" type: "Python" loss_weight: 2 '
                       f'python_param {{ module: "{pymodule}" layer: "SumSqLoss" }}')
    assert layer.loss_weight(0) == 2.0
    x = np.array([[1.0, -2.0]])
    b, t = make_blob(x), Blob((), dtype=np.float64)
    layer.setup([b], [t])
    layer.forward([b], [t])
    assert t.shape == () and float(t.data) == pytest.approx(2.5)
    t.diff[...] = 2.0
    layer.backward([t], [True], [b])
    np.testing.assert_allclose(b.diff, 2 * x)


def test_python_layer_pycaffe_blob_api(pymodule):
    layer = py_layer(pymodule, "Legacy4D")
    b, t = make_blob(np.zeros((2, 3, 4))), Blob(())
    layer.setup([b], [t])
    assert layer.user.dims == (2, 3, 4, 1, 24, (2, 3, 4))
    assert t.shape == (2, 12)
    pb = PyBlob(Blob((1,)))
    pb.reshape(2, 3)
    assert pb.shape == (2, 3) and pb.data.shape == (2, 3)
    pb.reshape((4,))
    assert pb.count == 4


def test_python_layer_blobs_visible_and_assignable(pymodule):
    layer = py_layer(pymodule, "ScaleLayer")
    b, t = make_blob(np.ones((1, 2))), Blob((), dtype=np.float64)
    layer.setup([b], [t])
    user = layer.user
    user.blobs.add_blob(2, 3)
    assert layer.blobs[1].shape == (2, 3)
    user.blobs[1] = Blob((5,), dtype=np.float64)
    assert layer.blobs[1].shape == (5,)
    user.blobs = [layer.blobs[0]]
    assert len(layer.blobs) == 1
    with pytest.raises(TypeError):
        user.blobs.add_blob(1, foo=2)


def test_python_layer_import_errors(pymodule, tmp_path):
    with pytest.raises(LayerError, match="'py'.*no_such_module_xyz"):
        py_layer("no_such_module_xyz", "X")
    with pytest.raises(LayerError, match=f"'py'.*{pymodule}.*NoSuchClass"):
        py_layer(pymodule, "NoSuchClass")
    (tmp_path / "cct_test_broken_mod.py").write_text("raise RuntimeError('boom at import')\n")
    with pytest.raises(LayerError, match="cct_test_broken_mod.*boom at import"):
        py_layer("cct_test_broken_mod", "X")
    with pytest.raises(LayerError, match="module"):
        make_layer('type: "Python" python_param { layer: "X" }')


def test_python_layer_share_in_parallel_accepted(pymodule):
    layer = py_layer(pymodule, "ScaleLayer", "share_in_parallel: true")
    assert layer.share_in_parallel
