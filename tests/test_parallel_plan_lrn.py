"""LRN, Concat and Eltwise under any split (cct.parallel_plan.perlayer): ACROSS_CHANNELS split by channel
reads ``local_size // 2`` halo channels of its neighbours, WITHIN_CHANNEL split by height or width a band of
halo rows or columns; Concat and Eltwise take each input from its own split. A CaffeNet-like net (grouped
convolution, both LRNs, a Concat and an Eltwise of differently split inputs) trained under mixed
configurations on 2 and 3 ranks equals one process at the global batch, and the bytes the ranks receive
equal the planner's count."""
import json
import shutil

import numpy as np
import pytest
import test_distributed_train as dp
from mpirun import needs_mpi
from test_parallel_plan_owt import CAFFENET_LIKE, train
from test_parallel_plan_spatial import _predicted, _Rank

import cct
from cct.parallel_plan.graph import graph_from_net
from cct.parallel_plan.perlayer import PerLayerExecutor
from cct.parallel_plan.split import PlanError, Split

case = dp.case  # the fixture: a fresh copy of Caffe's solver_sgd_lenet case (its HDF5 data)
pytestmark = [pytest.mark.skipif(not dp.CASE.is_dir(), reason="shared/reference not available"),
              pytest.mark.usefixtures("numpy_kernels")]  # conftest.py: the ranks run the numpy kernels

CONV2 = """layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
        convolution_param { num_output: 16 kernel_size: 3 pad: 1 group: 2 weight_filler { type: "gaussian" std: 0.1 }
                            bias_filler { type: "constant" value: 0.1 } } }"""
CONCAT2 = """layer { name: "conv2a" type: "Convolution" bottom: "pool1" top: "conv2a"
        convolution_param { num_output: 6 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "conv2b" type: "Convolution" bottom: "pool1" top: "conv2b"
        convolution_param { num_output: 10 kernel_size: 3 pad: 1 group: 2 weight_filler { type: "gaussian" std: 0.1 }
                            bias_filler { type: "constant" value: 0.1 } } }
layer { name: "conv2" type: "Concat" bottom: "conv2a" bottom: "conv2b" top: "conv2" }"""
FC7 = """layer { name: "fc7" type: "InnerProduct" bottom: "fc6" top: "fc7"
        inner_product_param { num_output: 32 weight_filler { type: "gaussian" std: 0.05 } } }"""
ELTWISE7 = """layer { name: "fc7a" type: "InnerProduct" bottom: "fc6" top: "fc7a"
        inner_product_param { num_output: 32 weight_filler { type: "gaussian" std: 0.05 } } }
layer { name: "fc7b" type: "InnerProduct" bottom: "fc6" top: "fc7b"
        inner_product_param { num_output: 32 weight_filler { type: "gaussian" std: 0.05 } } }
layer { name: "fc7" type: "Eltwise" bottom: "fc7a" bottom: "fc7b" top: "fc7" eltwise_param { coeff: 1 coeff: -0.5 } }"""
#: CAFFENET_LIKE with conv2 the Concat of a plain and a grouped convolution (6 + 10 channels), its second LRN
#: within channels followed by a Softmax over channels, and fc7 a weighted sum (Eltwise) of two InnerProducts of fc6
SOFTMAX2 = 'layer { name: "soft2" type: "Softmax" bottom: "norm2" top: "soft2" }\n'
NET = (CAFFENET_LIKE.replace(CONV2, CONCAT2).replace(FC7, ELTWISE7)
       .replace('top: "norm2" lrn_param {', 'top: "norm2" lrn_param { norm_region: WITHIN_CHANNEL')
       .replace('layer { name: "pool2" type: "Pooling" bottom: "norm2"', SOFTMAX2 + 'layer { name: "pool2" type: '
                '"Pooling" bottom: "soft2"'))
assert NET.count("conv2a") == 3 and NET.count("fc7a") == 3 and "WITHIN" in NET and NET.count("soft2") == 3


def _spatial_arg(splits):
    by: dict[str, list[str]] = {}
    for name, s in splits.items():
        by.setdefault(str(s).replace(" ", ","), []).append(name)
    return "spatial:" + ";".join(f"{how}:{','.join(names)}" for how, names in by.items())


