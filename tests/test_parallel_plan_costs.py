"""Configurations, input regions and exact transfer bytes of cct.parallel_plan on hand-computed cases."""
from __future__ import annotations

import numpy as np
import pytest

import cct
from cct.io import parse_text
from cct.parallel_plan.compute import largest_part, part_net
from cct.parallel_plan.graph import graph_from_net
from cct.parallel_plan.split import PlanError, Split, enumerate_splits, worker_boxes
from cct.parallel_plan.transfer import edge_cost, overlap, update_cost
from cct.proto import caffe_pb2


def build(text: str, phase: str = "TRAIN"):
    return graph_from_net(cct.Net(parse_text(text, caffe_pb2.NetParameter()), phase))


def ones(w: int) -> np.ndarray:
    return np.ones((w, w)) - np.eye(w)


def edge_between(graph, u: str, v: str):
    iu, iv = graph.index(u), graph.index(v)
    (edge,) = [e for e in graph.edges() if e[0] == iu and e[2] == iv]
    return edge


def naive_received(graph, edge, su: Split, sv: Split) -> int:
    """Forward elements worker j receives, summed over j, by marking every element of the tensor."""
    u, top, v, bottom = edge
    shape = graph.nodes[u].top_shapes[top]
    owner = np.empty(shape, dtype=np.int64)
    for i, b in enumerate(worker_boxes(su, shape)):
        owner[tuple(slice(lo, hi) for lo, hi in b)] = i
    nv = graph.nodes[v]
    need = nv.rule.needed(worker_boxes(sv, nv.out_shape), bottom, nv.in_shapes[bottom])
    total = 0
    for j, r in enumerate(need):
        region = owner[tuple(slice(lo, hi) for lo, hi in r)]
        total += int(np.count_nonzero(region != j))
    return total


def test_enumeration_counts_70_configurations_for_16_workers():
    splits = enumerate_splits(16, (512, 256, 16, 16))
    assert len(splits) == 70 and len(set(splits)) == 70
    assert len(enumerate_splits(16, (512, 256, 13, 13))) == 68  # h=16 and w=16 exceed 13 rows/columns
    assert all(16 % s.workers == 0 for s in splits)
    assert enumerate_splits(4, (8, 10, 1, 1), ("n", "c")) == [
        Split(), Split(c=2), Split(n=2), Split(c=4), Split(n=2, c=2), Split(n=4)]
    assert Split(h=3) not in enumerate_splits(6, (4, 4, 2, 5))  # h=3 leaves a worker without rows


def test_split_text_round_trip_and_bad_text():
    s = Split(n=2, c=4)
    assert Split.parse(str(s)) == s and Split.parse("{n=2, c=4}") == s
    with pytest.raises(PlanError, match="cannot read"):
        Split.parse("n=two")
    with pytest.raises(PlanError, match="twice"):
        Split.parse("n=2 n=2")


FC_NET = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 4 dim: 5 } } }
layer { name: "fc1" type: "InnerProduct" bottom: "data" top: "fc1" inner_product_param { num_output: 6 } }
layer { name: "relu1" type: "ReLU" bottom: "fc1" top: "fc1" }
layer { name: "fc2" type: "InnerProduct" bottom: "fc1" top: "fc2" inner_product_param { num_output: 10 } }
"""


def test_fc_sample_split_to_channel_split_bytes():
    """fc1 split n=2 (worker 0: samples 0-1, worker 1: samples 2-3, 6 features each) feeding fc2 split c=2:
    both workers need every sample of fc1, each receives the other's 2 x 6 floats = 48 bytes; the
    backward sends the gradients of the same regions back: 4 x 48 bytes in all."""
    g = build(FC_NET)
    assert [n.name for n in g.nodes] == ["data", "fc1", "fc2"]
    assert g.nodes[1].layers == ["fc1", "relu1"]  # the ReLU follows fc1's split
    assert g.nodes[2].dims == ("n", "c")
    edge = edge_between(g, "fc1", "fc2")
    cost = edge_cost(g, edge, [Split(n=2)], [Split(c=2)], ones(2))
    assert cost.bytes[0, 0] == 2 * 2 * (2 * 6 * 4)
    assert naive_received(g, edge, Split(n=2), Split(c=2)) == 24
    assert cost.seconds[0, 0] == pytest.approx(2 * 48)  # each receiver 48 bytes at 1 B/s, forward and backward
    same = edge_cost(g, edge, [Split(n=2)], [Split(n=2)], ones(2))
    assert same.bytes[0, 0] == 0  # equal configurations move nothing


def test_fc_update_channel_split_owns_its_slice():
    g = build(FC_NET)
    p = g.nodes[2].param_bytes
    assert p == (10 * 6 + 10) * 4
    up = update_cost(p, [Split(n=2), Split(c=2), Split(n=2, c=2), Split()], ones(4))
    assert up.bytes[0].tolist() == [2 * p, 0, 2 * p, 0]  # ring all-reduce: 2 (r-1) P in all
    assert up.seconds[0, 1] == 0 and up.seconds[0, 0] == pytest.approx(p)


CONV_NET = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 2 dim: 8 dim: 8 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 2 kernel_size: 1 } }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
        convolution_param { num_output: 3 kernel_size: 3 pad: 1 } }
layer { name: "pool" type: "Pooling" bottom: "conv2" top: "pool" pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
"""


