"""Convolution and pooling layers split by height and width on MPI ranks (cct.parallel_plan.perlayer, h and w): each
rank computes a band of the output rows (or columns) for the whole batch, exchanging halos with its
neighbours; every run equals one process at the global batch (real Caffe's batch-4 run for 2 ranks at
batch 2) and moves exactly the bytes the planner predicts."""
import json
import shutil

import numpy as np
import pytest
import test_distributed_train as dp
from mpirun import needs_mpi, run_mpi, script

import cct
from cct.io.prototxt import read_net_prototxt, write_text_file
from cct.parallel_plan.boxexchange import intersect
from cct.parallel_plan.graph import graph_from_net
from cct.parallel_plan.perlayer import PerLayerExecutor
from cct.parallel_plan.split import PlanError, Split
from cct.parallel_plan.transfer import edge_cost

case = dp.case  # the fixture: a fresh copy of Caffe's solver_sgd_lenet case
pytestmark = [pytest.mark.skipif(not dp.CASE.is_dir(), reason="shared/reference not available"),
              pytest.mark.usefixtures("numpy_kernels")]  # conftest.py: the ranks run the numpy kernels


def _train(case, ranks, batch, iters, out, *extra):
    args = ["python", script("train_run.py"), str(case), str(batch), str(iters), str(case / out), *extra]
    return run_mpi(ranks, args, timeout=180)


def _predicted(net_path, ranks, batch, splits):
    """The planner's bytes per step (forward and backward) and per forward pass for ``splits`` (node name
    -> Split; every other node by sample), from :func:`~cct.parallel_plan.transfer.edge_cost`."""
    net = cct.Net(str(net_path), "TRAIN")
    graph = graph_from_net(net, ranks * batch)
    chosen = [splits.get(node.name, Split(n=ranks)) for node in graph.nodes]
    inv_bw = np.ones((ranks, ranks))
    step = forward = 0.0
    for u, t, v, b in graph.edges():
        cost = edge_cost(graph, (u, t, v, b), [chosen[u]], [chosen[v]], inv_bw)
        step += float(cost.bytes[0, 0])
        one_way = graph.nodes[u].kind == "source" or graph.nodes[v].kind == "metric" or \
            (graph.nodes[v].kind == "loss" and b == 1)  # no gradient into data, labels or an Accuracy
        forward += float(cost.bytes[0, 0]) / (1 if one_way else 2)
    return step, forward


MIXED = {"mnist": "n=2", "conv1": "h=2", "pool1": "h=2", "conv2": "c=2", "pool2": "n=2", "ip1": "c=2", "ip2": "c=2",
         "loss": "n=2"}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The 2-rank runs the tests below check, in one launch in one copy of the case, from Caffe's initial
    weights for 10 iterations at batch 2: conv1, pool1 and conv2 by height; the plan file MIXED. Returns the
    case folder and each run's log by name."""
    case = tmp_path_factory.mktemp("spatial") / "case"
    shutil.copytree(dp.CASE, case)
    (case / "mixed.plan").write_text("workers: 2\n" + "".join(f"{k}: {v}\n" for k, v in MIXED.items()))
    runs = {"h=2": (case, 2, 10, case / "two.caffemodel", "--init", "init.caffemodel", "--parallel",
                    "spatial:h=2:conv1,pool1,conv2"),
            "mixed": (case, 2, 10, case / "mixed.caffemodel", "--init", "init.caffemodel", "--parallel",
                      str(case / "mixed.plan"))}
    return case, dict(zip(runs, dp._train_runs(2, list(runs.values()), timeout=180)[1]))


