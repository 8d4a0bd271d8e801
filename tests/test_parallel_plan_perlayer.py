"""Any per-layer mix of configurations on MPI ranks (cct.parallel_plan.perlayer): each change between two
differently split layers moves exactly the planner's regions, mixed factorisations (n=2 h=2, n=2 c=2 on 4
ranks) reduce each parameter slice among the ranks sharing it, and every run equals real Caffe's batch-4
LeNet run."""
import json
import shutil

import numpy as np
import pytest
import test_distributed_train as dp
from mpirun import needs_mpi
from test_parallel_plan_spatial import _predicted, _Rank, _train

import cct
from cct.parallel_plan.execute import check_plan, executable
from cct.parallel_plan.graph import graph_from_net
from cct.parallel_plan.perlayer import PerLayerExecutor
from cct.parallel_plan.planfile import read_plan
from cct.parallel_plan.split import PlanError, Split

case = dp.case  # the fixture: a fresh copy of Caffe's solver_sgd_lenet case
pytestmark = [pytest.mark.skipif(not dp.CASE.is_dir(), reason="shared/reference not available"),
              pytest.mark.usefixtures("numpy_kernels")]  # conftest.py: the ranks run the numpy kernels

NODES = ("mnist", "conv1", "pool1", "conv2", "pool2", "ip1", "ip2", "loss")


def _plan_file(path, ranks, splits):
    path.write_text(f"workers: {ranks}\n" + "".join(f"{k}: {splits.get(k, Split(n=ranks))}\n" for k in NODES))
    return path


def _run_plan(case, monkeypatch, ranks, batch, splits, out):
    """Train 10 SGD iterations from Caffe's initial weights under the plan ``splits``; compare with Caffe's
    batch-4 run; return the run's json and the planner's (bytes per step, per forward pass)."""
    plan = _plan_file(case / f"{out}.plan", ranks, splits)
    p = _train(case, ranks, batch, 10, f"{out}.caffemodel", "--init", "init.caffemodel", "--parallel", str(plan))
    return (p, *_check_run(case, monkeypatch, ranks, batch, splits, out))


def _check_run(case, monkeypatch, ranks, batch, splits, out):
    """Compare the run ``out`` under ``splits`` with Caffe's batch-4 run; return its json and the planner's
    (bytes per step, per forward pass)."""
    dp._compare(case / f"{out}.caffemodel", case / "final.caffemodel", 1e-5)
    got = json.loads((case / f"{out}.caffemodel.json").read_text())
    want = json.loads((case / "losses.json").read_text())["losses"]
    assert np.allclose(got["losses"], want, rtol=1e-5)
    monkeypatch.chdir(case)
    return got, _predicted(case / "net.prototxt", ranks, batch, splits)


FOUR = {"conv1": Split(n=2, h=2), "pool1": Split(n=2, w=2), "conv2": Split(n=2, c=2), "pool2": Split(h=2, c=2),
        "ip1": Split(n=2, c=2), "ip2": Split(c=4)}
FEWER = {"conv1": Split(h=2), "pool1": Split(w=4), "conv2": Split(c=2), "pool2": Split(n=2), "ip1": Split(),
         "ip2": Split(c=2)}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """The 4-rank runs below in one launch in one copy of the case: 10 SGD iterations at batch 1 from Caffe's
    initial weights under the plans FOUR and FEWER, and with conv1 to pool2 split h=2 w=2 (given as
    ``spatial:``, as test_parallel_plan_spatial gives its splits). Returns the case folder."""
    case = tmp_path_factory.mktemp("perlayer") / "case"
    shutil.copytree(dp.CASE, case)
    runs = [(case, 1, 10, case / f"{out}.caffemodel", "--init", "init.caffemodel", "--parallel",
             str(_plan_file(case / f"{out}.plan", 4, splits))) for out, splits in (("four", FOUR), ("fewer", FEWER))]
    runs.append((case, 1, 10, case / "quarters.caffemodel", "--init", "init.caffemodel", "--parallel",
                 "spatial:h=2,w=2:conv1,pool1,conv2,pool2"))
    dp._train_runs(4, runs, timeout=180)
    return case


