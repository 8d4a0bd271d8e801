"""The per-layer executor's edges (cct.parallel_plan.perlayer, issue 32): a data layer split by rows (each rank
reads the global batch and keeps its band), a SoftmaxWithLoss split by channel
(the softmax's maximum and sum reduced over the ranks holding the channel slices) and by sample, height and
width (per-position losses on bands, the normalizer counted over the global batch; ignore_label and the
normalization modes), a blob read by several layers (Caffe's Split layer run on its box), and grouped
convolutions split by channel (c dividing the groups or the groups dividing c). Each run equals one process at
the global batch; the bytes the ranks receive equal the planner's count."""
import json
import re

import h5py
import numpy as np
import pytest
import test_distributed_train as dp
from mpirun import needs_mpi, run_mpi, script
from test_parallel_plan_owt import train
from test_parallel_plan_perlayer import _plan_file
from test_parallel_plan_spatial import _predicted, _Rank

import cct
from cct.cli import main
from cct.parallel_plan.costs import price
from cct.parallel_plan.graph import graph_from_net
from cct.parallel_plan.perlayer import PerLayerExecutor, group_refusal
from cct.parallel_plan.split import PlanError, Split
from cct.parallel_plan.transfer import loss_reduction_cost

case = dp.case  # the fixture: a fresh copy of Caffe's solver_sgd_lenet case
pytestmark = [pytest.mark.skipif(not dp.CASE.is_dir(), reason="shared/reference not available"),
              pytest.mark.usefixtures("numpy_kernels")]  # conftest.py: the ranks run the numpy kernels

#: a fully-convolutional net: per-pixel labels (255 ignored), conv1 normalised in place (LRN), read by two grouped
#: convolutions (a Split),
#: their sum's scores read by three losses (VALID, NONE, BATCH_SIZE; another Split), the labels by three too
FCN = """name: "fcn"
layer { name: "data" type: "HDF5Data" top: "data" top: "label"
        hdf5_data_param { source: "fcn_list.txt" batch_size: 1 } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "norm1" type: "LRN" bottom: "conv1" top: "conv1" lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 } }
layer { name: "conv2a" type: "Convolution" bottom: "conv1" top: "conv2a"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 group: 4 weight_filler { type: "gaussian" std: 0.3 }
                            bias_filler { type: "constant" value: 0.1 } } }
layer { name: "conv2b" type: "Convolution" bottom: "conv1" top: "conv2b"
        convolution_param { num_output: 4 kernel_size: 1 group: 2 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "score" type: "Eltwise" bottom: "conv2a" bottom: "conv2b" top: "score" }
layer { name: "loss_valid" type: "SoftmaxWithLoss" bottom: "score" bottom: "label" top: "loss_valid"
        loss_param { ignore_label: 255 } }
layer { name: "loss_none" type: "SoftmaxWithLoss" bottom: "score" bottom: "label" top: "loss_none"
        loss_weight: 0.01 loss_param { ignore_label: 255 normalization: NONE } }
layer { name: "loss_batch" type: "SoftmaxWithLoss" bottom: "score" bottom: "label" top: "loss_batch"
        loss_weight: 0.5 loss_param { ignore_label: 255 normalization: BATCH_SIZE } }
layer { name: "acc" type: "Accuracy" bottom: "score" bottom: "label" top: "acc"
        accuracy_param { ignore_label: 255 top_k: 2 } }
"""
SOLVER = """net: "fcn.prototxt"
base_lr: 0.05 momentum: 0.9 weight_decay: 0.001 lr_policy: "fixed" max_iter: 4 display: 1 random_seed: 5
snapshot: 0 snapshot_prefix: "fcn" solver_mode: CPU type: "SGD"
"""


def _fcn_case(case):
    """The FCN net, its solver and 16 records of 2x6x6 inputs with 6x6 labels in 0..3 (a fifth 255)."""
    rng = np.random.default_rng(32)
    labels = rng.integers(0, 4, (16, 1, 6, 6)).astype(np.float32)
    labels[rng.random(labels.shape) < 0.2] = 255
    with h5py.File(case / "fcn.h5", "w") as f:
        f["data"] = rng.standard_normal((16, 2, 6, 6)).astype(np.float32)
        f["label"] = labels
    (case / "fcn_list.txt").write_text("fcn.h5\n")
    (case / "fcn.prototxt").write_text(FCN)
    (case / "solver.prototxt").write_text(SOLVER)


