"""Devices, FLOPS-proportional shares, the data-parallel executor and gradient aggregation."""
import argparse
import threading
import time

import numpy as np
import pytest

import cct
from cct import scheduler
from cct.device.driver import HostDevice
from cct.errors import CctError
from cct.io.prototxt import parse_text
from cct.proto import caffe_pb2
from cct.scheduler import CpuDevice, DataParallelExecutor, ShareTable, flops_share, layer_mode
from cct.scheduler.config import parse_devices, parse_shares

needs_gpu = pytest.mark.skipif(scheduler.gpu_count() == 0, reason="needs CuPy and a GPU")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CCT_CACHE_DIR", str(tmp_path / "cache"))
    yield
    scheduler.set_devices(None)


def net_param(text: str) -> caffe_pb2.NetParameter:
    return parse_text(text, caffe_pb2.NetParameter())


LENET = """
name: "lenet_small"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 7 dim: 1 dim: 12 dim: 12 } shape { dim: 7 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        param { lr_mult: 1 } param { lr_mult: 2 }
        convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "xavier" }
                            bias_filler { type: "constant" value: 0.1 } } }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
        convolution_param { num_output: 6 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "ip1" type: "InnerProduct" bottom: "conv2" top: "ip1"
        inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
layer { name: "acc" type: "Accuracy" bottom: "ip2" bottom: "label" top: "acc" include { phase: TEST } }
"""

CAFFENET_SMALL = """
name: "caffenet_small"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 5 dim: 3 dim: 27 dim: 27 } shape { dim: 5 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 8 kernel_size: 5 stride: 2 weight_filler { type: "gaussian" std: 0.1 }
                            bias_filler { type: "constant" value: 0 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "norm1" type: "LRN" bottom: "pool1" top: "norm1" lrn_param { local_size: 3 alpha: 0.0001 beta: 0.75 } }
layer { name: "conv2" type: "Convolution" bottom: "norm1" top: "conv2"
        convolution_param { num_output: 8 pad: 1 kernel_size: 3 group: 2 weight_filler { type: "gaussian" std: 0.1 }
                            bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2"
        pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "fc6" type: "InnerProduct" bottom: "pool2" top: "fc6"
        inner_product_param { num_output: 16 weight_filler { type: "gaussian" std: 0.05 } } }
layer { name: "relu6" type: "ReLU" bottom: "fc6" top: "fc6" }
layer { name: "drop6" type: "Dropout" bottom: "fc6" top: "fc6" dropout_param { dropout_ratio: 0.5 } }
layer { name: "fc8" type: "InnerProduct" bottom: "fc6" top: "fc8"
        inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.05 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc8" bottom: "label" top: "loss" }
"""


def make_net(text, seed=3, phase=cct.TRAIN, dtype=np.float32):
    cct.set_random_seed(seed)
    return cct.Net(net_param(text), phase, dtype=dtype)


def fill_inputs(net, seed, classes):
    rng = np.random.default_rng(seed)
    x = net.blobs["data"]
    x.data[...] = rng.standard_normal(x.shape).astype(x.dtype)
    net.blobs["label"].data[...] = rng.integers(0, classes, net.blobs["label"].shape)


def sgd_train(net, iters, classes, lr=0.05, seed_base=100):
    """A few SGD steps by hand (data -= lr * diff); returns the losses."""
    losses = []
    for it in range(iters):
        fill_inputs(net, seed_base + it, classes)
        net.clear_param_diffs()
        losses.append(net.forward())
        net.backward()
        for p in net.learnable_params:
            p.data -= lr * p.diff
    return losses


def two_cpus(shares=(0.5, 0.5), layer_shares=None):
    devs = [CpuDevice(0, 1), CpuDevice(1, 1)]
    return scheduler.make_config(devs, list(shares), layer_shares)


