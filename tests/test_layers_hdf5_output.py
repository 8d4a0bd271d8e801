"""HDF5Output (cct/layers/hdf5_output.py): datasets 'data' and 'label' with Caffe's legacy 4-D
shapes and dtypes, one batch per file, errors naming the layer; a net writes and HDF5Data reads back."""
from __future__ import annotations

import h5py
import numpy as np
import pytest

from cct.errors import LayerError
from cct.io.prototxt import parse_text
from cct.layers import create_layer
from cct.proto import caffe_pb2
from cct.testing import make_blob


def make_layer(path, name="out"):
    lp = caffe_pb2.LayerParameter()
    parse_text(f'name: "{name}" type: "HDF5Output" bottom: "d" bottom: "l" '
               f'hdf5_output_param {{ file_name: "{path}" }}', lp)
    return create_layer(lp)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_hdf5_output_writes_legacy_4d_datasets(tmp_path, dtype):
    path = tmp_path / "out.h5"
    layer = make_layer(path)
    data = np.arange(2 * 3 * 4, dtype=dtype).reshape(2, 3, 4)
    label = np.array([1, 0], dtype=dtype)
    bottom = [make_blob(data), make_blob(label)]
    layer.setup(bottom, [])
    with h5py.File(path, "r") as f:  # created (empty) at setup
        assert list(f.keys()) == []
    layer.reshape(bottom, [])
    layer.forward(bottom, [])
    with h5py.File(path, "r") as f:
        assert f["data"].shape == (2, 3, 4, 1) and f["label"].shape == (2, 1, 1, 1)
        assert f["data"].dtype == dtype and f["label"].dtype == dtype
        np.testing.assert_array_equal(f["data"][...].reshape(2, 3, 4), data)
        np.testing.assert_array_equal(f["label"][...].ravel(), label)
    bottom[0].diff[...] = 5
    layer.backward([], [True, False], bottom)
    assert np.all(bottom[0].diff == 0)
    with pytest.raises(LayerError, match="out.*dataset 'data'.*one batch per file"):
        layer.forward(bottom, [])


def test_hdf5_output_errors(tmp_path):
    layer = make_layer(tmp_path / "a.h5", name="o1")
    bottom = [make_blob(np.zeros((2, 3))), make_blob(np.zeros((3,)))]
    layer.setup(bottom, [])
    with pytest.raises(LayerError, match="o1.*same batch size"):
        layer.forward(bottom, [])
    layer = make_layer(tmp_path / "b.h5", name="o2")
    bottom = [make_blob(np.zeros((2, 1, 1, 1, 3))), make_blob(np.zeros((2,)))]
    layer.setup(bottom, [])
    with pytest.raises(LayerError, match="o2.*at most 4 axes"):
        layer.forward(bottom, [])
    with pytest.raises(LayerError, match="o3.*Failed to open HDF5 file"):
        make_layer(tmp_path / "no_dir" / "c.h5", name="o3").setup(bottom, [])
    with pytest.raises(LayerError, match="exactly 2 bottom"):
        make_layer(tmp_path / "d.h5").setup(bottom[:1], [])


def test_hdf5_output_in_a_net_round_trips_through_hdf5data(tmp_path):
    from cct.net import Net

    src = tmp_path / "in.h5"
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    y = np.arange(4, dtype=np.float32)
    with h5py.File(src, "w") as f:
        f["data"], f["label"] = x, y
    (tmp_path / "list.txt").write_text(f"{src}\n")
    out = tmp_path / "out.h5"
    (tmp_path / "net.prototxt").write_text(f"""
    layer {{ name: "in" type: "HDF5Data" top: "data" top: "label"
             hdf5_data_param {{ source: "{tmp_path / 'list.txt'}" batch_size: 4 }} }}
    layer {{ name: "out" type: "HDF5Output" bottom: "data" bottom: "label"
             hdf5_output_param {{ file_name: "{out}" }} }}
    """)
    net = Net(str(tmp_path / "net.prototxt"), caffe_pb2.TEST)
    net.forward()
    with h5py.File(out, "r") as f:
        np.testing.assert_array_equal(f["data"][...], x.reshape(4, 3, 1, 1))
        np.testing.assert_array_equal(f["label"][...], y.reshape(4, 1, 1, 1))