def test_conv_halo_under_a_height_split():
    """conv1 (2 x 8 x 8) split h=2: worker 0 owns rows 0-3, worker 1 rows 4-7. conv2 (3x3, pad 1) split
    h=2: worker 0 computes rows 0-3 and reads rows 0-4 (row 4 from worker 1: 2 channels x 8 columns),
    worker 1 reads rows 3-7 (row 3 from worker 0): 32 floats forward."""
    g = build(CONV_NET)
    edge = edge_between(g, "conv1", "conv2")
    cost = edge_cost(g, edge, [Split(h=2)], [Split(h=2)], ones(2))
    assert cost.bytes[0, 0] == 2 * 32 * 4
    assert naive_received(g, edge, Split(h=2), Split(h=2)) == 32
    # pooling 3x3 stride 2 (ceil mode: 8 -> 4 rows) split h=2: output rows 0-1 read conv2 rows 0-4 (row 4
    # from worker 1: 3 channels x 8 columns), rows 2-3 read rows 4-7 (worker 1's own)
    pe = edge_between(g, "conv2", "pool")
    assert edge_cost(g, pe, [Split(h=2)], [Split(h=2)], ones(2)).bytes[0, 0] == 2 * 3 * 8 * 4
    assert naive_received(g, pe, Split(h=2), Split(h=2)) == 24


def test_regions_match_brute_force_on_every_configuration_pair():
    g = build(CONV_NET)
    for name_u, name_v in (("conv1", "conv2"), ("conv2", "pool")):
        edge = edge_between(g, name_u, name_v)
        su = enumerate_splits(4, g.nodes[edge[0]].out_shape)
        sv = enumerate_splits(4, g.nodes[edge[2]].out_shape)
        cost = edge_cost(g, edge, su, sv, ones(4))
        for a, x in enumerate(su):
            for b, y in enumerate(sv):
                assert cost.bytes[a, b] == 2 * 4 * naive_received(g, edge, x, y), (x, y)


CONCAT_NET = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 } } }
layer { name: "a" type: "InnerProduct" bottom: "data" top: "a" inner_product_param { num_output: 4 } }
layer { name: "b" type: "InnerProduct" bottom: "data" top: "b" inner_product_param { num_output: 6 } }
layer { name: "cat" type: "Concat" bottom: "a" bottom: "b" top: "cat" }
"""


def test_concat_of_differently_split_inputs():
    """a (2 x 4) split n=2, b (2 x 6) split c=2, cat (2 x 10) split c=2. Worker 0 makes channels 0-4: all
    of a (it owns sample 0: receives sample 1's 4 values) and b's channel 0 (its own). Worker 1 makes
    channels 5-9 = b's channels 1-5: it owns 3-5, receives channels 1-2 of both samples (4 values)."""
    g = build(CONCAT_NET)
    cat = g.index("cat")
    assert g.nodes[cat].kind == "concat"
    ea, eb = edge_between(g, "a", "cat"), edge_between(g, "b", "cat")
    assert edge_cost(g, ea, [Split(n=2)], [Split(c=2)], ones(2)).bytes[0, 0] == 2 * 4 * 4
    assert edge_cost(g, eb, [Split(c=2)], [Split(c=2)], ones(2)).bytes[0, 0] == 2 * 4 * 4
    assert naive_received(g, ea, Split(n=2), Split(c=2)) == 4
    assert naive_received(g, eb, Split(c=2), Split(c=2)) == 4


def test_overlap_of_boxes():
    a = np.array([[[0, 2], [0, 3], [0, 1], [0, 1]]])
    b = np.array([[[1, 4], [2, 5], [0, 1], [0, 1]], [[2, 3], [0, 1], [0, 1], [0, 1]]])
    assert overlap(a, b).tolist() == [[1, 0]]


GROUPED = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 4 dim: 4 dim: 9 dim: 9 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 6 kernel_size: 3 pad: 1 stride: 2 group: 2 } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool" pooling_param { pool: AVE kernel_size: 3 stride: 2 } }
layer { name: "fc" type: "InnerProduct" bottom: "pool" top: "fc" inner_product_param { num_output: 10 } }
"""


@pytest.mark.parametrize("layer,split", [("conv", Split(h=2)), ("conv", Split(c=2)), ("conv", Split(n=2, w=2)),
                                         ("conv", Split(c=3)), ("pool", Split(h=3)), ("fc", Split(c=4)),
                                         ("fc", Split(n=2, c=2))])
def test_part_nets_compute_exactly_the_largest_part(layer, split):
    """The net that compute(c) times produces the largest worker's output box (halo rows made explicit)."""
    net = cct.Net(parse_text(GROUPED, caffe_pb2.NetParameter()), "TRAIN")
    g = graph_from_net(net)
    node = g.nodes[g.index(layer)]
    part = part_net(node, [net.layer_by_name(n).param for n in node.layers], split)
    small = cct.Net(part, "TRAIN")
    box = largest_part(split, node.out_shape)
    top = small.blobs[small.top_names[-1][0]].shape
    assert tuple(top) + (1,) * (4 - len(top)) == tuple(int(hi - lo) for lo, hi in box)
    assert small.layer_names[1:] == node.layers