# -- shares ---------------------------------------------------------------------------------
def test_flops_share_proportional_and_whole():
    assert flops_share([230, 100], 33) == [23, 10]
    assert flops_share([1, 1], 7) == [4, 3]
    assert flops_share([1, 1, 1], 10) == [4, 3, 3]
    assert flops_share([3, 1], 0) == [0, 0]
    assert flops_share([1, 0], 5) == [5, 0]
    for g in ([1.3, 2.7, 0.5], [100, 1], [5, 5, 5, 5]):
        for n in range(0, 40):
            c = flops_share(g, n)
            assert sum(c) == n and all(abs(ci - n * gi / sum(g)) < 1 for ci, gi in zip(c, g))
    with pytest.raises(CctError):
        flops_share([0, 0], 4)
    with pytest.raises(CctError):
        flops_share([-1, 2], 4)


def test_share_validation():
    assert ShareTable([0.25, 0.75]).counts("x", 8) == [2, 6]
    t = ShareTable([0.5, 0.5], {"conv1": [1.0, 0.0]})
    assert t.counts("conv1", 8) == [8, 0] and t.counts("conv2", 8) == [4, 4]
    with pytest.raises(CctError, match="sum to 1"):
        ShareTable([0.3, 0.3])
    with pytest.raises(CctError, match="sum to 1"):
        ShareTable([0.5, 0.5], {"conv1": [0.9, 0.2]})
    with pytest.raises(CctError, match="2 device"):
        ShareTable([0.5, 0.5], {"conv1": [1.0]})
    with pytest.raises(CctError):
        ShareTable([1.5, -0.5])


