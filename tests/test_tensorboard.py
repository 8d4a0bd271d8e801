"""TensorBoard events (cct.solver.tensorboard): ``get_solver(..., tensorboard=DIR)``, ``cct train --tensorboard``
and ``cct parse_log --tensorboard``, read back with TensorBoard's own reader (EventAccumulator) and compared
with the values the log prints and a direct computation (lr policy, the parsed CSV rows)."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil

import numpy as np
import pytest
from mpirun import needs_mpi, run_mpi, script

from cct.io.prototxt import parse_text
from cct.paths import shared_path
from cct.proto import caffe_pb2
from cct.solver import get_solver
from cct.tools.parse_log import parse_log

pytest.importorskip("tensorboardX")
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NET = """
name: "tb"
layer { name: "data" type: "Input" top: "x" top: "y" input_param { shape { dim: 4 dim: 3 } shape { dim: 4 dim: 2 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "out"
  inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "out" bottom: "y" top: "loss" }
"""
SOLVER = """
base_lr: 0.1 lr_policy: "step" gamma: 0.5 stepsize: 3 display: 2 max_iter: 8 test_iter: 2 test_interval: 4
test_initialization: true random_seed: 1 solver_mode: CPU snapshot_after_train: false
"""


def load_events(logdir) -> event_accumulator.EventAccumulator:
    acc = event_accumulator.EventAccumulator(str(logdir), size_guidance={event_accumulator.SCALARS: 0,
                                                                         event_accumulator.HISTOGRAMS: 0})
    acc.Reload()
    return acc


def scalars(acc, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in acc.Scalars(tag)}


def _solver_param() -> caffe_pb2.SolverParameter:
    p = parse_text(SOLVER, caffe_pb2.SolverParameter())
    parse_text(NET, p.net_param)
    return p


def _feed(solver) -> None:
    """Input blobs hold fixed data; a linear target keeps the loss finite and moving."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3)).astype(np.float32)
    for net in [solver.net, *solver.test_nets]:
        net.blobs["x"].data[...] = x
        net.blobs["y"].data[...] = x[:, :2] * 0.5


def test_solver_writes_the_logged_values_and_histograms(tmp_path, caplog):
    solver = get_solver(_solver_param(), tensorboard=tmp_path / "tb", tensorboard_histograms=4)
    _feed(solver)
    with caplog.at_level(logging.INFO, logger="cct"):
        solver.solve()
    acc = load_events(tmp_path / "tb")
    tags = acc.Tags()
    assert {"train/smoothed_loss", "train/loss", "lr", "test/loss"} <= set(tags["scalars"])
    # the displayed (smoothed) loss, as the log prints it (6 significant digits)
    logged = {int(m[1]): float(m[2])
              for m in re.finditer(r"Iteration (\d+)(?: \(.*?\))?, loss = (\S+)", caplog.text)}
    assert sorted(logged) == [0, 2, 4, 6, 8]  # every display, and the one after the last iteration
    written = scalars(acc, "train/smoothed_loss")
    for it, v in logged.items():
        assert written[it] == pytest.approx(v, rel=1e-5)
    # lr: the step policy computed directly
    assert scalars(acc, "lr") == pytest.approx({it: 0.1 * 0.5 ** (it // 3) for it in (0, 2, 4, 6)})
    # test outputs at 0, 4 and 8 (test_initialization, test_interval, the end), as the log prints them
    tests = [float(m[1]) for m in re.finditer(r"Test net output #0: loss = (\S+)", caplog.text)]
    assert sorted(scalars(acc, "test/loss")) == [0, 4, 8]
    assert list(scalars(acc, "test/loss").values()) == pytest.approx(tests, rel=1e-5)
    # histograms every 4 iterations: weights and gradients of ip's blob 0, the gradient before the update
    assert {"weights/ip/0", "gradients/ip/0"} <= set(tags["histograms"])
    assert [e.step for e in acc.Histograms("weights/ip/0")] == [0, 4]
    final = solver.net.params["ip"][0].data
    hist = acc.Histograms("weights/ip/0")[-1].histogram_value
    assert hist.num == final.size and hist.min <= final.min()


def test_parse_log_tensorboard_matches_the_csv_rows(tmp_path):
    from cct.cli import main

    log_path = os.path.join(REPO, "docs", "lenet.log")
    assert main(["parse_log", log_path, str(tmp_path), "--tensorboard", str(tmp_path / "tb")]) == 0
    train, test = parse_log(log_path)
    acc = load_events(tmp_path / "tb")
    assert scalars(acc, "test/accuracy") == pytest.approx({int(r["NumIters"]): r["accuracy"] for r in test})
    assert scalars(acc, "train/loss") == pytest.approx({int(r["NumIters"]): r["loss"] for r in train})
    assert scalars(acc, "lr") == pytest.approx({int(r["NumIters"]): r["LearningRate"] for r in train})
    assert len(test) > 5 and len(train) > 50


def test_train_command_writes_events_and_refuses_histograms_alone(tmp_path):
    from cct.cli import main

    text = NET.replace('layer { name: "data" type: "Input" top: "x" top: "y" input_param { shape { dim: 4 dim: 3 } '
                       'shape { dim: 4 dim: 2 } } }',
                       'layer { name: "data" type: "DummyData" top: "x" top: "y" dummy_data_param { '
                       'data_filler { type: "gaussian" } shape { dim: 4 dim: 3 } shape { dim: 4 dim: 2 } } }')
    (tmp_path / "net.prototxt").write_text(text)
    (tmp_path / "solver.prototxt").write_text(f'net: "{tmp_path / "net.prototxt"}"\n' +
                                              SOLVER.replace("test_iter: 2 test_interval: 4", "")
                                              .replace("test_initialization: true", ""))
    assert main(["train", "--solver", str(tmp_path / "solver.prototxt"), "--tensorboard", str(tmp_path / "tb"),
                 "--noprogress"]) == 0
    acc = load_events(tmp_path / "tb")
    assert sorted(scalars(acc, "lr")) == [0, 2, 4, 6]
    assert all(np.isfinite(v) for v in scalars(acc, "train/loss").values())
    assert main(["train", "--solver", str(tmp_path / "solver.prototxt"), "--tensorboard_histograms", "2"]) == 1

LENET_CASE = shared_path("reference", "solver_sgd_lenet")


@needs_mpi()
@pytest.mark.skipif(not LENET_CASE.is_dir(), reason="shared/reference not available")
def test_only_the_root_rank_writes_events_under_mpi(tmp_path):
    case = LENET_CASE
    work = tmp_path / "case"
    shutil.copytree(case, work)
    out = tmp_path / "w.caffemodel"
    run_mpi(2, ["python", script("train_run.py"), str(work), "2", "4", str(out), "--tensorboard", str(tmp_path / "tb")],
            timeout=120)
    files = os.listdir(tmp_path / "tb")
    assert len(files) == 1 and files[0].startswith("events.out.tfevents"), files  # one writer: rank 0
    losses = json.loads((tmp_path / "w.caffemodel.json").read_text())["losses"]
    written = scalars(load_events(tmp_path / "tb"), "train/smoothed_loss")
    # each iteration's display (display: 1) is the smoothed loss train_run.py recorded; 4 = the final display
    assert sorted(written) == [0, 1, 2, 3, 4]
    assert all(written[it] == pytest.approx(losses[it], rel=1e-6) for it in range(4))
