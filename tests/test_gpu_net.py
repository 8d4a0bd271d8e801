"""A whole net and solver resident on one GPU (skipped without CuPy and a GPU).

With a single GPU device (``--gpu 0``, ``--devices gpu:0``) every blob and parameter lives in GPU
memory; training must match the CPU run and snapshots must be ordinary Caffe files.
"""
import numpy as np
import pytest

import cct
from cct import scheduler
from cct.config import Config, using_config
from cct.device.driver import cupy_available, to_host
from cct.proto import caffe_pb2
from cct.solver.solver import get_solver

pytestmark = pytest.mark.skipif(not cupy_available(), reason="needs CuPy and a GPU")

NET = """
name: "small"
layer { name: "data" type: "DummyData" top: "data" top: "label"
        dummy_data_param { shape { dim: 6 dim: 2 dim: 10 dim: 10 } shape { dim: 6 }
                           data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "xavier" }
                            bias_filler { type: "constant" value: 0.1 } } }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "relu1" type: "ReLU" bottom: "pool1" top: "pool1" }
layer { name: "ip1" type: "InnerProduct" bottom: "pool1" top: "ip1"
        inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss" }
layer { name: "acc" type: "Accuracy" bottom: "ip1" bottom: "label" top: "acc" }
"""


def _solver_param(tmp_path, mode=caffe_pb2.SolverParameter.CPU) -> caffe_pb2.SolverParameter:
    from cct.io.prototxt import parse_text

    sp = caffe_pb2.SolverParameter()
    parse_text(NET, sp.net_param)
    sp.base_lr, sp.momentum, sp.weight_decay = 0.05, 0.9, 5e-4
    sp.lr_policy, sp.max_iter, sp.display = "fixed", 6, 2
    sp.snapshot_prefix = str(tmp_path / "small") if tmp_path is not None else "small"
    sp.random_seed = 11
    sp.solver_mode = mode
    return sp


def _train(tmp_path, mode):
    """Train with Caffe's solver_mode (GPU: the user's path, device_id 0 -> a resident net)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    solver = get_solver(_solver_param(tmp_path, mode))
    solver.solve()
    return solver, [to_host(p.data) for p in solver.net.learnable_params]


def test_net_lives_on_the_gpu_and_trains_as_on_the_cpu(tmp_path):
    import cupy

    cpu_solver, cpu = _train(tmp_path / "cpu", caffe_pb2.SolverParameter.CPU)
    gpu_solver, gpu = _train(tmp_path / "gpu", caffe_pb2.SolverParameter.GPU)
    assert isinstance(gpu_solver.net.blobs["conv1"].data, cupy.ndarray)
    assert isinstance(gpu_solver.net.learnable_params[0].data, cupy.ndarray)
    assert gpu_solver.net.executor is None  # no per-layer copies: the net is resident
    for a, b in zip(gpu, cpu):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    snap = tmp_path / "gpu" / "small_iter_6.caffemodel"
    assert snap.exists()
    net = cct.Net(_solver_param(tmp_path).net_param, cct.TEST, weights=str(snap))
    for p, b in zip(net.learnable_params, gpu):
        np.testing.assert_array_equal(p.data, b)


def test_explicit_single_gpu_device_makes_the_net_resident():
    import cupy

    cfg = Config(devices=scheduler.make_config("gpu:0", [1.0]))
    try:
        with using_config(cfg):
            net = cct.Net(_solver_param(None).net_param, cct.TRAIN)
        assert isinstance(net.blobs["data"].data, cupy.ndarray) and net.executor is None
        loss = net.forward()
        net.backward()
        assert np.isfinite(loss) and float(cupy.abs(net.learnable_params[0].diff).sum()) > 0
    finally:
        cfg.close()


def test_gpu_net_measures_its_conv_strategy_and_trains_as_on_the_cpu(tmp_path):
    _, cpu = _train(tmp_path / "cpu", caffe_pb2.SolverParameter.CPU)
    with using_config(engine={"tune_device": True}):
        gpu_solver, gpu = _train(tmp_path / "gpu", caffe_pb2.SolverParameter.GPU)
    conv = next(layer for layer in gpu_solver.net.layers if layer.name == "conv1")
    report = conv.lowering.plan_report
    assert "measured on " in report and "[measured " in report and "type1" in report, report
    for a, b in zip(gpu, cpu):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
