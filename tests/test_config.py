"""cct.config: configuration objects handed to nets and solvers, scoped overrides, per-thread isolation."""
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import cct
from cct import blas, config, scheduler
from cct.config import BlasConfig, Config, EngineConfig, current, using_config
from cct.errors import CctError
from cct.io.prototxt import parse_text
from cct.lowering import engine
from cct.proto import caffe_pb2
from cct.scheduler import CpuDevice, DataParallelExecutor
from cct.solver import get_solver

NET = """
name: "small"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 4 dim: 2 dim: 9 dim: 9 } shape { dim: 4 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 3 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "ip1" type: "InnerProduct" bottom: "conv1" top: "ip1"
        inner_product_param { num_output: 5 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip1" bottom: "label" top: "loss" }
"""


def net_param() -> caffe_pb2.NetParameter:
    return parse_text(NET, caffe_pb2.NetParameter())


def lowering_name(net) -> str:
    return net.layer_by_name("conv1").lowering.name


@pytest.fixture(autouse=True)
def _restore_default():
    saved = config.default()
    yield
    config.set_default(saved)


def test_two_nets_with_different_configs_in_one_process():
    a_cfg = Config(engine=EngineConfig(overrides={"*": "type3"}))
    b_cfg = a_cfg.replace(engine={"overrides": "type2"})
    a = cct.Net(net_param(), cct.TRAIN, config=a_cfg)
    b = cct.Net(net_param(), cct.TRAIN, config=b_cfg)
    assert a.config is a_cfg and b.config is b_cfg
    assert (lowering_name(a), lowering_name(b)) == ("type3", "type2")
    assert a_cfg.engine.overrides == {"*": "type3"}  # replace() copied, never changed the original
    # A new batch size re-plans each net under its own config, outside any using_config block.
    for net in (a, b):
        net.blobs["data"].reshape((6, 2, 9, 9))
        net.blobs["label"].reshape((6,))
        net.forward()
    assert (lowering_name(a), lowering_name(b)) == ("type3", "type2")
    assert a.layer_by_name("conv1").num == 6
    caffe_mode = cct.Net(net_param(), cct.TRAIN, config=Config(engine=EngineConfig(mode="caffe")))
    assert caffe_mode.layer_by_name("conv1").lowering.batch_partition == 1  # one image per GEMM
    conv1 = a.layer_by_name("conv1").lowering  # cct mode: the chunk size the optimizer's plan chose
    assert conv1.batch_partition == conv1.chosen_plan.b_p >= 1
    assert a.layer_by_name("conv1").plan is conv1.chosen_plan and not a.layer_by_name("conv1").lowering_set_by_user


def test_two_nets_with_different_devices():
    devices = scheduler.make_config([CpuDevice(0, 1), CpuDevice(1, 1)], [0.5, 0.5])
    try:
        split = cct.Net(net_param(), cct.TRAIN, config=Config(devices=devices))
        plain = cct.Net(net_param(), cct.TRAIN, config=Config())
        assert isinstance(split.executor, DataParallelExecutor) and plain.executor is None
        assert scheduler.get_devices() is None  # the process default was never touched
        rng = np.random.default_rng(0)
        for net in (split, plain):
            net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].shape)
            net.blobs["label"].data[...] = [0, 1, 2, 3]
            assert np.isfinite(net.forward())
        scheduler.detach(split)
    finally:
        devices.close()


@pytest.mark.skipif(not blas.mkl_available(), reason="needs MKL")
def test_each_net_runs_its_gemms_on_its_own_blas_backend(monkeypatch):
    from cct.blas import product

    calls = []
    real = product.mkl_gemm
    monkeypatch.setattr(product, "mkl_gemm", lambda *a: calls.append(1) or real(*a))
    on_mkl = cct.Net(net_param(), cct.TEST, config=Config(blas=BlasConfig("mkl")))
    on_openblas = cct.Net(net_param(), cct.TEST, config=Config(blas=BlasConfig("openblas")))
    calls.clear()
    on_openblas.forward()
    assert calls == []
    on_mkl.forward()
    assert calls


def test_using_config_scopes_nests_and_restores_on_exceptions():
    outer = current()
    with using_config(engine={"mode": "caffe"}) as cfg:
        assert current() is cfg and engine.config().mode == "caffe"
        with using_config(blas={"backend": "openblas"}):
            assert current().engine.mode == "caffe" and current().blas.backend == "openblas"
        assert current() is cfg
        net = cct.Net(net_param(), cct.TRAIN)  # no config=: takes the one in effect
    assert net.config is cfg
    assert current() is outer
    with pytest.raises(RuntimeError):
        with using_config(engine={"mode": "caffe"}):
            raise RuntimeError("boom")
    assert current() is outer
    with pytest.raises(ValueError, match="lowering mode"):
        using_config(engine={"mode": "fast"})
    unknown = Config(engine=EngineConfig(overrides="conv1=type9"))  # the names are checked when planned
    assert unknown.engine.overrides == {"conv1": "type9"}
    with pytest.raises(CctError, match="layer 'conv1'.*unknown lowering 'type9'"):
        cct.Net(net_param(), cct.TRAIN, config=unknown)
    with pytest.raises(TypeError):
        using_config()