def _planned(net_path, ranks, batch, splits):
    """The planner's bytes per step and per forward pass of the exchanges (``_predicted``), and the split
    losses' channel reductions per forward pass (the loss nodes' update, :func:`~cct.parallel_plan.costs.price`)."""
    step, forward = _predicted(net_path, ranks, batch, splits)
    graph = graph_from_net(cct.Net(str(net_path), "TRAIN"), ranks * batch)
    chosen = [splits.get(node.name, Split(n=ranks)) for node in graph.nodes]
    priced = price(graph, ranks, np.ones((ranks, ranks)), _NoCompute())
    losses = sum(float(priced.update[i].bytes[0, priced.index_of(i, chosen[i])])
                 for i, node in enumerate(graph.nodes) if node.kind in ("loss", "metric"))
    return step, forward, losses


class _NoCompute:
    def seconds(self, graph, index, splits):
        return np.zeros(len(splits))


@needs_mpi()
def test_lenet_data_split_by_rows_and_loss_by_channel_equal_caffe_with_the_planned_bytes(case, monkeypatch):
    """2 ranks at batch 2: the data layer split h=2 (each rank reads the global batch of 4 and keeps 14 of the 28
    rows of every image; the labels, one per sample, all on the second rank: the planner's boxes), conv1 and
    pool1 by rows (conv1 receives only its 2 halo rows), ip1, ip2 and the loss c=2 (each rank holds 5 of the 10
    scores, the two reduce the softmax's maximum and sum: 4 positions, 16 bytes each way per array; the rank
    holding a sample's label channel adds its loss; normalized FULL): 10 SGD iterations equal real Caffe's
    batch-4 weights and losses, the bytes the planner's."""
    splits = {"mnist": Split(h=2), "conv1": Split(h=2), "pool1": Split(h=2), "ip1": Split(c=2), "ip2": Split(c=2),
              "loss": Split(c=2)}
    net = (case / "net.prototxt").read_text()  # FULL: the N*1*1 positions of the global batch, as Caffe's VALID
    full = net.replace('top: "loss"\n', 'top: "loss"\n  loss_param { normalization: FULL }\n')
    assert full != net
    (case / "net.prototxt").write_text(full)
    p = train(case, 2, 2, 10, "split.caffemodel", "--init", "init.caffemodel", "--parallel",
              "spatial:h=2:mnist,conv1,pool1;c=2:ip1,ip2,loss")
    assert "Per-layer splits on 2 MPI ranks: mnist n=1 h=2 w=1 c=1, conv1" in p.stderr
    assert "ip2 n=1 h=1 w=1 c=2, loss n=1 h=1 w=1 c=2; every other layer by sample" in p.stderr
    dp._compare(case / "split.caffemodel", case / "final.caffemodel", 1e-5)
    got = json.loads((case / "split.caffemodel.json").read_text())
    want = json.loads((case / "losses.json").read_text())["losses"]
    assert np.allclose(got["losses"], want, rtol=1e-5)
    monkeypatch.chdir(case)
    step, forward, losses = _planned(case / "net.prototxt", 2, 2, splits)
    # by hand, floats: data -> conv1 2 halo rows of 4 samples x 28 (forward, each rank); the first rank the 4
    # labels (forward); pool1 -> conv2 (by sample) the other band of 2 samples (2 x 20 x 6 x 12), pool2 -> ip1
    # the other 2 samples (2 x 800), ip1 -> ip2 the other 250 channels of 4 samples, forward and backward
    assert step == 4 * (2 * 2 * 4 * 28 + 4 + 2 * 2 * (2 * 20 * 6 * 12 + 2 * 800 + 4 * 250))
    assert losses == 2 * 2 * 4 * 4  # 2 ranks x 2 arrays x 4 positions x 4 bytes
    assert sum(got["split_bytes_all"]) == 10 * step + forward
    assert sum(got["loss_bytes_all"]) == 11 * losses  # 10 steps and the last forward pass