def test_parse_devices_and_shares():
    devs = parse_devices("cpu,cpu:1")
    assert [d.name for d in devs] == ["cpu:0", "cpu:1"]
    assert all(d.threads == max(1, scheduler.cpu_cores() // 2) for d in devs)
    d = parse_devices(["cpu:0:threads=1:blas=openblas"])[0]
    assert (d.threads, d.blas) == (1, "openblas")
    assert parse_shares(None) == ("auto", {})
    assert parse_shares(["0.25,0.75", "conv1=1,0"]) == ([0.25, 0.75], {"conv1": [1.0, 0.0]})
    assert parse_shares("peak;fc6=0.5,0.5") == ("peak", {"fc6": [0.5, 0.5]})
    for bad in ("tpu:0", "cpu:0:color=red", "cpu:0:threads=0", "cpu,cpu", "cpu:99", ""):
        with pytest.raises(CctError):
            parse_devices(bad)
    with pytest.raises(CctError):
        parse_shares(["0.5,0.5", "0.2,0.8"])
    with pytest.raises(CctError):
        parse_shares("a,b")
    with pytest.raises(CctError, match="sum to 1"):
        scheduler.make_config("cpu:0:threads=1,cpu:1:threads=1", [0.2, 0.2])


@pytest.mark.skipif(scheduler.gpu_count() > 0, reason="checks the no-GPU errors")
def test_gpu_errors_without_gpu(caplog):
    for spec in ("gpu", "gpu:0", "cpu,gpu:0"):
        with pytest.raises(CctError, match="gpu:0"):
            parse_devices(spec)
    ap = argparse.ArgumentParser()
    scheduler.add_device_arguments(ap)
    ap.add_argument("--gpu", default=None)
    with pytest.raises(CctError):
        scheduler.devices_from_args(ap.parse_args(["--gpu", "0"]))
    with caplog.at_level("INFO", logger="cct"):
        devs = parse_devices("auto")
    assert [d.kind for d in devs] == ["cpu"] and "no GPU" in caplog.text
    sp = caffe_pb2.SolverParameter(solver_mode=caffe_pb2.SolverParameter.GPU)
    assert scheduler.devices_from_args(ap.parse_args([]), sp) is None  # zoo solvers: CPU with a warning
    with pytest.raises(CctError, match="--devices"):
        scheduler.devices_from_args(ap.parse_args(["--share", "0.5,0.5"]))
    cfg = scheduler.devices_from_args(ap.parse_args(["--devices", "cpu:0:threads=1,cpu:1:threads=1",
                                                     "--share", "0.25,0.75", "--share", "ip1=0.5,0.5"]))
    try:
        assert cfg.shares == [0.25, 0.75] and cfg.layer_shares == {"ip1": [0.5, 0.5]}
    finally:
        cfg.close()


@pytest.mark.skipif(not cct.blas.mkl_available(), reason="needs MKL")
def test_device_backend_is_set_in_its_worker_thread(monkeypatch):
    if not scheduler.devices.per_thread_blas_supported():
        with pytest.raises(CctError, match="per thread"):
            CpuDevice(0, 1, "mkl")
    calls = []
    monkeypatch.setattr(cct.blas, "set_thread_backend", lambda name: calls.append(
        (name, threading.current_thread().name)), raising=False)
    dev = CpuDevice(1, 1, "mkl")
    try:
        assert dev.blas == "mkl" and dev.run(lambda: 7) == 7
        assert calls == [("mkl", calls[0][1])] and calls[0][1].startswith("cct-cpu1")
        assert "mkl" in dev.signature() and dev.info()["blas"] == "mkl"
    finally:
        dev.close()


def test_openblas_budgets_must_match():
    with pytest.raises(CctError, match="same thread count"):
        scheduler.configure_thread_budgets([CpuDevice(0, 1, "openblas"), CpuDevice(1, 2, "openblas")])


# -- layer modes ------------------------------------------------------------------------------
def test_layer_modes():
    net = make_net(LENET)
    modes = {}
    for layer, b, t in zip(net.layers, net.bottom_vecs, net.top_vecs):
        modes[layer.name] = layer_mode(layer, b, t)
    assert modes == {"data": "host", "conv1": "split", "pool1": "split", "conv2": "split", "relu2": "split",
                     "ip1": "split", "relu1": "split", "ip2": "split", "loss": "host"}
    net = make_net(CAFFENET_SMALL)
    assert layer_mode(net.layer_by_name("drop6"), [net.blobs["fc6"]], [net.blobs["fc6"]]) == "serial"
    test_net = make_net(CAFFENET_SMALL, phase=cct.TEST)
    assert layer_mode(test_net.layer_by_name("drop6"), [test_net.blobs["fc6"]], [test_net.blobs["fc6"]]) == "split"
    axis0 = make_net("""
    layer { name: "d" type: "Input" top: "a" top: "b" input_param { shape { dim: 2 dim: 3 } shape { dim: 2 dim: 3 } } }
    layer { name: "c" type: "Concat" bottom: "a" bottom: "b" top: "c" concat_param { axis: 0 } }
    layer { name: "c1" type: "Concat" bottom: "a" bottom: "b" top: "c1" concat_param { axis: 1 } }
    layer { name: "bn" type: "BatchNorm" bottom: "a" top: "bn" }
    layer { name: "sm" type: "Softmax" bottom: "b" top: "sm" softmax_param { axis: 0 } }
    """)
    got = {l.name: layer_mode(l, b, t) for l, b, t in zip(axis0.layers, axis0.bottom_vecs, axis0.top_vecs)
           if l.type != "Split"}
    assert got == {"d": "host", "c": "host", "c1": "split", "bn": "host", "sm": "host"}


# -- executor: same results as one device -------------------------------------------------------
def _grads(net):
    return [p.diff.copy() for p in net.learnable_params]


@pytest.mark.parametrize("shares", [(0.5, 0.5), (0.3, 0.7), (1.0, 0.0)])
def test_lenet_forward_backward_matches_single_device(shares):
    ref = make_net(LENET)
    fill_inputs(ref, 0, 3)
    ref.clear_param_diffs()
    ref_loss = ref.forward()
    ref.backward()
    net = make_net(LENET)
    fill_inputs(net, 0, 3)
    cfg = two_cpus(shares)
    try:
        ex = cfg.attach(net)
        net.clear_param_diffs()
        loss = net.forward()
        net.backward()
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        np.testing.assert_allclose(net.blobs["ip2"].data, ref.blobs["ip2"].data, rtol=1e-5, atol=1e-6)
        for g, r in zip(_grads(net), _grads(ref)):
            np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(net.blobs["data"].diff, ref.blobs["data"].diff, rtol=1e-4, atol=1e-7)
        n0 = round(7 * shares[0])
        expect = [(0, 0, n0), (1, n0, 7)] if 0 < n0 < 7 else [(0, 0, 7)]
        assert ex.ranges(net._layer_index["conv1"]) == expect
        assert ex.mode(net._layer_index["loss"]) == "host"
    finally:
        scheduler.detach(net)
        cfg.close()


def test_lenet_training_two_devices_same_weights_float64():
    ref = make_net(LENET, dtype=np.float64)
    sgd_train(ref, 4, 3)
    net = make_net(LENET, dtype=np.float64)
    cfg = two_cpus((0.4, 0.6), {"conv1": [0.75, 0.25]})
    try:
        cfg.attach(net)
        losses = sgd_train(net, 4, 3)
    finally:
        scheduler.detach(net)
        cfg.close()
    ref_losses = sgd_train(make_net(LENET, dtype=np.float64), 4, 3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-12)
    for p, r in zip(net.learnable_params, ref.learnable_params):
        np.testing.assert_allclose(p.data, r.data, rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("transpose", [False, True])
def test_inner_product_model_parallel_matches_single_device(transpose):
    text = LENET.replace('num_output: 10 weight_filler', 'num_output: 10 transpose: %s weight_filler'
                         % ("true" if transpose else "false"))
    ref = make_net(text, dtype=np.float64)
    sgd_train(ref, 3, 3)
    net = make_net(text, dtype=np.float64)
    cfg = two_cpus((0.3, 0.7))
    cfg.model_parallel = "always"
    try:
        ex = cfg.attach(net)
        sgd_train(net, 3, 3)
        i = net._layer_index["ip1"]
        assert ex.mode(i) == "model" and ex.model_ranges(i) == [(0, 0, 3), (1, 3, 10)]
        assert ex.mode(net._layer_index["conv1"]) == "split"
    finally:
        scheduler.detach(net)
        cfg.close()
    for p, r in zip(net.learnable_params, ref.learnable_params):
        np.testing.assert_allclose(p.data, r.data, rtol=1e-11, atol=1e-13)


def test_caffenet_small_training_two_devices_float32():
    """Dropout in TRAIN ("serial" slices) draws the same masks; weights agree to float32 rounding."""
    ref = make_net(CAFFENET_SMALL, seed=5)
    ref_losses = sgd_train(ref, 3, 4, lr=0.02)
    net = make_net(CAFFENET_SMALL, seed=5)
    cfg = two_cpus((0.6, 0.4))
    try:
        ex = cfg.attach(net)
        losses = sgd_train(net, 3, 4, lr=0.02)
        assert ex.mode(net._layer_index["drop6"]) == "serial"
        assert ex.mode(net._layer_index["fc6"]) == "model" and ex.mode(net._layer_index["fc8"]) == "split"
        assert ex.stats.iterations == 3 and ex.stats.aggregations > 0
        assert ex.stats.images == {"cpu:0": ex.stats.images["cpu:0"], "cpu:1": ex.stats.images["cpu:1"]}
    finally:
        scheduler.detach(net)
        cfg.close()
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    for p, r in zip(net.learnable_params, ref.learnable_params):
        np.testing.assert_allclose(p.data, r.data, rtol=1e-4, atol=1e-6)


def test_solver_training_two_devices_same_weights():
    solver_mod = pytest.importorskip("cct.solver")

    def train(attach):
        sp = caffe_pb2.SolverParameter(base_lr=0.05, momentum=0.9, weight_decay=0.001, lr_policy="fixed",
                                       max_iter=5, random_seed=7, display=0, snapshot=0, iter_size=2)
        sp.net_param.CopyFrom(net_param(CAFFENET_SMALL))
        solver = solver_mod.get_solver(sp)
        fill_inputs(solver.net, 3, 4)
        cfg = two_cpus((0.5, 0.5)) if attach else None
        if cfg:
            cfg.attach(solver.net)
        try:
            solver.step(5)
        finally:
            if cfg:
                scheduler.detach(solver.net)
                cfg.close()
        return solver.net

    ref, net = train(False), train(True)
    for p, r in zip(net.learnable_params, ref.learnable_params):
        np.testing.assert_allclose(p.data, r.data, rtol=1e-4, atol=1e-6)


def test_dropout_masks_identical_to_single_device():
    text = """
    layer { name: "d" type: "Input" top: "x" input_param { shape { dim: 9 dim: 5 } } }
    layer { name: "drop" type: "Dropout" bottom: "x" top: "y" dropout_param { dropout_ratio: 0.3 } }
    """
    ref = make_net(text, seed=11)
    ref.blobs["x"].data[...] = 1
    ref.forward()
    after_ref = cct.rng.get_rng().random()
    net = make_net(text, seed=11)
    net.blobs["x"].data[...] = 1
    cfg = two_cpus((0.5, 0.5))
    try:
        cfg.attach(net)
        net.forward()
    finally:
        scheduler.detach(net)
        cfg.close()
    np.testing.assert_array_equal(net.blobs["y"].data, ref.blobs["y"].data)
    assert cct.rng.get_rng().random() == after_ref


def test_shared_params_and_frozen_layers():
    text = """
    layer { name: "d" type: "Input" top: "x" top: "t" input_param { shape { dim: 6 dim: 4 } shape { dim: 6 dim: 3 } } }
    layer { name: "a" type: "InnerProduct" bottom: "x" top: "a" param { name: "w" } param { name: "b" }
            inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.3 } } }
    layer { name: "b" type: "InnerProduct" bottom: "a" top: "b" param { name: "w" } param { name: "b" }
            inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.3 } } }
    layer { name: "c" type: "InnerProduct" bottom: "b" top: "c" param { lr_mult: 0 } param { lr_mult: 0 }
            inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 } } }
    layer { name: "loss" type: "EuclideanLoss" bottom: "c" bottom: "t" top: "loss" }
    """

    def run(attach):
        net = make_net(text, seed=2, dtype=np.float64)
        rng = np.random.default_rng(1)
        net.blobs["x"].data[...] = rng.standard_normal((6, 4))
        net.blobs["t"].data[...] = rng.standard_normal((6, 3))
        cfg = two_cpus((0.5, 0.5)) if attach else None
        if cfg:
            cfg.attach(net)
        net.clear_param_diffs()
        net.forward()
        net.backward()
        net.backward()  # accumulates (iter_size-like): aggregation adds to what is there
        if cfg:
            scheduler.detach(net)
            cfg.close()
        return net

    ref, net = run(False), run(True)
    for p, r in zip(net.learnable_params, ref.learnable_params):
        np.testing.assert_allclose(p.diff, r.diff, rtol=1e-12, atol=1e-14)
    assert not np.any(net.layer_by_name("c").blobs[0].diff)


def test_aggregation_overlaps_backward_and_finish_waits():
    """The aggregation of a layer runs on the aggregation thread while later layers backprop."""
    net = make_net(LENET)
    fill_inputs(net, 0, 3)
    cfg = two_cpus((0.5, 0.5))
    cfg.model_parallel = "never"
    try:
        ex = cfg.attach(net)
        events = []
        orig = ex._aggregate

        def slow_aggregate(layer, wanted, parts):
            events.append(("agg-start", layer.name, threading.current_thread().name))
            time.sleep(0.1)
            orig(layer, wanted, parts)
            events.append(("agg-end", layer.name))

        ex._aggregate = slow_aggregate
        orig_bw = ex.backward

        def backward(i, layer, *a):
            events.append(("bw", layer.name))
            orig_bw(i, layer, *a)

        ex.backward = backward
        net.clear_param_diffs()
        net.forward()
        net.backward()
        assert events[-1][0] == "agg-end"  # finish_backward waited for the last aggregation
        agg_ip2 = [e for e in events if e[0] == "agg-start" and e[1] == "ip2"][0]
        assert agg_ip2[2].startswith("cct-agg")
        # conv1's backward started before ip2's aggregation ended: overlap
        assert events.index(("bw", "conv1")) < events.index(("agg-end", "ip2"))
        assert ex.stats.aggregations == 4 and ex.stats.aggregation_wait_s > 0.05
    finally:
        scheduler.detach(net)
        cfg.close()


def test_conv_shadows_use_one_partition_and_the_users_lowering():
    partition = pytest.importorskip("cct.lowering.partition")
    from cct.lowering import get_strategy

    ref = make_net(LENET)
    fill_inputs(ref, 0, 3)
    ref.forward()
    net = make_net(LENET)
    fill_inputs(net, 0, 3)
    user = partition.BatchedLowering(get_strategy("type1"), partitions=2)
    net.layer_by_name("conv1").lowering = user
    cfg = two_cpus((0.5, 0.5))
    try:
        ex = cfg.attach(net)
        net.forward()
        i1, i2 = net._layer_index["conv1"], net._layer_index["conv2"]
        for d in (0, 1):
            low1 = ex._shadows[(i1, d)].lowering
            assert low1 is not user and type(low1) is type(user) and low1.partitions == 1
            assert getattr(ex._shadows[(i2, d)].lowering, "partitions", 1) == 1
        assert user.partitions == 2
        np.testing.assert_allclose(net.blobs["ip2"].data, ref.blobs["ip2"].data, rtol=1e-5, atol=1e-6)
    finally:
        scheduler.detach(net)
        cfg.close()


def test_test_net_sharing_weights_sees_updates():
    trains = [make_net(LENET, seed=1), make_net(LENET, seed=2)]
    test = make_net(LENET, seed=9, phase=cct.TEST)
    cfg = two_cpus((0.5, 0.5))
    try:
        cfg.attach(test, strict=False)
        for step, train in enumerate(trains + trains[:1]):
            test.share_weights_with(train)  # rebinds the test net's arrays: the shadows must follow
            fill_inputs(train, step, 3)
            fill_inputs(test, step, 3)
            test.forward()
            assert float(test.blobs["loss"].data) == pytest.approx(train.forward(), rel=1e-5)
            for p in train.learnable_params:  # in place, as the solver does
                p.data *= 0.5
    finally:
        scheduler.detach(test)
        cfg.close()


def test_layer_shares_unknown_layer_is_error():
    net = make_net(LENET)
    cfg = two_cpus((0.5, 0.5), {"nope": [0.5, 0.5]})
    try:
        with pytest.raises(CctError, match="nope"):
            cfg.attach(net)
        cfg.attach(net, strict=False)
    finally:
        scheduler.detach(net)
        cfg.close()


def test_devices_really_run_in_parallel_threads():
    devs = [CpuDevice(0, 1), CpuDevice(1, 1)]
    try:
        names = [d.run(lambda: threading.current_thread().name) for d in devs]
        assert names[0] != names[1] and all(n.startswith("cct-cpu") for n in names)
        # two GIL-releasing sleeps overlap
        t0 = time.perf_counter()
        fs = [d.submit(time.sleep, 0.1) for d in devs]
        [f.result() for f in fs]
        assert time.perf_counter() - t0 < 0.19
    finally:
        for d in devs:
            d.close()


def test_set_devices_auto_probe_and_attach_default():
    cfg = scheduler.set_devices(["cpu:0:threads=1", "cpu:1:threads=1"], shares="auto")
    assert cfg.share_source.startswith("auto") and len(cfg.gflops) == 2 and all(g > 0 for g in cfg.gflops)
    assert sum(cfg.shares) == pytest.approx(1.0)
    assert scheduler.get_devices() is cfg
    # cached: a second probe returns the same numbers without measuring
    assert scheduler.probe(cfg.devices) == cfg.gflops
    net = make_net(LENET)
    ex = scheduler.attach(net)
    assert isinstance(ex, DataParallelExecutor) and net.executor is ex
    ex2 = scheduler.attach(net, shares=[0.5, 0.5])
    assert ex2.shares.default == [0.5, 0.5]
    scheduler.detach(net)
    assert net.executor is None
    scheduler.set_devices(None)
    assert scheduler.get_devices() is None and scheduler.attach(make_net(LENET)) is None


def test_attach_with_spec_owns_its_devices():
    net = make_net(LENET)
    ex = scheduler.attach(net, "cpu:0:threads=1,cpu:1:threads=1", shares=[0.5, 0.5])
    fill_inputs(net, 0, 3)
    net.forward()
    net.backward()
    devs = ex.owned_config.devices
    scheduler.detach(net)
    assert all(d._pool is None for d in devs)


def test_device_query_fields():
    rows = scheduler.device_query(measure=False)
    assert rows and rows[0]["kind"] == "cpu"
    for r in rows:
        assert {"name", "kind", "blas", "kernel", "threads", "gflops", "peak_gflops", "memory_bytes"} <= set(r)
    assert "cpu:0" in scheduler.format_device_query(rows)


def test_worker_error_propagates():
    net = make_net(LENET)
    cfg = two_cpus((0.5, 0.5))
    try:
        cfg.attach(net)
        net.blobs["data"].reshape((7, 2, 12, 12))  # wrong channel count: conv1 must complain
        with pytest.raises(CctError, match="conv1"):
            net.forward()
    finally:
        scheduler.detach(net)
        cfg.close()


class SeparateHostMemory(HostDevice):
    """Host memory that the scheduler treats as a device's own (copies in and out, as a GPU's)."""

    is_gpu = True

    def upload(self, host, out=None, stream=None):
        return np.array(host) if out is None else super().upload(host, out)


class CopyingCpuDevice(CpuDevice):
    """A CPU device that pretends to have its own memory: exercises the GPU code path with numpy."""

    def __init__(self, index, threads):
        super().__init__(index, threads)
        self.memory = SeparateHostMemory()


def test_device_memory_path_matches_single_device():
    ref = make_net(CAFFENET_SMALL, seed=4)
    ref_losses = sgd_train(ref, 2, 4, lr=0.02)
    net = make_net(CAFFENET_SMALL, seed=4)
    devs = [CopyingCpuDevice(0, 1), CpuDevice(1, 1)]
    cfg = scheduler.make_config(devs, [0.4, 0.6])
    try:
        cfg.attach(net)
        losses = sgd_train(net, 2, 4, lr=0.02)
    finally:
        scheduler.detach(net)
        cfg.close()
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    for p, r in zip(net.learnable_params, ref.learnable_params):
        np.testing.assert_allclose(p.data, r.data, rtol=1e-4, atol=1e-6)


# -- GPU (skipped without one) ----------------------------------------------------------------
@needs_gpu
def test_gpu_and_cpu_split_matches_single_device():
    ref = make_net(LENET)
    sgd_train(ref, 2, 3)
    net = make_net(LENET)
    cfg = scheduler.make_config("gpu:0,cpu:0:threads=1", [0.5, 0.5])
    try:
        cfg.attach(net)
        sgd_train(net, 2, 3)
    finally:
        scheduler.detach(net)
        cfg.close()
    for p, r in zip(net.learnable_params, ref.learnable_params):
        np.testing.assert_allclose(p.data, r.data, rtol=1e-3, atol=1e-5)


def test_model_parallel_flag_reaches_the_executor():
    ap = argparse.ArgumentParser()
    scheduler.add_device_arguments(ap)
    cfg = scheduler.devices_from_args(ap.parse_args(["--devices", "cpu:0:threads=1,cpu:1:threads=1",
                                                     "--share", "0.5,0.5", "--model_parallel", "never"]))
    try:
        assert cfg.model_parallel == "never"
    finally:
        cfg.close()
    with pytest.raises(SystemExit):
        ap.parse_args(["--model_parallel", "sometimes"])
