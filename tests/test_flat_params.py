"""Flat parameter buffers (cct.net.flat_params): every learnable param's data and diff is a view of the flat
buffers, and stays one after what writes weights: weight sharing, test nets sharing the train net's weights,
copy_from (binary and HDF5 caffemodels), the pycaffe shim, snapshot/restore, the device scheduler (two
data-parallel MPI ranks: test_distributed_train.py)."""
from __future__ import annotations

import numpy as np
import pytest

import caffe
from cct import scheduler
from cct.io.prototxt import parse_text
from cct.net import Net
from cct.net.flat_params import FlatParams
from cct.proto import caffe_pb2
from cct.scheduler import CpuDevice
from cct.solver import get_solver

NET = """
name: "flat"
layer { name: "data" type: "DummyData" top: "x" top: "y"
  dummy_data_param { shape { dim: 4 dim: 2 dim: 6 dim: 6 } shape { dim: 4 dim: 5 }
                     data_filler { type: "gaussian" std: 1 } data_filler { type: "gaussian" std: 1 } } }
layer { name: "conv" type: "Convolution" bottom: "x" top: "c"
  param { lr_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
  convolution_param { num_output: 3 kernel_size: 3 weight_filler { type: "gaussian" std: 0.3 }
                      bias_filler { type: "gaussian" std: 0.3 } } }
layer { name: "ip1" type: "InnerProduct" bottom: "c" top: "h1"
  param { name: "shared" lr_mult: 1 } param { lr_mult: 0 }
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.3 }
                        bias_filler { type: "gaussian" std: 0.3 } } }
layer { name: "ip2" type: "InnerProduct" bottom: "c" top: "h2"
  param { name: "shared" } param { lr_mult: 1 }
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.3 }
                        bias_filler { type: "gaussian" std: 0.3 } } }
layer { name: "sum" type: "Eltwise" bottom: "h1" bottom: "h2" top: "h" }
layer { name: "loss" type: "EuclideanLoss" bottom: "h" bottom: "y" top: "loss" }
"""


def net_param() -> caffe_pb2.NetParameter:
    return parse_text(NET, caffe_pb2.NetParameter())


def solver_param(tmp_path, kind="Adam", **fields) -> caffe_pb2.SolverParameter:
    sp = caffe_pb2.SolverParameter(type=kind, base_lr=0.01, momentum=0.9, momentum2=0.999, weight_decay=1e-3,
                                   lr_policy="fixed", max_iter=100, display=0, random_seed=3, delta=1e-8,
                                   snapshot_prefix=str(tmp_path / "flat"), **fields)
    sp.net_param.CopyFrom(net_param())
    sp.test_iter.append(1)
    sp.test_interval = 1000
    sp.solver_mode = caffe_pb2.SolverParameter.CPU
    return sp


def assert_flat(net: Net) -> None:
    """Every learnable param is its segment of the flat buffers; each weight-shared copy aliases its owner."""
    flat = net.flat_params
    assert flat is not None and flat.intact()
    (g,) = flat.groups
    assert g.data.ndim == 1 and g.data.size >= sum(p.count for p in net.learnable_params)
    for i, o, n in zip(g.param_ids, g.offsets, g.sizes):
        p = net.learnable_params[i]
        assert np.shares_memory(p.data, g.data[o:o + n]) and np.shares_memory(p.diff, g.diff[o:o + n])
        assert p.data.ctypes.data % 64 == 0 and p.diff.ctypes.data % 64 == 0
    for nid, owner in enumerate(net.param_owners):
        if owner >= 0:
            assert np.shares_memory(net._all_params[nid].data, g.data)
            assert np.shares_memory(net._all_params[nid].diff, g.diff)