FCN_SPLITS = {"data": Split(n=2, c=2), "label_data_1_split": Split(h=2, w=2), "conv1": Split(h=2, w=2),
              "norm1": Split(n=2, c=2), "conv1_norm1_0_split": Split(h=2, w=2), "conv2a": Split(n=2, c=2),
              "conv2b": Split(c=4), "score": Split(h=2, c=2), "score_score_0_split": Split(h=2, c=2),
              "loss_valid": Split(h=2, c=2), "loss_none": Split(w=4), "acc": Split(c=4)}


@needs_mpi()
def test_fcn_with_split_losses_fan_out_and_grouped_convolutions_equals_one_process(case, monkeypatch):
    """4 ranks at batch 1: the data split n=2 c=2 (each rank reads the global batch and keeps one channel of
    half the images; the one-channel labels of each half on the rank of the second channel), conv1 by
    quarters, the labels read through their Split by quarters, conv1's LRN in place n=2 c=2 (a channel halo),
    read through its Split by two grouped convolutions (conv2a c=2: two of its 4 groups each, conv2b c=4: half
    of one of its 2 groups each), their sum split h=2 c=2 read through a Split by three losses: VALID split
    h=2 c=2 (bands and channel reductions), NONE by columns (w=4: bands of 1 and 2), BATCH_SIZE by sample (its
    Split tops returned to the samples), and by a top-2 Accuracy split c=4 (the true class's score and the
    count of classes scoring as high summed over the 4 ranks; the logged accuracy is one process's). 4 SGD
    iterations equal one process at batch 4 (VALID's normalizer counts the global batch's valid labels,
    NONE's loss is the global sum: data parallelism gets neither); the bytes equal the planner's."""
    _fcn_case(case)
    first = train(case, 0, 4, 4, "one.caffemodel")
    arg = "spatial:" + ";".join(f"{str(s).replace(' ', ',')}:{name}" for name, s in FCN_SPLITS.items())
    p = train(case, 4, 1, 4, "split.caffemodel", "--parallel", arg)
    assert all(f"{name} {s}" in p.stderr for name, s in FCN_SPLITS.items())
    dp._compare(case / "split.caffemodel", case / "one.caffemodel", 1e-5)
    one = json.loads((case / "one.caffemodel.json").read_text())["losses"]
    got = json.loads((case / "split.caffemodel.json").read_text())
    assert np.allclose(got["losses"], one, rtol=1e-5)
    acc = [[float(x) for x in re.findall(r"Train net output #0: acc = (\S+)", q.stderr)] for q in (p, first)]
    assert len(acc[0]) == 4 and acc[0] == acc[1] and len(set(acc[0])) > 1  # the global batch's top-2 accuracy
    monkeypatch.chdir(case)
    step, forward, losses = _planned(case / "fcn.prototxt", 4, 1, FCN_SPLITS)
    # loss_valid: 2 rows x 2 ranks x 2 arrays x a band of 4x3x6 x 4 bytes; acc: 4 ranks x 2 arrays x 3/4 x 2 x
    # every position (4x6x6) x 4 bytes
    assert losses == 2 * 2 * 2 * (4 * 3 * 6) * 4 + 4 * 2 * 1.5 * (4 * 6 * 6) * 4
    assert sum(got["split_bytes_all"]) == 4 * step + forward
    assert sum(got["loss_bytes_all"]) == 5 * losses


