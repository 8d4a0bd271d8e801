"""The decomposition of a training iteration into the pieces a CUDA graph captures (cct/solver/graphed.py),
checked on the CPU: run piece by piece (DirectPieces) it must give the eager iteration's weights, losses and
log lines bit for bit, for every solver type and iter_size; and the reasons graphs are not used."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from cct.device.graph import DirectPieces, capture_blockers, first_compute_layer
from cct.io.prototxt import parse_text
from cct.proto import caffe_pb2
from cct.solver import get_solver
from cct.solver.graphed import GraphedIterations, why_not_graphs

NET = """
name: "pieces"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 4 dim: 2 dim: 6 dim: 6 } shape { dim: 4 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        param { lr_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
        convolution_param { num_output: 3 kernel_size: 3 weight_filler { type: "xavier" }
                            bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "ip1" type: "InnerProduct" bottom: "conv1" top: "ip1"
        inner_product_param { num_output: 6 weight_filler { type: "xavier" } } }
layer { name: "drop1" type: "Dropout" bottom: "ip1" top: "ip1" dropout_param { dropout_ratio: 0.25 } }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""


def _solver(solver_type: str, iter_size: int):
    sp = caffe_pb2.SolverParameter()
    parse_text(NET, sp.net_param)
    sp.type = solver_type
    sp.base_lr, sp.weight_decay = 0.05, 5e-4
    sp.momentum = 0.0 if solver_type in ("AdaGrad", "RMSProp") else 0.9
    sp.lr_policy, sp.stepsize, sp.gamma = "step", 4, 0.5
    sp.max_iter, sp.display, sp.average_loss, sp.random_seed = 100, 3, 2, 7
    sp.iter_size = iter_size
    sp.test_iter.append(2)
    sp.test_interval = 4  # test passes between replayed iterations
    sp.snapshot_after_train = False
    return get_solver(sp)


def _train(solver, iterations: int):
    rng = np.random.default_rng(3)
    for _ in range(iterations):
        solver.net.blobs["data"].data[...] = rng.standard_normal((4, 2, 6, 6)).astype(np.float32)
        solver.net.blobs["label"].data[...] = rng.integers(0, 3, size=4)
        solver.step(1)
    return [p.data.copy() for p in solver.net.learnable_params]


@pytest.mark.parametrize("solver_type,iter_size", [("SGD", 1), ("Nesterov", 2), ("AdaGrad", 1), ("RMSProp", 3),
                                                   ("AdaDelta", 1), ("Adam", 2)])
def test_pieces_equal_the_eager_iteration(solver_type, iter_size, caplog):
    eager = _solver(solver_type, iter_size)
    assert eager.step_graphs is None
    with caplog.at_level(logging.INFO, logger="cct"):
        want = _train(eager, 9)
    want_lines = [r.getMessage() for r in caplog.records if "Iteration" in r.getMessage()]
    caplog.clear()
    pieced = _solver(solver_type, iter_size)
    runner = DirectPieces()
    pieced.step_graphs = GraphedIterations(pieced, pieces=runner)
    with caplog.at_level(logging.INFO, logger="cct"):
        got = _train(pieced, 9)
    got_lines = [r.getMessage() for r in caplog.records if "Iteration" in r.getMessage()]
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert pieced.smoothed_loss == eager.smoothed_loss and pieced.lr == eager.lr
    # the display lines carry the smoothed loss and rate; the speed figures differ
    strip = [line.split("(")[0] + line.split(")")[-1] for line in want_lines]
    assert [line.split("(")[0] + line.split(")")[-1] for line in got_lines] == strip
    names = {"pass", "update"} if iter_size == 1 else \
        {"first pass", "last pass", "update"} | ({"middle pass"} if iter_size > 2 else set())
    assert set(runner.ran) == names
    assert runner.ran.count("update") == 9


def test_a_numpy_net_is_not_graphed_and_says_why():
    solver = _solver("SGD", 1)
    assert why_not_graphs(solver) == "the net is not resident on a GPU"
    assert solver.step_graphs is None and solver.graph_nodes() is None


def test_capture_starts_after_the_data_layers_and_names_blockers():
    solver = _solver("SGD", 1)
    layers = solver.net.layers
    assert first_compute_layer(layers) == 1
    assert capture_blockers(layers) == []

    class HostLayer:
        name, type, feeds_from_host, capturable, capture_blocker = "py", "Python", False, False, "runs Python"

    assert capture_blockers([*layers, HostLayer()]) == ["py (Python): runs Python"]
    late_data = layers[0]
    assert capture_blockers([layers[1], late_data]) == \
        [f"{late_data.name} (Input): a data layer after the first compute layer"]


def test_pieces_with_tests_snapshots_and_resume(tmp_path, caplog):
    """Test passes, snapshots and a resume in the middle behave as in the eager loop."""

    def solver(prefix):
        s = _solver("Nesterov", 1)
        s.param.snapshot, s.param.snapshot_prefix = 4, str(tmp_path / prefix)
        s.step_graphs = GraphedIterations(s, pieces=DirectPieces())
        return s

    straight = solver("a")
    want = _train(straight, 8)
    resumed = solver("b")
    _train(resumed, 4)
    again = solver("c")
    again.restore(str(tmp_path / "b_iter_4.solverstate"))
    assert again.iter == 4
    rng = np.random.default_rng(3)
    batches = [(rng.standard_normal((4, 2, 6, 6)).astype(np.float32), rng.integers(0, 3, size=4))
               for _ in range(8)]
    for x, y in batches[4:]:  # the same inputs the straight run saw at iterations 4..7
        again.net.blobs["data"].data[...] = x
        again.net.blobs["label"].data[...] = y
        again.step(1)
    for a, b in zip([p.data for p in again.net.learnable_params], want):
        np.testing.assert_array_equal(a, b)
    assert (tmp_path / "a_iter_8.caffemodel").is_file()