def test_flatten_keeps_values_and_aliases_every_param():
    net = Net(net_param(), phase="TRAIN")
    before = [(p.data.copy(), p.diff.copy()) for p in net.learnable_params]
    assert net.flat_params is None
    flat = net.flatten_params()
    assert_flat(net)
    assert len(net.learnable_params) == 5  # the shared weight counts once
    for p, (d, g) in zip(net.learnable_params, before):
        np.testing.assert_array_equal(p.data, d)
        np.testing.assert_array_equal(p.diff, g)
    g = flat.groups[0]
    assert g.offsets == [0, 64, 80, 320, 336] and g.sizes == [54, 3, 240, 5, 5]  # 64-byte aligned
    # writes through a blob land in the buffer and the other way round
    net.learnable_params[2].data[...] = 7
    assert np.all(g.data[80:320] == 7)
    g.diff[:54] = 2
    assert np.all(net.learnable_params[0].diff == 2)
    # the shared copy (ip2's weight) sees the owner's segment
    ip2_w = net.layer_by_name("ip2").blobs[0]
    assert np.all(ip2_w.data == 7)
    assert net.flatten_params() is flat  # intact: the same layout
    # forward/backward write diffs into the buffer
    net.clear_param_diffs()
    net.forward_backward()
    assert np.abs(g.diff).sum() > 0 and flat.intact()


def test_layout_helpers():
    net = Net(net_param(), phase="TRAIN")
    g = net.flatten_params().groups[0]
    lr = g.per_element([1, 2, 3, 4, 5])
    assert lr.dtype == np.float32 and lr.size == g.size
    np.testing.assert_array_equal(lr[[0, 53, 64, 66, 80, 319, 320, 324, 336, 340]], [1, 1, 2, 2, 3, 3, 4, 4, 5, 5])
    assert not lr[54:64].any() and not lr[341:].any()  # the alignment gaps
    np.testing.assert_array_equal(g.segment_starts(), [0, 64, 80, 320, 336])
    np.testing.assert_array_equal(g.segment_ends(), [54, 67, 320, 325, 341])
    np.testing.assert_array_equal(g.per_segment([0.5, 1, 2, 3, 4]), np.float32([0.5, 1, 2, 3, 4]))
    bufs, views = net.flat_params.histories(2)
    assert len(bufs) == 2 and len(views) == 10
    for k in range(2):
        for i, p in enumerate(net.learnable_params):
            v = views[k * 5 + i]
            assert v.shape == p.shape and np.shares_memory(v, bufs[k][0]) and not v.any()


def test_rebinding_a_param_breaks_intact():
    net = Net(net_param(), phase="TRAIN")
    flat = net.flatten_params()
    net.learnable_params[1].data = np.zeros(3, np.float32)
    assert not flat.intact()
    # flattening again builds a new layout from the current arrays
    net.learnable_params[1].data[...] = 4
    flat2 = net.flatten_params()
    assert flat2 is not flat and flat2.intact()
    assert np.all(flat2.groups[0].data[64:67] == 4)


def test_mixed_dtypes_make_one_group_each():
    from cct.blob import Blob

    blobs = [Blob((2, 3), np.float32), Blob((4,), np.float64), Blob((5,), np.float32)]
    for k, b in enumerate(blobs):
        b.data[...] = k + 1
    flat = FlatParams(blobs)
    assert [g.dtype for g in flat.groups] == [np.float32, np.float64]
    assert flat.groups[0].param_ids == [0, 2] and flat.groups[0].offsets == [0, 16]
    assert flat.intact() and np.all(flat.groups[1].data[:4] == 2) and not flat.groups[1].data[4:].any()


def test_solver_setup_test_nets_and_steps(tmp_path):
    s = get_solver(solver_param(tmp_path))
    assert_flat(s.net)
    g = s.net.flat_params.groups[0]
    assert len(s.history_buffers) == 2 and len(s.history) == 10
    for h in s.history:
        assert np.shares_memory(h, s.history_buffers[0][0]) or np.shares_memory(h, s.history_buffers[1][0])
    test = s.test_nets[0]
    for p in test.learnable_params:
        assert np.shares_memory(p.data, g.data)
    s.step(2)
    s.test(0)
    assert_flat(s.net)
    for p in test.learnable_params:
        assert np.shares_memory(p.data, g.data)
    assert np.abs(s.history_buffers[1][0]).sum() > 0