def test_loss_regions_groups_and_refusals(case, monkeypatch):
    """The split loss's box and label regions, the grouped convolution's input channels, what is refused."""
    _fcn_case(case)
    monkeypatch.chdir(case)
    net = cct.Net("fcn.prototxt", "TRAIN")
    # rank 3 of h=2 c=2: rows [3, 6) and channels [2, 4) of the 4x4x6x6 scores and the labels of those rows
    ex = PerLayerExecutor(net, _Rank(4, 3), FCN_SPLITS)
    loss = ex.steps[net.layer_names.index("loss_valid")]
    assert loss.scores.shape == (4, 2, 3, 6) and loss.labels.shape == (4, 1, 3, 6) and loss.channels == (2, 4)
    assert loss.fetch.local.tolist() == [[0, 4], [2, 4], [3, 6], [0, 6]] and not loss.fetch.recvs  # score's box
    # its labels from the labels' quarters (the data layer's split): its own and rank 2's columns [0, 3)
    assert loss.label_fetch.local.tolist() == [[0, 4], [0, 1], [3, 6], [3, 6]]
    assert [(q, box[3].tolist()) for q, box in loss.label_fetch.recvs] == [(2, [0, 3])] and not loss.first_of_row
    # the data: the global batch read, rank 3 keeps samples [2, 4), image channel 1 and those samples' labels
    data = ex.steps[net.layer_names.index("data")]
    assert [o.shape for o in data.outs] == [(2, 1, 6, 6), (2, 1, 6, 6)] and data.global_batch == 4
    labels = ex.steps[net.layer_names.index("label_data_1_split")]  # its quarter: samples 0-1 from rank 1
    assert [(q, box[0].tolist()) for q, box in labels.fetch.recvs] == [(1, [0, 2])]
    # conv2b c=4 of group 2: rank 3's output channels [3, 4) read input channels [4, 8) (its group's)
    conv = ex.steps[net.layer_names.index("conv2b")]
    assert conv.inp.shape == (4, 4, 6, 6) and conv.fetch.need_origin.tolist() == [0, 4, 0, 0]
    assert conv.part.param.convolution_param.group == 1
    conv = ex.steps[net.layer_names.index("conv2a")]  # n=2 c=2: rank 3 samples [2, 4), groups 2 and 3 of 4
    assert conv.inp.shape == (2, 4, 6, 6) and conv.fetch.need_origin.tolist() == [2, 4, 0, 0]
    assert conv.part.param.convolution_param.group == 2
    split = ex.steps[net.layer_names.index("score_score_0_split")]
    assert len(split.outs) == 4 and list(split.gathers) == [2]  # loss_batch reads its top by sample
    # the planner: labels forward only, the loss's reductions per row
    graph = graph_from_net(net, 4)
    i = graph.index("loss_valid")
    red = loss_reduction_cost(graph.nodes[i].out_shape, [Split(h=2, c=2), Split(c=4), Split(n=4)], 4,
                              np.ones((4, 4)))
    assert red.bytes.tolist() == [[2 * 2 * 2 * 72 * 4, 4 * 2 * 1.5 * 144 * 4, 0.0]]
    PerLayerExecutor(net, _Rank(4, 1), {"conv1": Split(h=2), "conv2b": Split(n=2, c=2)})
    for ranks, splits, message in [
        (4, {"loss_valid": Split(c=3)}, r"layer 'loss_valid' n=1 h=1 w=1 c=3: uses 3 workers"),
        (8, {"loss_valid": Split(h=8)}, r"layer 'loss_valid' n=1 h=8 w=1 c=1: its input has 6 along h, fewer than"),
    ]:
        with pytest.raises(PlanError, match=message):
            PerLayerExecutor(net, _Rank(ranks), splits)
    assert "[0, 3) cross a group boundary" in group_refusal(6, 3, 2)  # groups of 2 outputs, slices of 3
    assert group_refusal(8, 2, 4) is None and group_refusal(8, 4, 2) is None and group_refusal(12, 4, 3) is not None
    (case / "input.prototxt").write_text(FCN.split("\n", 1)[0] + '\nlayer { name: "data" type: "Input" top: "data" '
                                         'input_param { shape { dim: 1 dim: 2 dim: 6 dim: 6 } } }\n')
    with pytest.raises(PlanError, match=r"layer 'data' n=1 h=2 w=1 c=1: Input layers give each rank a batch of"):
        PerLayerExecutor(cct.Net("input.prototxt", "TRAIN"), _Rank(2), {"data": Split(h=2)})
    with h5py.File(case / "fcn.h5", "r+") as f:  # labels (N, 6, 6): one per position, but not (N, 1, H, W)
        labels = f["label"][...]
        del f["label"]
        f["label"] = labels[:, 0]
    with pytest.raises(PlanError, match=r"layer 'loss_valid' n=1 h=2 w=1 c=1: bottom 'label_data_1_split_0' has "
                                        r"shape \[1, 6, 6\]; a split loss reads labels of shape \(N,\), \(N, 1\) or"):
        PerLayerExecutor(cct.Net("fcn.prototxt", "TRAIN"), _Rank(2), {"loss_valid": Split(h=2)})
    (case / "fcn.prototxt").write_text(FCN.replace('top: "loss_valid"\n', 'top: "loss_valid" top: "prob"\n'))
    with pytest.raises(PlanError, match=r"layer 'loss_valid' n=1 h=1 w=1 c=2: a SoftmaxWithLoss with a second top"):
        PerLayerExecutor(cct.Net("fcn.prototxt", "TRAIN"), _Rank(2), {"loss_valid": Split(c=2)})





