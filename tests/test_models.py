"""models/: the shipped prototxts are the upstream Caffe ones (paths aside), they build, and LeNet trains."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cct.io.prototxt import parse_text, read_net_prototxt
from cct.paths import shared_path
from cct.proto import caffe_pb2

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
UPSTREAM = Path(os.environ.get("CCT_CAFFE_MODELS", shared_path("caffe-models")))
SHAPES = Path(os.environ.get("CCT_REFERENCE", shared_path("reference"))) / "shapes.json"

# (ours, upstream, {upstream path: our path})
NETS = [
    ("lenet/lenet_train_test.prototxt", "mnist/lenet_train_test.prototxt",
     {"examples/mnist/mnist_train_lmdb": "data/digits/digits_train_lmdb",
      "examples/mnist/mnist_test_lmdb": "data/digits/digits_test_lmdb"}),
    ("lenet/lenet.prototxt", "mnist/lenet.prototxt", {}),
    ("cifar10_quick/cifar10_quick_train_test.prototxt", "cifar10/cifar10_quick_train_test.prototxt",
     {"examples/cifar10/": "data/cifar10/"}),
    ("cifar10_quick/cifar10_quick.prototxt", "cifar10/cifar10_quick.prototxt", {}),
    ("caffenet/train_val.prototxt", "bvlc_reference_caffenet/train_val.prototxt",
     {"examples/imagenet/": "data/ilsvrc12/"}),
    ("caffenet/deploy.prototxt", "bvlc_reference_caffenet/deploy.prototxt", {}),
    ("alexnet/train_val.prototxt", "bvlc_alexnet/train_val.prototxt", {"examples/imagenet/": "data/ilsvrc12/"}),
    ("alexnet/deploy.prototxt", "bvlc_alexnet/deploy.prototxt", {}),
]
SOLVERS = [
    ("lenet/lenet_solver.prototxt", "mnist/lenet_solver.prototxt", "runs/lenet/lenet"),
    ("cifar10_quick/cifar10_quick_solver.prototxt", "cifar10/cifar10_quick_solver.prototxt",
     "runs/cifar10_quick/cifar10_quick"),
    ("caffenet/solver.prototxt", "bvlc_reference_caffenet/solver.prototxt", "runs/caffenet/caffenet_train"),
    ("alexnet/solver.prototxt", "bvlc_alexnet/solver.prototxt", "runs/alexnet/caffe_alexnet_train"),
]

need_upstream = pytest.mark.skipif(not UPSTREAM.is_dir(), reason="upstream caffe models not available")


def _net(path: Path, subs: dict[str, str] | None = None) -> caffe_pb2.NetParameter:
    text = path.read_text()
    for a, b in (subs or {}).items():
        text = text.replace(a, b)
    return parse_text(text, caffe_pb2.NetParameter(), source=str(path))


@need_upstream
@pytest.mark.parametrize("ours,upstream,subs", NETS, ids=[n[0] for n in NETS])
def test_nets_are_upstream_layer_for_layer(ours, upstream, subs):
    mine = _net(MODELS / ours)
    theirs = _net(UPSTREAM / upstream, subs)
    assert [l.name for l in mine.layer] == [l.name for l in theirs.layer]
    for a, b in zip(mine.layer, theirs.layer):
        assert a == b, f"{ours}: layer {a.name} differs from upstream"
    assert mine == theirs


@need_upstream
@pytest.mark.parametrize("ours,upstream,prefix", SOLVERS, ids=[s[0] for s in SOLVERS])
def test_solvers_match_upstream_and_point_into_repo(ours, upstream, prefix):
    mine = parse_text((MODELS / ours).read_text(), caffe_pb2.SolverParameter())
    theirs = parse_text((UPSTREAM / upstream).read_text(), caffe_pb2.SolverParameter())
    assert mine.snapshot_prefix == prefix
    assert mine.solver_mode == caffe_pb2.SolverParameter.CPU
    assert (ROOT / mine.net).is_file() and mine.net.startswith("models/")
    for f in ("net", "snapshot_prefix", "solver_mode"):
        mine.ClearField(f)
        theirs.ClearField(f)
    assert mine == theirs


@pytest.mark.parametrize("name", ["caffenet", "alexnet"])
def test_synthetic_variant_equals_train_val_after_the_data_layer(name):
    synth = _net(MODELS / name / "train_val_synthetic.prototxt")
    real = _net(MODELS / name / "train_val.prototxt")
    assert synth.layer[0].type == "DummyData" and list(synth.layer[0].top) == ["data", "label"]
    assert [list(s.dim) for s in synth.layer[0].dummy_data_param.shape] == [[256, 3, 227, 227], [256]]
    real_rest = [l for l in real.layer if l.type != "Data"]
    assert list(synth.layer[1:]) == real_rest
    assert synth.name == real.name


@pytest.mark.skipif(not SHAPES.is_file(), reason="reference shapes not available")
def test_synthetic_caffenet_builds_with_caffe_shapes():
    from cct.net import Net

    param = read_net_prototxt(MODELS / "caffenet" / "train_val_synthetic.prototxt")
    batch = 2
    for s in param.layer[0].dummy_data_param.shape:
        s.dim[0] = batch
    # keep the test light: fc6/fc7 with fewer outputs; their input shapes still come from the trunk
    for l in param.layer:
        if l.name in ("fc6", "fc7"):
            l.inner_product_param.num_output = 16
    param.state.phase = caffe_pb2.TRAIN
    net = Net(param)
    want = json.loads(SHAPES.read_text())["bvlc_reference_caffenet/train_val.prototxt"]["TRAIN"]
    assert net.layer_names == want["layers"]
    for blob, shape in want["blobs"].items():
        if blob in ("fc6", "fc7"):
            continue
        expect = [batch] + shape[1:] if shape else []
        assert list(net.blobs[blob].shape) == expect, blob
    assert net.layer_by_name("fc6").blobs[0].shape == (16, 256 * 6 * 6)


def test_lenet_solver_trains_from_repo_root(tmp_path, monkeypatch):
    """The README recipe: cct make_digits data/digits, then train models/lenet from the repo root
    (here a temp copy of it: models/ linked, data/ generated)."""
    from cct.solver import get_solver, read_solver_param

    (tmp_path / "models").symlink_to(MODELS, target_is_directory=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "cct", "make_digits", "data/digits", "--train", "128", "--test", "100"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    monkeypatch.chdir(tmp_path)
    param = read_solver_param("models/lenet/lenet_solver.prototxt")
    assert param.snapshot_prefix == "runs/lenet/lenet"
    param.test_initialization = False
    param.display = 0
    param.test_iter[0] = 2
    solver = get_solver(param)
    assert solver.net.blobs["data"].shape == (64, 1, 28, 28)
    assert solver.test_nets[0].blobs["data"].shape == (100, 1, 28, 28)
    losses = []
    solver.add_callback(on_gradients_ready=lambda: losses.append(float(solver.net.blobs["loss"].data)))
    solver.step(3)
    assert len(losses) == 3 and all(np.isfinite(losses)) and losses[0] == pytest.approx(np.log(10), rel=0.3)
    means = solver.test(0)
    assert len(means) == 2 and 0 <= means[0] <= 1  # accuracy, loss
    model = solver.snapshot()
    assert model == "runs/lenet/lenet_iter_3.caffemodel" and (tmp_path / model).is_file()


@pytest.mark.skipif(not SHAPES.is_file(), reason="reference shapes not available")
@pytest.mark.parametrize("ours,key", [("lenet/lenet.prototxt", "mnist/lenet.prototxt"),
                                      ("cifar10_quick/cifar10_quick.prototxt", "cifar10/cifar10_quick.prototxt")])
def test_deploy_nets_build_with_caffe_shapes(ours, key):
    from cct.net import Net

    want = json.loads(SHAPES.read_text())[key]["TEST"]
    net = Net(MODELS / ours, caffe_pb2.TEST)
    assert net.layer_names == want["layers"]
    assert {b: list(net.blobs[b].shape) for b in want["blobs"]} == want["blobs"]
