"""proto/caffe.proto equals BVLC Caffe master's caffe.proto message for message, field for field.

tests/data/bvlc_fields.json is the field list of BVLC's src/caffe/proto/caffe.proto (written by
tools/bvlc_fields.py from the commit named in its "source"); cct's generated module must describe
exactly the same messages, field names, numbers, labels, types, defaults and enum values.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from cct.blob import Blob
from cct.io import parse_text
from cct.layers import create_layer
from cct.layers.pooling import pooled_size
from cct.proto import caffe_pb2
from cct.proto.fieldlist import describe_module, differences

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "bvlc_fields.json")


@pytest.fixture(scope="module")
def bvlc():
    with open(DATA) as f:
        return json.load(f)


def test_reference_list_is_bvlc_master(bvlc):
    assert bvlc["source"]["repository"] == "BVLC/caffe"
    assert bvlc["package"] == "caffe"
    assert len(bvlc["messages"]) == 63
    # the two fields BVLC master added after the 1.0 release that cct once lacked
    pool = {f["name"]: f for f in bvlc["messages"]["PoolingParameter"]}
    assert pool["round_mode"] == {"name": "round_mode", "number": 13, "label": "optional", "type": "enum",
                                  "type_name": "caffe.PoolingParameter.RoundMode", "default": "CEIL"}
    assert bvlc["enums"]["PoolingParameter.RoundMode"] == {"CEIL": 0, "FLOOR": 1}
    info = {f["name"]: f for f in bvlc["messages"]["InfogainLossParameter"]}
    assert info["axis"]["number"] == 2 and info["axis"]["default"] == "1"


def test_cct_proto_equals_bvlc_master(bvlc):
    assert differences(bvlc, describe_module(caffe_pb2)) == []


def test_differences_reports_every_kind_of_mismatch(bvlc):
    ours = copy.deepcopy(bvlc)
    pool = ours["messages"]["PoolingParameter"]
    ours["messages"]["PoolingParameter"] = [f for f in pool if f["name"] != "round_mode"]
    next(f for f in ours["messages"]["InfogainLossParameter"] if f["name"] == "axis")["default"] = "2"
    ours["messages"]["ForkParameter"] = []
    del ours["enums"]["PoolingParameter.RoundMode"]
    diffs = differences(bvlc, ours)
    assert "PoolingParameter.round_mode (= 13) missing" in diffs
    assert any(d.startswith("InfogainLossParameter.axis:") for d in diffs)
    assert "message ForkParameter is not in the reference" in diffs
    assert "enum PoolingParameter.RoundMode missing" in diffs
    assert len(diffs) == 4


@pytest.mark.parametrize("size,kernel,pad,stride,ceil_out,floor_out", [
    (7, 2, 0, 2, 4, 3),    # DenseNet-style: 7x7 -> 3x3 only with FLOOR
    (8, 3, 0, 2, 4, 3),
    (6, 2, 0, 2, 3, 3),    # exact division: both agree
    (6, 3, 1, 2, 4, 3),    # ceil 4 (last window starts inside), floor 3
    (5, 2, 1, 2, 3, 3),    # ceil 4 -> drop rule 3; floor 3
])
def test_pooled_size_round_modes(size, kernel, pad, stride, ceil_out, floor_out):
    PP = caffe_pb2.PoolingParameter
    assert pooled_size(size, kernel, pad, stride) == ceil_out
    assert pooled_size(size, kernel, pad, stride, round_mode=PP.CEIL) == ceil_out
    assert pooled_size(size, kernel, pad, stride, round_mode=PP.FLOOR) == floor_out


def _pool(text: str, shape) -> tuple:
    lp = caffe_pb2.LayerParameter()
    parse_text(f'name: "p" type: "Pooling" bottom: "x" top: "y" pooling_param {{ {text} }}', lp)
    layer = create_layer(lp)
    x = Blob(shape)
    x.data[...] = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    y = Blob(())
    layer.setup([x], [y])
    layer.forward([x], [y])
    return layer, x, y


def test_pooling_round_mode_floor_drops_the_partial_window():
    _, _, y = _pool("pool: MAX kernel_size: 2 stride: 2 round_mode: FLOOR", (1, 1, 5, 5))
    assert y.shape == (1, 1, 2, 2)
    np.testing.assert_array_equal(y.data[0, 0], [[6, 8], [16, 18]])
    _, _, y = _pool("pool: MAX kernel_size: 2 stride: 2", (1, 1, 5, 5))
    assert y.shape == (1, 1, 3, 3)
    np.testing.assert_array_equal(y.data[0, 0], [[6, 8, 9], [16, 18, 19], [21, 23, 24]])
    _, _, y = _pool("pool: AVE kernel_size: 3 stride: 2 pad: 1 round_mode: FLOOR", (1, 1, 6, 6))
    assert y.shape == (1, 1, 3, 3)
    # top-left window covers rows/cols -1..1 of the padded input: (0 + 1 + 6 + 7) / 9
    assert y.data[0, 0, 0, 0] == pytest.approx(14 / 9)


@pytest.mark.skipif(importlib.util.find_spec("grpc_tools") is None, reason="grpc_tools not installed")
def test_field_list_tool_reads_a_proto_file_as_the_generated_module_describes_it(tmp_path):
    # tools/bvlc_fields.py (protoc's descriptor of a .proto file) and describe_module (the descriptor
    # embedded in generated code) must agree, or the BVLC list could not be compared with cct's module.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "fields.json"
    r = subprocess.run([sys.executable, os.path.join(root, "tools", "bvlc_fields.py"),
                        os.path.join(root, "proto", "caffe.proto"), "--commit", "HEAD", "-o", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    with open(out) as f:
        listed = json.load(f)
    assert listed.pop("source")["commit"] == "HEAD"
    assert listed == describe_module(caffe_pb2)