@needs_mpi()
def test_rows_to_channels_and_different_tail_splits_move_the_planned_bytes_on_two_ranks(case, monkeypatch):
    """conv1 and pool1 by height, conv2 and pool2 by channel (pool1's bands go straight to conv2's channel
    split: each rank receives the other band, nothing through the samples), ip1 by channel, ip2 by sample:
    2 ranks at batch 2 equal Caffe's batch-4 run; the bytes received equal the planner's count."""
    splits = {"conv1": Split(h=2), "pool1": Split(h=2), "conv2": Split(c=2), "pool2": Split(c=2),
              "ip1": Split(c=2)}
    p, got, (step, forward) = _run_plan(case, monkeypatch, 2, 2, splits, "mixed")
    assert "conv2 n=1 h=1 w=1 c=2, pool2 n=1 h=1 w=1 c=2, ip1 n=1 h=1 w=1 c=2; every other" in p.stderr
    # by hand, floats each of the 2 ranks receives: data -> conv1 (forward only) 2 samples x 16 of 28 rows;
    # pool1 -> conv2 the other band (4 x 20 x 6 x 12); conv2 -> pool2 none (same channels); pool2 -> ip1 the
    # other 25 channels (4 x 25 x 16); ip1 -> ip2 its samples' other 250 channels (2 x 250); ip2 -> loss none
    by_hand = 2 * 4 * (2 * 16 * 28 + 2 * (4 * 20 * 6 * 12 + 4 * 25 * 16 + 2 * 250))
    assert step == by_hand
    assert sum(got["split_bytes_all"]) == 10 * step + forward
    # all-reduced by data parallelism: conv1 (height split, whole filters) and ip2 (by sample)
    assert got["stats"]["bytes"] == 4 * (20 * 25 + 20 + 500 * 10 + 10)


@needs_mpi()
def test_mixed_factorisations_on_four_ranks_equal_caffe_with_the_planned_bytes(four_ranks, monkeypatch):
    """Below the tail, configurations with two split axes: conv1 n=2 h=2, pool1 n=2 w=2, conv2 n=2 c=2
    (its filter slices' gradients summed by the 2 ranks sharing each), pool2 h=2 c=2, ip1 n=2 c=2, ip2 c=4:
    4 ranks at batch 1 equal Caffe's batch-4 run (slices gathered for the file) with the planner's bytes."""
    got, (step, forward) = _check_run(four_ranks, monkeypatch, 4, 1, FOUR, "four")
    assert sum(got["split_bytes_all"]) == 10 * step + forward
    assert got["stats"]["bytes"] == 4 * (20 * 25 + 20)  # only conv1's filters are whole on every rank


@needs_mpi()
def test_configurations_on_fewer_ranks_equal_caffe_with_the_planned_bytes(four_ranks, monkeypatch):
    """Layers on 2 or 1 of 4 ranks (the others idle for them: they send their part of the input, compute
    nothing): conv1 h=2, pool1 w=4, conv2 c=2, pool2 n=2, ip1 whole on rank 0, ip2 c=2 (its slices broadcast
    to the idle ranks before the snapshot): 4 ranks at batch 1 equal Caffe's batch-4 run with the planner's
    bytes; all-reduced: conv1's and ip1's whole filters."""
    got, (step, forward) = _check_run(four_ranks, monkeypatch, 4, 1, FEWER, "fewer")
    assert sum(got["split_bytes_all"]) == 10 * step + forward
    assert got["stats"]["bytes"] == 4 * (20 * 25 + 20 + 800 * 500 + 500)


@needs_mpi()
def test_rows_and_columns_together_on_four_ranks_equal_caffe(four_ranks, monkeypatch):
    """conv1, pool1, conv2 and pool2 split h=2 w=2 (each rank a quarter of every map): 4 ranks at batch 1
    end with real Caffe's batch-4 weights after 10 SGD iterations, with the planner's byte count. (A spatial
    split, here for the 4-rank launch this module makes anyway.)"""
    case = four_ranks
    dp._compare(case / "quarters.caffemodel", case / "final.caffemodel", 1e-5)
    monkeypatch.chdir(case)
    quarters = {k: Split(h=2, w=2) for k in ("conv1", "pool1", "conv2", "pool2")}
    step, forward = _predicted(case / "net.prototxt", 4, 1, quarters)
    got = json.loads((case / "quarters.caffemodel.json").read_text())
    assert sum(got["split_bytes_all"]) == 10 * step + forward


