"""Caffe's remaining tools as cct commands: upgrade_net_proto_text/binary, upgrade_solver_proto_text,
extract_features (Caffe's argument order, Datum records with float_data) and draw."""
from __future__ import annotations

import shutil
from pathlib import Path

import lmdb
import numpy as np
import pytest

from cct import cli
from cct.io.prototxt import read_text_file
from cct.net import Net
from cct.proto import caffe_pb2

DATA = Path(__file__).resolve().parent / "data"

NET = """name: "Feat"
layer { name: "data" type: "DummyData" top: "x" top: "y"
  dummy_data_param { shape { dim: 3 dim: 4 } shape { dim: 3 }
                     data_filler { type: "constant" value: 0.5 } data_filler { type: "constant" value: 1 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "ip"
  inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 1 } bias_filler { type: "gaussian" } } }
layer { name: "relu" type: "ReLU" bottom: "ip" top: "r" }
"""


def test_upgrade_net_proto_text(tmp_path, capsys):
    out = tmp_path / "lenet.prototxt"
    assert cli.main(["upgrade_net_proto_text", str(DATA / "lenet_v1_train_test.prototxt"), str(out)]) == 0
    net = read_text_file(out, caffe_pb2.NetParameter())
    assert len(net.layers) == 0 and [l.type for l in net.layer][:3] == ["Data", "Data", "Convolution"]
    assert net.layer[0].transform_param.scale == pytest.approx(0.00390625)
    assert "Wrote upgraded NetParameter text proto to " + str(out) in capsys.readouterr().err
    # already current: written back unchanged, with Caffe's message
    again = tmp_path / "again.prototxt"
    assert cli.main(["upgrade_net_proto_text", str(out), str(again)]) == 0
    assert "File already in latest proto format: " + str(out) in capsys.readouterr().err
    assert read_text_file(again, caffe_pb2.NetParameter()) == net


def test_upgrade_net_proto_binary(tmp_path):
    v1 = read_text_file(DATA / "lenet_v1_deploy.prototxt", caffe_pb2.NetParameter())
    src = tmp_path / "old.caffemodel"
    src.write_bytes(v1.SerializeToString())
    dst = tmp_path / "new.caffemodel"
    assert cli.main(["upgrade_net_proto_binary", str(src), str(dst)]) == 0
    net = caffe_pb2.NetParameter.FromString(dst.read_bytes())
    assert len(net.layers) == 0 and len(net.layer) == len(v1.layers) + 1
    assert not net.input  # the input fields became an Input layer
    assert net.layer[0].type == "Input"


def test_upgrade_solver_proto_text(tmp_path, capsys):
    out = tmp_path / "solver.prototxt"
    assert cli.main(["upgrade_solver_proto_text", str(DATA / "lenet_solver_v1.prototxt"), str(out)]) == 0
    s = read_text_file(out, caffe_pb2.SolverParameter())
    assert s.type == "Nesterov" and not s.HasField("solver_type")
    assert not s.HasField("snapshot_prefix") or s.snapshot_prefix == read_text_file(
        DATA / "lenet_solver_v1.prototxt", caffe_pb2.SolverParameter()).snapshot_prefix
    assert "Wrote upgraded SolverParameter text proto to" in capsys.readouterr().err