@needs_mpi()
def test_snapshots_resume_across_a_split_data_layer_and_data_parallelism(case, monkeypatch, capfd):
    """Issue 32's resume across configurations when the data layer is split other than by sample (every worker
    reads the global batch and keeps its band of rows; under data parallelism each reads its shard and stops at
    its own position): one process at batch 4 for 3 iterations with a snapshot, then one launch of 2 ranks at
    batch 2 chaining a plan file (LeNet's data layer and conv1 split h=2) resumed to 5 with a snapshot, data
    parallelism resumed to 8 with a snapshot, the plan resumed to 10; and the plan on 2 in-process workers
    (``cct train --devices cpu,cpu:1``) resumed from 8 to 10. Each run logs real Caffe's batch-4 losses for its
    iterations; both last runs end with Caffe's weights."""
    plan = _plan_file(case / "split.plan", 2, {"mnist": Split(h=2), "conv1": Split(h=2)})
    train(case, 0, 4, 3, "one.caffemodel", "--init", "init.caffemodel", "--snapshot", "3")
    runs = [("a", 5, "--resume", "snap_iter_3.solverstate", "--snapshot", "5", "--parallel", str(plan)),
            ("b", 8, "--resume", "snap_iter_5.solverstate", "--snapshot", "8"),
            ("c", 10, "--resume", "snap_iter_8.solverstate", "--parallel", str(plan))]
    args = ["python", script("train_run.py")]
    for out, iters, *extra in runs:
        args += ["++", str(case), "2", str(iters), str(case / f"{out}.caffemodel"), *extra]
    p = run_mpi(2, args[:2] + args[3:], timeout=180)
    assert p.stderr.count("Per-layer splits on 2 MPI ranks: mnist n=1 h=2 w=1 c=1, conv1 n=1 h=2") == 2
    assert "written by 1 rank(s), this run has 2: the data read positions restart from the shared record " \
           "counter (mnist at record 12)" in p.stderr
    want = json.loads((case / "losses.json").read_text())["losses"]
    for out, first, last in (("one", 0, 3), ("a", 3, 5), ("b", 5, 8), ("c", 8, 10)):
        got = json.loads((case / f"{out}.caffemodel.json").read_text())["losses"]
        assert np.allclose(got, want[first:last], rtol=1e-5), (out, got, want[first:last])
    dp._compare(case / "c.caffemodel", case / "final.caffemodel", 1e-5)
    # the same plan on in-process workers (ThreadComm), each at the prototxt's batch of 2
    (case / "net.prototxt").write_text((case / "net.prototxt").read_text().replace("batch_size: 4", "batch_size: 2"))
    (case / "solver.prototxt").write_text((case / "solver.prototxt").read_text().replace("solver_sgd_lenet", "snap"))
    # in this process (cct.cli.main, what cct runs; as a process: test_parallel_plan_devices)
    monkeypatch.chdir(case)
    capfd.readouterr()
    code = main(["train", "--solver", "solver.prototxt", "--snapshot", "snap_iter_8.solverstate", "--devices",
                 "cpu,cpu:1", "--parallel", str(plan), "--noprogress"])
    err = capfd.readouterr().err
    assert code == 0, err[-3000:]
    assert "Per-layer splits on 2 in-process workers: mnist n=1 h=2 w=1 c=1, conv1 n=1 h=2" in err
    logged = [float(x) for x in re.findall(r"Iteration \d+ \(.*\), loss = (\S+)", err)]
    assert np.allclose(logged, want[8:], rtol=1e-5), (logged, want[8:])
    dp._compare(case / "snap_iter_10.caffemodel", case / "final.caffemodel", 1e-5)
