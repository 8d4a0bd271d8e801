"""Convolution layers split by output channel on MPI ranks (cct.parallel_plan.perlayer, c=N): each rank owns
a slice of the filters, the next layer gathers the channels; every run equals one process at the
global batch (real Caffe's batch-4 run for 2 ranks at batch 2)."""
import json
import re

import numpy as np
import pytest
import test_distributed_train as dp
from mpirun import needs_mpi, run_mpi, script

import cct
from cct.parallel_plan.costs import price
from cct.parallel_plan.graph import graph_from_net
from cct.parallel_plan.perlayer import PerLayerExecutor
from cct.parallel_plan.split import PlanError, Split

case = dp.case  # the fixture: a fresh copy of Caffe's solver_sgd_lenet case
pytestmark = [pytest.mark.skipif(not dp.CASE.is_dir(), reason="shared/reference not available"),
              pytest.mark.usefixtures("numpy_kernels")]  # conftest.py: the ranks run the numpy kernels


def _train(case, ranks, batch, iters, out, *extra):
    args = ["python", script("train_run.py"), str(case), str(batch), str(iters), str(case / out), *extra]
    return run_mpi(ranks, args, timeout=180)


@needs_mpi()
def test_conv1_and_conv2_split_by_channel_equal_caffe_and_one_process(case):
    """LeNet's conv1 (20 filters) and conv2 (50) by output channel: 2 ranks at batch 2 end with real Caffe's
    batch-4 weights and losses after 10 SGD iterations (momentum, weight decay, step lr; the slices and
    their momentum gathered for the file); 3 ranks at batch 2 (uneven slices 6/7/7 and 16/17/17; the split
    given as a plan file) end with one process's at batch 6 and log its test outputs (the slices gathered
    before each test)."""
    p = _train(case, 2, 2, 10, "two.caffemodel", "--init", "init.caffemodel", "--parallel", "conv:conv1,conv2")
    assert "Per-layer splits on 2 MPI ranks: conv1 n=1 h=1 w=1 c=2, conv2 n=1 h=1 w=1 c=2" in p.stderr
    dp._compare(case / "two.caffemodel", case / "final.caffemodel", 1e-5)
    got = json.loads((case / "two.caffemodel.json").read_text())
    want = json.loads((case / "losses.json").read_text())["losses"]
    assert np.allclose(got["losses"], want, rtol=1e-5)
    # only the unsplit layers' gradients are all-reduced: ip1 (800 x 500 + 500), ip2 (500 x 10 + 10)
    assert got["stats"]["bytes"] == 4 * (800 * 500 + 500 + 500 * 10 + 10)
    # floats a rank receives per pass: conv1's input (2 x 784) and its other half of channels (2 x 10 x 576);
    # conv2's input (2 x 20 x 144) and channels (2 x 25 x 64); backward: conv1 its channel gradients only
    # (no input gradient into the data), conv2 channels and its input gradient summed (2 x 20 x 144)
    forward = 2 * 784 + 2 * 10 * 576 + 2 * 20 * 144 + 2 * 25 * 64
    backward = 2 * 10 * 576 + 2 * 25 * 64 + 2 * 20 * 144
    assert got["owt_bytes"] == 4 * (10 * (forward + backward) + forward)  # and the displayed last loss
    # with a TEST net (test_iter 2 every 2 iterations): rank 0 tests the whole net, the slices gathered first
    (case / "solver.prototxt").write_text((case / "solver.prototxt").read_text() + "test_iter: 2\ntest_interval: 2\n")
    one = dp._train(case, 0, 6, 4, case / "one.caffemodel", "--init", "init.caffemodel", "--test_batch", "4")
    (case / "convs.plan").write_text("workers: 3\n" + "".join(
        f"{name}: {'n=1 h=1 w=1 c=3' if name.startswith('conv') else 'n=3 h=1 w=1 c=1'}\n"
        for name in ("mnist", "conv1", "pool1", "conv2", "pool2", "ip1", "ip2", "loss")))
    three = _train(case, 3, 2, 4, "three.caffemodel", "--init", "init.caffemodel", "--parallel",
                   str(case / "convs.plan"), "--test_batch", "4")  # the same split from a plan file
    assert "Per-layer splits on 3 MPI ranks: conv1 n=1 h=1 w=1 c=3, conv2 n=1 h=1 w=1 c=3" in three.stderr
    dp._compare(case / "three.caffemodel", case / "one.caffemodel", 1e-5)
    outputs = re.compile(r"Test net output #\d+: (\w+) = ([-\d.e]+)")
    got, want = outputs.findall(three.stderr), outputs.findall(one.stderr)
    assert len(got) == 6 and [n for n, _ in got] == [n for n, _ in want]
    assert np.allclose([float(v) for _, v in got], [float(v) for _, v in want], rtol=1e-5, atol=1e-6)


class _OneRank:
    size, rank = 64, 0


def test_more_parts_than_filters_are_refused_by_name(case, monkeypatch):
    monkeypatch.chdir(case)  # the HDF5 list names data.h5 relative to the case
    net = cct.Net("net.prototxt", "TRAIN")
    with pytest.raises(PlanError, match="layer 'conv1' n=1 h=1 w=1 c=64: its output has 20 along c, fewer than its 64"):
        PerLayerExecutor(net, _OneRank(), {"conv1": Split(c=64)})


def flat_priced(case, monkeypatch):
    """LeNet's plan graph priced for 2 workers at batch 8 (compute free, unit links): the executed family's
    rules only look at the configurations."""
    monkeypatch.chdir(case)
    net = cct.Net("net.prototxt", "TRAIN")
    return price(graph_from_net(net, 8), 2, np.ones((2, 2)) - np.eye(2), type("Flat", (), {
        "seconds": lambda self, g, i, s: np.zeros(len(s))})())