@needs_mpi()
def test_lenet_split_by_height_on_two_ranks_equals_caffe_with_the_predicted_bytes(two_ranks, monkeypatch):
    """conv1, pool1 and conv2 split h=2 (bands of 12, 6 and 4 rows; conv2's 5x5 kernel reads 2 rows of
    the neighbour's pool1 band): 2 ranks at batch 2 end with real Caffe's batch-4 weights and losses after
    10 SGD iterations; the bytes the ranks receive equal the planner's count (10 steps and the final
    forward pass that displays the last loss)."""
    case, logs = two_ranks
    assert "Per-layer splits on 2 MPI ranks: conv1 n=1 h=2 w=1 c=1, pool1 n=1 h=2 w=1 c=1, conv2 n=1 h=2" in logs["h=2"]
    dp._compare(case / "two.caffemodel", case / "final.caffemodel", 1e-5)
    got = json.loads((case / "two.caffemodel.json").read_text())
    want = json.loads((case / "losses.json").read_text())["losses"]
    assert np.allclose(got["losses"], want, rtol=1e-5)
    monkeypatch.chdir(case)
    step, forward = _predicted(case / "net.prototxt", 2, 2, {k: Split(h=2) for k in ("conv1", "pool1", "conv2")})
    # by hand: data -> conv1 (forward only): each rank gets the other's 2 samples, 16 of 28 rows;
    # pool1 -> conv2: 2 halo rows of 20 x 12 for 4 samples each way; conv2 -> pool2 (its samples, the
    # other band: 4 of 8 rows of 50 x 8); the last two forward and backward
    by_hand = 4 * 2 * (2 * 16 * 28 + 2 * (4 * 20 * 2 * 12) + 2 * (2 * 50 * 4 * 8))
    assert step == by_hand
    assert sum(got["split_bytes_all"]) == 10 * step + forward


# rows and columns together (h=2 w=2) on 4 ranks: test_parallel_plan_perlayer.py, in its 4-rank launch


def _padded_net(case):
    """LeNet made like cifar10_quick: padded convolutions (pad 2), 3x3 stride-2 pooling (Caffe's ceil
    rounding clips the last window), an in-place ReLU after pool1, average pooling; 50*7*7 inputs to ip1."""
    net = read_net_prototxt(str(case / "net.prototxt"))
    by_name = {layer.name: layer for layer in net.layer}
    for name in ("conv1", "conv2"):
        by_name[name].convolution_param.pad.append(2)
    for name in ("pool1", "pool2"):
        by_name[name].pooling_param.kernel_size = 3
    by_name["pool2"].pooling_param.pool = by_name["pool2"].pooling_param.AVE
    relu = net.layer.add()
    relu.CopyFrom(by_name["relu1"])
    relu.name, relu.bottom[0], relu.top[0] = "relu_pool1", "pool1", "pool1"
    layers = list(net.layer)
    layers.insert([x.name for x in layers].index("pool1") + 1, layers.pop())
    del net.layer[:]
    net.layer.extend(layers)
    write_text_file(case / "net.prototxt", net)


@needs_mpi()
def test_padded_uneven_and_changing_bands_on_three_ranks_equal_one_process(case, monkeypatch):
    """The padded net on 3 ranks at batch 2: conv1 and pool1 (with its in-place ReLU) split h=3 (28 rows:
    9/9/10 with explicit zero padding; 14 rows: 4/5/5), conv2 and pool2 split w=3 (14 columns: 4/5/5, 7:
    2/2/3): the change from rows to columns is one exchange; 4 SGD iterations end with one process's
    weights at batch 6 (fresh weights: the same seed), with the planner's byte count. The splits are
    given as a plan file (``cct train --parallel FILE``)."""
    _padded_net(case)
    one = dp._train(case, 0, 6, 4, case / "one.caffemodel")
    nodes = {"mnist": "n=3", "conv1": "h=3", "pool1": "h=3", "conv2": "w=3", "pool2": "w=3", "ip1": "n=3",
             "ip2": "n=3", "loss": "n=3"}
    (case / "bands.plan").write_text("workers: 3\n" + "".join(f"{k}: {v}\n" for k, v in nodes.items()))
    mixed = _train(case, 3, 2, 4, "mixed.caffemodel", "--parallel", str(case / "bands.plan"))  # as cct train runs it
    assert ("Per-layer splits on 3 MPI ranks: conv1 n=1 h=3 w=1 c=1, pool1 n=1 h=3 w=1 c=1, conv2 n=1 h=1 w=3 c=1, "
            "pool2 n=1 h=1 w=3 c=1; every other layer by sample") in mixed.stderr
    dp._compare(case / "mixed.caffemodel", case / "one.caffemodel", 1e-5)
    assert "loss = " in one.stderr
    monkeypatch.chdir(case)
    splits = {"conv1": Split(h=3), "pool1": Split(h=3), "conv2": Split(w=3), "pool2": Split(w=3)}
    step, forward = _predicted(case / "net.prototxt", 3, 2, splits)
    got = json.loads((case / "mixed.caffemodel.json").read_text())
    assert sum(got["split_bytes_all"]) == 4 * step + forward