@pytest.mark.parametrize("fmt", ["BINARYPROTO", "HDF5"])
def test_snapshot_restore_and_copy_from_keep_views(tmp_path, fmt):
    sp = solver_param(tmp_path, snapshot_format=getattr(caffe_pb2.SolverParameter, fmt))
    s = get_solver(sp)
    s.step(3)
    model = s.snapshot()
    state = model.replace(".caffemodel", ".solverstate")
    weights = [p.data.copy() for p in s.net.learnable_params]
    history = [h.copy() for h in s.history]
    s.step(1)  # the straight run goes on (the resumed one below draws the same data after restore)
    s2 = get_solver(sp)
    s2.restore(state)
    assert_flat(s2.net)
    for p, w in zip(s2.net.learnable_params, weights):
        np.testing.assert_array_equal(p.data, w)
    for h, want, in zip(s2.history, history):
        np.testing.assert_array_equal(h, want)
    assert all(np.shares_memory(h, s2.history_buffers[0][0]) for h in s2.history[:5])
    # the resumed run goes on as the first did
    s2.step(1)
    for p, q in zip(s.net.learnable_params, s2.net.learnable_params):
        np.testing.assert_array_equal(p.data, q.data)
    # copy_from straight into a flattened net
    net = Net(net_param(), phase="TRAIN")
    net.flatten_params()
    net.copy_from(model)
    assert_flat(net)
    for p, w in zip(net.learnable_params, weights):
        np.testing.assert_array_equal(p.data, w)


def test_pycaffe_shim_writes_land_in_the_buffer(tmp_path):
    path = tmp_path / "solver.prototxt"
    sp = solver_param(tmp_path, kind="SGD")
    path.write_text(str(sp))
    solver = caffe.SGDSolver(str(path))
    inner = solver._solver.net
    solver.net.params["conv"][0].data[...] = 0.5
    solver.net.params["ip2"][1].data[...] = -1
    g = inner.flat_params.groups[0]
    assert np.all(g.data[:54] == 0.5) and np.all(g.data[336:341] == -1)
    solver.test_nets[0].share_with(solver.net)
    solver.share_weights(solver.test_nets[0])
    assert_flat(inner)
    solver.step(1)
    assert_flat(inner)
    assert not np.all(g.data[:54] == 0.5)


def test_device_scheduler_keeps_the_views(tmp_path):
    """Two CPU devices (the data-parallel executor: shadows view the master params) train the flat net as a
    single device does."""
    single = get_solver(solver_param(tmp_path, kind="SGD"))
    single.step(3)
    split = get_solver(solver_param(tmp_path, kind="SGD"))
    devices = scheduler.make_config([CpuDevice(0, 1), CpuDevice(1, 1)], [0.5, 0.5], None)
    devices.attach(split.net)
    try:
        split.step(3)
        assert_flat(split.net)
    finally:
        scheduler.detach(split.net)
        devices.close()
    for p, r in zip(split.net.learnable_params, single.net.learnable_params):
        np.testing.assert_allclose(p.data, r.data, rtol=1e-5, atol=1e-6)


# Two MPI ranks (the gradient all-reduce writes into the diffs) train LeNet with the views intact: asserted on
# test_distributed_train.py's 2-rank runs (flat_params_intact in test_two_ranks_at_batch_2_equal_caffe_at_batch_4),
# which share one launch instead of starting one more here.


def test_solver_setup_logs_no_extra_sharing(tmp_path, caplog):
    """The train net is flat before the test nets share its weights: setup shares (and logs) once, as before."""
    import logging

    sp = solver_param(tmp_path)
    parse_text('layer { name: "train_only" type: "Silence" bottom: "h" include { phase: TRAIN } }', sp.net_param)
    with caplog.at_level(logging.INFO, logger="cct"):
        s = get_solver(sp)
    ignoring = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Ignoring source layer")]
    assert ignoring == ["Ignoring source layer h_sum_0_split", "Ignoring source layer train_only"]  # once each
    assert s.net.flat_params.intact()
    g = s.net.flat_params.groups[0]
    assert all(np.shares_memory(p.data, g.data) for p in s.test_nets[0].learnable_params)
