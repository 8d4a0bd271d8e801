"""Blob diffs are allocated on first use: a forward-only net holds no gradient arrays; training is unchanged."""
from __future__ import annotations

import numpy as np

import cct
from cct.blob import Blob
from cct.io.prototxt import parse_text
from cct.proto import caffe_pb2

NET = """
name: "lazy"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "flat" type: "Flatten" bottom: "conv" top: "flat" }
layer { name: "ip" type: "InnerProduct" bottom: "flat" top: "ip"
        inner_product_param { num_output: 5 weight_filler { type: "xavier" } } }
"""


def _net(force_backward: bool = False):
    param = caffe_pb2.NetParameter()
    parse_text(NET, param)
    param.force_backward = force_backward
    return cct.Net(param, cct.TEST)


def test_forward_only_allocates_no_activation_diff():
    net = _net()
    net.blobs["data"].data[...] = np.random.default_rng(0).standard_normal((2, 3, 8, 8))
    net.forward()
    assert [name for name, b in net.blobs.items() if b.has_diff] == []
    assert float(np.abs(net.blobs["ip"].data).sum()) > 0


def test_backward_allocates_and_shared_diffs_alias():
    net = _net(force_backward=True)
    net.blobs["data"].data[...] = np.random.default_rng(0).standard_normal((2, 3, 8, 8))
    net.forward()
    net.blobs["ip"].diff[...] = 1.0
    net.backward()
    flat, conv = net.blobs["flat"], net.blobs["conv"]
    assert np.shares_memory(flat.diff, conv.diff)  # Flatten shares its bottom's diff (Caffe's ShareDiff)
    np.testing.assert_array_equal(flat.diff.reshape(conv.shape), conv.diff)
    assert float(np.abs(net.blobs["data"].diff).sum()) > 0


def test_lazy_diff_is_zero_and_follows_reshape():
    b = Blob((2, 3))
    assert not b.has_diff
    np.testing.assert_array_equal(b.diff, np.zeros((2, 3), np.float32))
    b.diff[...] = 5
    b.reshape((4,))
    assert not b.has_diff and b.diff.shape == (4,) and not b.diff.any()
    other = Blob((2, 2))
    b.share_diff(other, shape=(4,))
    assert not other.has_diff and not b.has_diff  # bound, allocated on first use of either
    b.diff[...] = 3
    np.testing.assert_array_equal(other.diff, np.full((2, 2), 3, np.float32))