class _Rank:
    def __init__(self, size, rank=0):
        self.size, self.rank = size, rank


def test_layers_that_cannot_be_split_spatially_are_refused_by_name(case, monkeypatch):
    monkeypatch.chdir(case)
    net = cct.Net("net.prototxt", "TRAIN")
    with pytest.raises(PlanError, match="layer 'ip1' n=1 h=2 w=1 c=1: its output has 1 along h, fewer than its 2"):
        PerLayerExecutor(net, _Rank(2), {"ip1": Split(h=2)})
    with pytest.raises(PlanError, match="layer 'conv2' n=1 h=16 w=1 c=1: its output has 8 along h, fewer than its 16"):
        PerLayerExecutor(net, _Rank(16), {"conv2": Split(h=16)})
    _padded_net(case)
    net = cct.Net("net.prototxt", "TRAIN")
    # the last of 3 bands of the padded conv1's 28 rows is [18, 28): it reads rows [16, 30) of the padded
    # input (2 explicit zero rows past the end); the width keeps its padding (the copy pads it itself)
    ex = PerLayerExecutor(net, _Rank(3, 2), {"conv1": Split(h=3), "pool1": Split(w=3)})
    step = ex.steps[net.layer_names.index("conv1")]
    assert step.inp.shape == (3 * net.blobs["data"].shape[0], 1, 14, 28) and step.out.shape[2:] == (10, 28)
    assert step.fetch.need_origin.tolist() == [0, 0, 16, 0]
    # pool1 by columns reads conv1's rows 18-27 from this rank, the others from ranks 0 and 1
    pool = ex.steps[net.layer_names.index("pool1")]
    assert [q for q, _ in pool.fetch.recvs] == [0, 1] and pool.source.blob is step.out
    text = (case / "net.prototxt").read_text()
    (case / "net.prototxt").write_text(text.replace("kernel_size: 3", "kernel_size: 3\n    pad: 1", 1))
    net = cct.Net("net.prototxt", "TRAIN")
    with pytest.raises(PlanError, match="layer 'pool1' n=1 h=2 w=1 c=1: pools with padding 1 along the split height"):
        PerLayerExecutor(net, _Rank(2), {"pool1": Split(h=2)})


def test_intersections_of_boxes():
    a = np.array([[0, 4], [0, 3], [0, 10], [0, 5]])
    b = np.array([[2, 6], [0, 3], [8, 12], [1, 2]])
    assert intersect(a, b).tolist() == [[2, 4], [0, 3], [8, 10], [1, 2]]
    assert intersect(a, b + np.array([[0, 0], [0, 0], [2, 2], [0, 0]])) is None


@needs_mpi()
def test_spatial_channel_and_tail_splits_together_equal_caffe(two_ranks):
    """One plan, three kinds of split (cct.parallel_plan.perlayer): conv1 and pool1 by height, conv2 by
    output channel, the fully-connected tail by output channel (OWT): 2 ranks at batch 2 end with real
    Caffe's batch-4 weights after 10 SGD iterations (snapshot files gathered as usual)."""
    case, logs = two_ranks
    assert ("Per-layer splits on 2 MPI ranks: conv1 n=1 h=2 w=1 c=1, pool1 n=1 h=2 w=1 c=1, conv2 n=1 h=1 w=1 c=2, "
            "ip1 n=1 h=1 w=1 c=2, ip2 n=1 h=1 w=1 c=2; every other layer by sample") in logs["mixed"]
    dp._compare(case / "mixed.caffemodel", case / "final.caffemodel", 1e-5)
    got = json.loads((case / "mixed.caffemodel.json").read_text())
    want = json.loads((case / "losses.json").read_text())["losses"]
    assert np.allclose(got["losses"], want, rtol=1e-5)
    # only conv1's gradients are all-reduced (split by height, every rank holds its whole filters)
    assert got["stats"]["bytes"] == 4 * (20 * 25 + 20)