def test_using_config_is_per_thread():
    inside = threading.Event()
    release = threading.Event()
    seen = {}

    def other():
        inside.wait(5)
        seen["other"] = current().engine.mode  # main is inside its block meanwhile
        with using_config(engine={"mode": "caffe"}):
            seen["other_own"] = current().engine.mode
            release.set()
            inside.wait(5)

    t = threading.Thread(target=other)
    t.start()
    with using_config(engine={"partitions": 2}):
        inside.set()
        release.wait(5)
        seen["main"] = (current().engine.mode, current().engine.partitions)  # other is inside its block
    t.join()
    assert seen == {"other": "cct", "other_own": "caffe", "main": ("cct", 2)}


def test_work_handed_to_workers_runs_under_the_submitters_config():
    dev = CpuDevice(0, 1)
    try:
        with using_config(engine={"partitions": 3}) as cfg:
            assert dev.run(current) is cfg
            with ThreadPoolExecutor(1) as pool:
                assert config.submit_in_context(pool.submit, current).result() is cfg
                assert pool.submit(current).result() is not cfg  # a bare worker thread does not
        assert dev.run(current) is current()
    finally:
        dev.close()


def test_old_setters_change_only_the_default():
    before = cct.Net(net_param(), cct.TRAIN)
    engine.configure(overrides="type3")
    blas.set_backend("openblas")
    assert config.default().engine.overrides == {"*": "type3"} and config.default().blas.backend == "openblas"
    after = cct.Net(net_param(), cct.TRAIN)
    assert lowering_name(after) == "type3" and after.config.blas.backend == "openblas"
    assert before.config.engine.overrides == {}
    with using_config(Config()):  # a scoped config wins over the changed default
        assert engine.config().overrides == {} and current().blas.backend is None
    with pytest.raises(CctError, match="unknown BLAS backend"):
        blas.set_backend("atlas")


def test_solver_hands_its_config_to_every_net(tmp_path):
    solver_param = caffe_pb2.SolverParameter()
    solver_param.net_param.CopyFrom(net_param())
    solver_param.base_lr = 0.01
    solver_param.lr_policy = "fixed"
    solver_param.solver_mode = caffe_pb2.SolverParameter.CPU
    solver_param.max_iter = 1
    solver_param.test_iter.append(1)
    solver_param.test_interval = 10
    cfg = Config(engine=EngineConfig(overrides={"conv1": "type2"}))
    solver = get_solver(solver_param, config=cfg)
    assert solver.config is cfg
    assert solver.net.config is cfg and all(t.config is cfg for t in solver.test_nets)
    assert lowering_name(solver.net) == "type2" and lowering_name(solver.test_nets[0]) == "type2"
    solver.step(1)
    assert solver.iter == 1


def test_a_conv_above_the_data_prices_no_data_gradient():
    """conv1 reads the data (no gradient needed below it): its plan counts forward and weight gradient
    only; with force_backward the data gradient is back in the plan."""
    net = cct.Net(net_param(), cct.TRAIN, config=Config())
    plan = net.layer_by_name("conv1").lowering.chosen_plan
    assert plan.passes == ("fwd", "bwd_weights")
    assert "bwd_data" not in net.layer_by_name("conv1").lowering.plan_report
    assert plan.predicted("total") == pytest.approx(plan.predicted("fwd") + plan.predicted("bwd_weights"))
    forced = net_param()
    forced.force_backward = True
    plan = cct.Net(forced, cct.TRAIN, config=Config()).layer_by_name("conv1").lowering.chosen_plan
    assert plan.passes == ("fwd", "bwd_data", "bwd_weights")


def test_a_deconvolution_above_the_data_prices_its_forward_as_the_data_gradient():
    """A Deconvolution runs the strategy's data gradient forward: without a bottom gradient its plan
    counts bwd_data (its forward) and bwd_weights, not fwd."""
    param = parse_text(NET.replace('type: "Convolution"', 'type: "Deconvolution"'), caffe_pb2.NetParameter())
    plan = cct.Net(param, cct.TRAIN, config=Config()).layer_by_name("conv1").lowering.chosen_plan
    assert plan.passes == ("bwd_data", "bwd_weights")


def test_auto_partitions_are_measured_when_the_net_is_set_up(monkeypatch):
    """``partitions="auto"``: each conv layer's partition counts run whole iterations when the net is built
    (the plan carries the seconds); its forward only executes the count chosen."""
    monkeypatch.setattr(blas, "get_num_threads", lambda: 2)
    net = cct.Net(net_param(), cct.TRAIN, config=Config(engine=EngineConfig(partitions="auto")))
    conv1 = net.layer_by_name("conv1")
    assert set(conv1.plan.partition_seconds) == {1, 2}
    assert conv1.plan.partitions == min(conv1.plan.partition_seconds, key=conv1.plan.partition_seconds.get)
    assert "[partitions measured p=1 " in conv1.plan_report
    assert conv1.lowering.partitions == conv1.plan.partitions  # an int: nothing left to decide in forward
    net.forward()
    net.backward()
