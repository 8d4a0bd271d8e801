"""Training iterations replayed as CUDA graphs (cct.device.graph) against the eager GPU path and real Caffe
(skipped without CuPy and a GPU)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from cct.config import using_config
from cct.device.driver import cupy_available, to_host
from cct.errors import CctError
from cct.paths import shared_path
from cct.proto import caffe_pb2

pytestmark = pytest.mark.skipif(not cupy_available(), reason="needs CuPy and a GPU")

NET = """
name: "graphed"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 8 dim: 3 dim: 12 dim: 12 } shape { dim: 8 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        param { lr_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
        convolution_param { num_output: 6 kernel_size: 3 pad: 1 weight_filler { type: "xavier" }
                            bias_filler { type: "constant" value: 0.1 } } }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "relu1" type: "ReLU" bottom: "pool1" top: "pool1" }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
        convolution_param { num_output: 8 kernel_size: 3 group: 2 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2"
        pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool2" top: "ip1"
        inner_product_param { num_output: 16 weight_filler { type: "xavier" } } }
layer { name: "drop1" type: "Dropout" bottom: "ip1" top: "ip1" dropout_param { dropout_ratio: 0.3 } }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 5 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""


def _solver(graphs: bool, solver_type: str = "SGD", iter_size: int = 1, tf32: bool = False):
    from cct.io.prototxt import parse_text
    from cct.solver import get_solver

    sp = caffe_pb2.SolverParameter()
    parse_text(NET, sp.net_param)
    sp.type = solver_type
    sp.base_lr, sp.weight_decay = 0.02, 5e-4
    sp.momentum = 0.0 if solver_type in ("AdaGrad", "RMSProp") else 0.9
    if solver_type == "Adam":
        sp.momentum2 = 0.999
    sp.lr_policy, sp.stepsize, sp.gamma = "step", 7, 0.5  # the rate changes while the graph replays
    sp.max_iter, sp.display, sp.random_seed = 1000, 0, 5
    sp.iter_size = iter_size
    sp.snapshot_after_train = False
    sp.solver_mode = caffe_pb2.SolverParameter.GPU
    with using_config(gpu={"graphs": graphs, "tf32": tf32}):
        return get_solver(sp)


def _batches(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((8, 3, 12, 12)).astype(np.float32),
             rng.integers(0, 5, size=8).astype(np.float32)) for _ in range(n)]


def _train(solver, batches):
    net = solver.net
    data, label = net.blobs["data"], net.blobs["label"]
    for x, y in batches:
        data.data.set(x)  # in place: the graph reads the same device buffer every iteration
        label.data.set(y)
        solver.step(1)
    return [to_host(p.data) for p in net.learnable_params]


@pytest.mark.parametrize("solver_type,iter_size", [("SGD", 1), ("Nesterov", 1), ("Adam", 1), ("AdaDelta", 1),
                                                   ("RMSProp", 1), ("AdaGrad", 1), ("SGD", 2)])
def test_graph_replay_equals_eager(solver_type, iter_size):
    batches = _batches(20 * iter_size)
    eager = _solver(False, solver_type, iter_size)
    graphed = _solver(True, solver_type, iter_size)
    assert graphed.step_graphs is not None and eager.step_graphs is None
    w_eager = _train(eager, [batches[i] for i in range(0, len(batches), iter_size)])
    w_graph = _train(graphed, [batches[i] for i in range(0, len(batches), iter_size)])
    assert graphed.step_graphs.captured, "nothing was captured"
    assert not graphed.step_graphs.eager, f"a piece fell back to eager: {graphed.step_graphs.eager}"
    for a, b in zip(w_graph, w_eager):
        scale = max(float(np.max(np.abs(b))), 1e-30)
        assert float(np.max(np.abs(a - b))) / scale < 1e-6
    assert graphed.lr == eager.lr and graphed.iter == eager.iter == 20


def test_no_allocation_while_replaying():
    import cupy

    class CountMallocs(cupy.cuda.MemoryHook):
        name = "count_mallocs"

        def __init__(self):
            self.count = 0

        def malloc_preprocess(self, **kwargs):
            self.count += 1

    solver = _solver(True)
    batches = _batches(23)
    _train(solver, batches[:3])  # warm-up, capture, first replay
    hook = CountMallocs()
    with hook:
        _train(solver, batches[3:])
    cupy.cuda.Device().synchronize()
    assert hook.count == 0, f"{hook.count} allocations in 20 replayed iterations"


def test_bad_label_in_a_replayed_iteration_ends_with_a_clean_error():
    solver = _solver(True)
    batches = _batches(10)
    x, y = batches[6]
    y = y.copy()
    y[3] = 7  # 5 classes
    batches[6] = (x, y)
    with pytest.raises(CctError) as err:
        _train(solver, batches)
        solver.raise_deferred_errors() if hasattr(solver, "raise_deferred_errors") else None
    text = str(err.value)
    assert "loss" in text and "iteration 6" in text, text


def test_tf32_runs_and_stays_close():
    batches = _batches(5)
    fp32 = _train(_solver(True), batches)
    tf32 = _train(_solver(True, tf32=True), batches)
    for a, b in zip(tf32, fp32):
        assert np.allclose(a, b, rtol=5e-2, atol=5e-3)


REFERENCE = Path(shared_path("reference"))


@pytest.mark.skipif(not (REFERENCE / "solver_sgd_lenet").is_dir(), reason="no reference solver run")
def test_real_caffe_solver_run_with_graphs(tmp_path, monkeypatch):
    from cct.io.caffemodel import read_weights
    from cct.solver import get_solver
    from cct.solver.solver import read_solver_param

    work = tmp_path / "case"
    shutil.copytree(REFERENCE / "solver_sgd_lenet", work)
    monkeypatch.chdir(work)
    ref = json.loads((work / "losses.json").read_text())
    sp = read_solver_param("solver.prototxt")
    sp.solver_mode = caffe_pb2.SolverParameter.GPU
    with using_config(gpu={"graphs": True}):
        solver = get_solver(sp)
    solver.net.copy_from("init.caffemodel")
    rates = []
    for _ in range(solver.param.max_iter):
        solver.step(1)
        rates.append(solver.lr)
    assert solver.step_graphs is not None and solver.step_graphs.captured and not solver.step_graphs.eager
    np.testing.assert_allclose(rates, ref["lr"], rtol=1e-7)
    final = read_weights(work / "final.caffemodel")
    got = {name: [to_host(b.data) for b in layer.blobs] for name, layer in zip(solver.net.layer_names,
                                                                                 solver.net.layers)}
    compared = 0
    for name, arrays in final.items():
        for i, want in enumerate(arrays):
            have = got[name][i].reshape(want.shape).astype(np.float64)
            err = np.linalg.norm(have - want) / max(np.linalg.norm(want), 1e-30)
            assert err < 1e-4, f"{name}[{i}]: relative L2 error {err:.3g}"
            compared += 1
    assert compared > 0