def test_upgrade_errors_name_the_file(tmp_path, capsys):
    bad = tmp_path / "bad.prototxt"
    bad.write_text("layer { name: 'a' type: 'ReLU' bottom: 'x' top: 'x' }\nnonsense: 1\n")
    assert cli.main(["upgrade_net_proto_text", str(bad), str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "bad.prototxt:2:" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()
    assert cli.main(["upgrade_net_proto_binary", str(bad), str(tmp_path / "o")]) == 1
    assert "bad.prototxt" in capsys.readouterr().err
    assert cli.main(["upgrade_solver_proto_text", str(tmp_path / "none"), str(tmp_path / "o")]) == 1
    assert cli.main(["upgrade_net_proto_text", str(bad)]) == 1  # OUT missing
    assert "required: OUT" in capsys.readouterr().err


def _records(path: Path) -> list[tuple[bytes, caffe_pb2.Datum]]:
    with lmdb.open(str(path), readonly=True, lock=False) as env, env.begin() as txn:
        return [(k, caffe_pb2.Datum.FromString(v)) for k, v in txn.cursor()]


def test_extract_features_caffe_argument_order_and_records(tmp_path, capsys):
    (tmp_path / "net.prototxt").write_text(NET)
    net = Net(str(tmp_path / "net.prototxt"), caffe_pb2.TEST)
    net.save(tmp_path / "w.caffemodel")
    w, b = (np.array(x.data) for x in net.layer_by_name("ip").blobs)
    db_ip, db_r = tmp_path / "ip_lmdb", tmp_path / "r_lmdb"
    rc = cli.main(["extract_features", str(tmp_path / "w.caffemodel"), str(tmp_path / "net.prototxt"), "ip,r",
                   f"{db_ip},{db_r}", "4", "lmdb", "CPU"])
    assert rc == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "Extracted features of 12 query images for feature blob ip" in err
    assert "Successfully extracted the features!" in err
    recs = _records(db_ip)
    assert sorted(k for k, _ in recs) == sorted(str(i).encode() for i in range(12))  # "%d" keys
    recs_r = dict(_records(db_r))
    for key, d in recs:
        assert (d.channels, d.height, d.width) == (1, 2, 1) and not d.data and len(d.float_data) == 2
        np.testing.assert_array_equal(np.maximum(np.array(d.float_data, np.float32), 0),
                                      np.array(recs_r[key].float_data, np.float32))
    want = np.full(4, 0.5, np.float32) @ w.T + b  # every item of the constant DummyData
    scale = np.abs(w).sum(axis=1) * 0.5 + np.abs(b)  # float32 rounding is relative to the terms summed, not the sum
    np.testing.assert_allclose(np.array(recs[0][1].float_data), want, rtol=1e-6, atol=float(scale.max()) * 1e-6)


def test_extract_features_errors(tmp_path, capsys):
    (tmp_path / "net.prototxt").write_text(NET)
    Net(str(tmp_path / "net.prototxt"), caffe_pb2.TEST).save(tmp_path / "w.caffemodel")
    base = [str(tmp_path / "w.caffemodel"), str(tmp_path / "net.prototxt")]
    cases = [
        (["nope", str(tmp_path / "a"), "1"], "Unknown feature blob name nope"),
        (["ip,r", str(tmp_path / "a"), "1"], "must be equal"),
        (["ip", str(tmp_path / "a"), "1", "mysql"], "unexpected arguments"),
        (["ip", str(tmp_path / "a"), "x"], "invalid int value"),
    ]
    for args, needle in cases:
        assert cli.main(["extract_features", *base, *args]) == 1
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, err
    (tmp_path / "exists").mkdir()
    assert cli.main(["extract_features", *base, "ip", str(tmp_path / "exists"), "1"]) == 1
    assert "exists" in capsys.readouterr().err


def test_draw(tmp_path, capsys):
    pytest.importorskip("pydot")
    net = DATA.parent.parent / "models" / "lenet" / "lenet_train_test.prototxt"
    dot = tmp_path / "lenet.dot"
    assert cli.main(["draw", str(net), str(dot), "--rankdir", "TB", "--phase", "TEST"]) == 0
    text = dot.read_text()
    assert "rankdir=TB" in text and "conv1" in text and '"mnist (Data)"' in text  # TB: one-line labels, as Caffe
    assert cli.main(["draw", str(net), str(tmp_path / "x.png"), "--phase", "VAL"]) == 1
    assert "--phase must be TRAIN, TEST or ALL" in capsys.readouterr().err
    if shutil.which("dot") is None:
        pytest.skip("graphviz 'dot' is not installed")
    png = tmp_path / "lenet.png"
    assert cli.main(["draw", str(net), str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