def test_what_cannot_run_is_refused_naming_the_layer_and_configuration(case, monkeypatch):
    monkeypatch.chdir(case)
    net = cct.Net("net.prototxt", "TRAIN")
    two = _Rank(2)
    for splits, message in [
        ({"conv2": Split(c=3)}, r"layer 'conv2' n=1 h=1 w=1 c=3: uses 3 workers, which does not divide the 2"),
        ({"relu1": Split(c=2)}, r"layer 'relu1' n=1 h=1 w=1 c=2: a ReLU layer runs by sample"),
        ({"conv9": Split(c=2)}, r"no layer 'conv9'"),
        ({"ip2": Split(c=2), "pool2": Split(h=2), "conv2": Split(n=2, c=1)}, None),
    ]:
        if message is None:
            ex = PerLayerExecutor(net, two, splits)  # conv2 n=2 is the sample split: not a step
            assert [net.layer_names[i] for i in ex.splits] == ["pool2", "ip2"]
            continue
        with pytest.raises(PlanError, match=message):
            PerLayerExecutor(net, two, splits)
    with pytest.raises(PlanError, match=r"layer 'conv2' n=1 h=16 w=1 c=1: its output has 8 along h, fewer than"):
        PerLayerExecutor(net, _Rank(16), {"conv2": Split(h=16)})
    _padded_pool = (case / "net.prototxt").read_text().replace("kernel_size: 2", "kernel_size: 2\n    pad: 1", 1)
    (case / "net.prototxt").write_text(_padded_pool)
    net = cct.Net("net.prototxt", "TRAIN")
    PerLayerExecutor(net, two, {"pool1": Split(c=2)})  # padding along an unsplit axis: the copy pads itself


def test_plan_file_lines_that_cannot_run_are_refused_naming_the_file_and_line(case, monkeypatch):
    monkeypatch.chdir(case)
    (case / "net.prototxt").write_text((case / "net.prototxt").read_text().replace("kernel_size: 2", "kernel_size: 2\n"
                                                                                "    pad: 1", 1))
    net = cct.Net("net.prototxt", "TRAIN")
    plan = read_plan(_plan_file(case / "bad.plan", 2, {"pool1": Split(h=2), "conv2": Split(), "loss": Split(c=2)}))
    with pytest.raises(PlanError, match=r"bad.plan: line 4: layer 'pool1' n=1 h=2 w=1 c=1: pools with padding 1"):
        check_plan(plan, net, 2)
    plan.splits["pool1"] = Split(n=2)  # the loss split by channel runs (tests/test_parallel_plan_edges.py)
    check_plan(plan, net, 2)  # conv2 on one of the two ranks runs


BATCHNORM_NET = """name: "bn"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 1 dim: 8 dim: 8 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" convolution_param { num_output: 4 kernel_size: 3 } }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv" }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip" inner_product_param { num_output: 3 } }
"""


def test_auto_searches_only_what_runs_batchnorm_after_a_split_is_refused(tmp_path):
    """The optimum auto executes is searched among the configurations the executor runs (price's keep):
    a convolution followed by BatchNorm keeps n=N, an InnerProduct may take c=N."""
    (tmp_path / "bn.prototxt").write_text(BATCHNORM_NET)
    net = cct.Net(str(tmp_path / "bn.prototxt"), "TRAIN")
    runs = executable(net, 2)
    conv, ip = (node for node in graph_from_net(net).nodes if node.name in ("conv", "ip"))
    assert conv.layers == ["conv", "bn"]
    assert runs(conv, Split(n=2)) and not runs(conv, Split(c=2)) and not runs(conv, Split(h=2))
    assert runs(ip, Split(c=2)) and runs(ip, Split())  # on one of the two ranks too
    with pytest.raises(PlanError, match=r"layer 'bn' n=1 h=1 w=1 c=2: a BatchNorm .* \(it follows layer 'conv'\)"):
        PerLayerExecutor(net, _Rank(2), {"conv": Split(c=2)})
