"""Deferred checks and the device loss on a CuPy net (skipped without CuPy and a GPU).

A bad label in a GPU training run ends it at the next boundary with the error naming the iteration it
happened in; one iteration's compute (forward, backward, the loss into the solver's device log) reads
nothing on the host: it runs inside a CUDA stream capture, where any device->host read raises.
"""
import numpy as np
import pytest
from test_device_deferred import NET as IP_NET
from test_device_deferred import Feed

from cct.device.driver import cupy_available, to_host
from cct.errors import LayerError
from cct.io.prototxt import parse_text
from cct.proto import caffe_pb2
from cct.solver import get_solver

pytestmark = pytest.mark.skipif(not cupy_available(), reason="needs CuPy and a GPU")

# no GEMM: CuPy refuses cuBLAS calls during a stream capture (the lead's binding lifts that)
GEMM_FREE_NET = """
force_backward: true
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 4 dim: 3 } } }
layer { name: "label" type: "Input" top: "label" input_param { shape { dim: 4 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "x" bottom: "label" top: "loss" }
layer { name: "acc" type: "Accuracy" bottom: "x" bottom: "label" top: "acc" top: "per_class" }
"""


def _gpu_solver(net_text, solver_text):
    p = parse_text(solver_text, caffe_pb2.SolverParameter())
    parse_text(net_text, p.net_param)
    p.solver_mode = caffe_pb2.SolverParameter.GPU
    p.random_seed = 5
    return get_solver(p)


def test_gpu_bad_label_raises_at_the_next_boundary_naming_its_iteration():
    import cupy

    s = _gpu_solver(IP_NET, 'base_lr: 0.1 lr_policy: "fixed" display: 4')
    assert isinstance(s.net.blobs["y"].data, cupy.ndarray) and s.net.checks.deferred
    s.add_callback(on_start=Feed(s, bad_label_at=5))  # numpy batches written into the GPU blobs
    with pytest.raises(LayerError, match=r"^layer 'loss' \(type SoftmaxWithLoss\): label value 7 out of range \[0, 3\) "
                                         r"at item 2 of the batch \(bottom\[1\]\) \(train net, iteration 5\)$"):
        s.step(20)
    assert s.iter == 8  # the display boundary of iteration 8 found it


def test_gpu_net_forward_still_raises_at_once():
    import cupy

    s = _gpu_solver(IP_NET, 'base_lr: 0.1 lr_policy: "fixed"')
    net = s.net
    net.blobs["x"].data[...] = cupy.ones((4, 5), dtype=np.float32)
    net.blobs["label"].data[...] = cupy.asarray([0, 1, 3, 2], dtype=np.float32)
    with pytest.raises(LayerError, match=r"label value 3 out of range \[0, 3\) at item 2 of the batch"):
        net.forward()


def _capture(run):
    """Run ``run()`` inside a CUDA stream capture (any host read raises there) and launch the graph once."""
    import cupy

    cupy.cuda.Device().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            run()
        finally:
            graph = stream.end_capture()
        graph.launch(stream)
    stream.synchronize()


def test_one_iteration_of_compute_reads_nothing_on_the_host():
    """The solver's per-iteration path (forward, backward, loss into the device log, the checks' counter)
    captured whole as a CUDA graph: the capture would fail on any device->host read."""
    import cupy

    s = _gpu_solver(GEMM_FREE_NET, 'base_lr: 0.1 lr_policy: "fixed"')
    x = cupy.asarray(np.random.default_rng(1).standard_normal((4, 3)), dtype=np.float32)
    s.net.blobs["x"].data[...] = x
    s.net.blobs["label"].data[...] = cupy.asarray([0, 2, 1, 1], dtype=np.float32)
    s.step(1)  # warm-up: kernels compiled, the loss log allocated
    s._start_loss_log(10)
    _capture(s._run_iteration)
    ((iteration, loss),) = s._loss_log.take()
    expect = s.net.forward()
    assert iteration == s.iter and loss == np.float32(expect)
    # a bad label inside the captured iteration: recorded on the device, raised at the boundary
    s.net.checks.set_iteration(17)
    s.net.blobs["label"].data[...] = cupy.asarray([0, 2, -1, 1], dtype=np.float32)
    _capture(s._run_iteration)
    assert int(to_host(s.net.checks.iteration)) == 18  # advanced inside the graph
    with pytest.raises(LayerError, match=r"^layer 'loss' .*label value -1 out of range \[0, 3\) at item 2 .*"
                                         r"\(train net, iteration 17\)$"):
        s._settle(s.iter)