def test_lrn_regions_are_the_planners_channel_and_spatial_halos(case, monkeypatch):
    """norm1 (ACROSS_CHANNELS, local_size 3) split c=2 reads its 4 channels and 1 halo channel; norm2
    (WITHIN_CHANNEL) split h=3 reads its rows and one halo row each side (clipped at the edges); the copy runs
    on the frame and its box is cut out of the result. A Concat's box reads each input's channels inside it;
    a Concat or Softmax along another axis is refused by name."""
    monkeypatch.chdir(case)
    (case / "net.prototxt").write_text(NET)
    net = cct.Net("net.prototxt", "TRAIN")
    nodes = [node.name for node in graph_from_net(net).nodes]
    assert "norm1" in nodes and "norm2" in nodes  # LRN is a node of its own (not an element-wise follower)
    ex = PerLayerExecutor(net, _Rank(2, 1), {"norm1": Split(c=2)})
    step = ex.steps[net.layer_names.index("norm1")]
    assert step.fetch.need_origin.tolist() == [0, 3, 0, 0] and step.inp.shape == (8, 5, 24, 24)
    assert step.out.shape == (8, 4, 24, 24) and step.crop[1] == slice(1, 5)
    ex = PerLayerExecutor(net, _Rank(3, 1), {"norm2": Split(h=3)})
    step = ex.steps[net.layer_names.index("norm2")]  # rows [4, 8) of 12 read [3, 9)
    assert step.fetch.need_origin.tolist() == [0, 0, 3, 0] and step.inp.shape == (12, 16, 6, 12)
    assert step.out.shape == (12, 16, 4, 12) and step.crop[2] == slice(1, 5)
    # the Concat's box of channels [5, 10) of 16 (3 ranks) takes conv2a's channel 5 and conv2b's 0-3
    ex = PerLayerExecutor(net, _Rank(3, 1), {"conv2": Split(c=3)})
    join = ex.steps[net.layer_names.index("conv2")]
    assert [f.need_origin.tolist() for f in join.fetches] == [[0, 5, 0, 0], [0, 0, 0, 0]]
    assert join.views == [(slice(None), slice(0, 1)), (slice(None), slice(1, 5))] and join.out.shape == (12, 5, 12, 12)
    along_h = NET.replace("num_output: 6 ", "num_output: 10 ")
    along_h = along_h.replace('top: "conv2" }', 'top: "conv2" concat_param { axis: 2 } }')
    (case / "net.prototxt").write_text(along_h)
    net = cct.Net("net.prototxt", "TRAIN")
    with pytest.raises(PlanError, match=r"layer 'conv2' n=1 h=1 w=1 c=2: only a Concat along channels \(axis: 1\)"):
        PerLayerExecutor(net, _Rank(2), {"conv2": Split(c=2)})
    (case / "net.prototxt").write_text(NET.replace('top: "soft2" }', 'top: "soft2" softmax_param { axis: 2 } }'))
    net = cct.Net("net.prototxt", "TRAIN")
    with pytest.raises(PlanError, match=r"layer 'soft2' n=1 h=1 w=2 c=1: only a Softmax over channels \(axis: 1\)"):
        PerLayerExecutor(net, _Rank(2), {"soft2": Split(w=2)})


@pytest.fixture(scope="module")
def net_case(tmp_path_factory):
    """A copy of the case training NET, with the one-process references of the runs below (5 iterations at
    batch 4 and 6) from one plain process."""
    case = tmp_path_factory.mktemp("lrn") / "case"
    shutil.copytree(dp.CASE, case)
    (case / "net.prototxt").write_text(NET)
    dp._train_runs(0, [(case, 2 * ranks, 5, case / f"one{ranks}.caffemodel") for ranks in (2, 3)])
    return case


@needs_mpi()
@pytest.mark.parametrize("ranks, splits", [
    # the Concat by width from a channel and a height split; the Eltwise by channel from a channel and a
    # sample split
    (2, {"conv1": Split(h=2), "norm1": Split(c=2), "pool1": Split(c=2), "conv2a": Split(c=2), "conv2b": Split(h=2),
         "conv2": Split(w=2), "norm2": Split(w=2), "soft2": Split(h=2), "pool2": Split(h=2), "fc6": Split(c=2),
         "fc7a": Split(c=2), "fc7": Split(c=2), "fc8": Split(c=2)}),
    # the Concat by channel (16 as 5/5/6: rank 1's box straddles both inputs) from a height and a sample
    # split; the Eltwise whole on rank 0 (ranks 1, 2 idle for it) from a channel and a sample split
    (3, {"conv1": Split(w=3), "norm1": Split(c=3), "pool1": Split(h=3), "conv2a": Split(h=3), "conv2": Split(c=3),
         "norm2": Split(h=3), "soft2": Split(w=3), "fc6": Split(c=3), "fc7b": Split(c=3), "fc7": Split(),
         "fc8": Split(c=3)}),
], ids=["two", "three"])
def test_caffenet_like_net_with_lrn_under_mixed_splits_equals_one_process(net_case, monkeypatch, ranks, splits):
    """5 SGD iterations (momentum, weight decay) at batch 2 per rank under a mixed plan end with one
    process's weights at the global batch (the fixture's); the bytes received equal the planner's (5 steps and
    the last forward pass). The Concat and the Eltwise take each input from its own split."""
    case = net_case
    p = train(case, ranks, 2, 5, f"split{ranks}.caffemodel", "--parallel", _spatial_arg(splits))
    assert f"Per-layer splits on {ranks} MPI ranks: conv1 " in p.stderr
    assert all(f"{name} {s}" in p.stderr for name, s in splits.items())  # the joins and LRNs run split
    dp._compare(case / f"split{ranks}.caffemodel", case / f"one{ranks}.caffemodel", 1e-5)
    one = json.loads((case / f"one{ranks}.caffemodel.json").read_text())["losses"]
    got = json.loads((case / f"split{ranks}.caffemodel.json").read_text())
    assert np.allclose(got["losses"], one, rtol=1e-5)
    monkeypatch.chdir(case)
    step, forward = _predicted(case / "net.prototxt", ranks, 2, splits)
    assert sum(got["split_bytes_all"]) == 5 * step + forward
