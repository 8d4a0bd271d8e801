"""Dense inference, activation buffers reused across layers: the slot plan and bit-identical outputs."""
from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format

import cct
from cct.errors import CctError
from cct.infer.buffers import Access, assign_slots, blob_shapes, net_accesses, plan_slots, storage_roots
from cct.infer.dense import PatchRunner
from cct.infer.geometry import analyze
from cct.infer.stages import TwoStagePipeline
from cct.infer.znni_nets import znni_prototxt
from cct.lowering.direct_layout import SharedScratch
from cct.proto import caffe_pb2

REDUCED = {"n337": [2, 2, 1, 1, 1, 1, 2], "n537": [2, 1, 2, 1, 2, 1, 1], "n726": [2, 2, 1, 1, 2, 1]}

# a chain with a Split (two readers of one blob), element-wise layers that are not in place, and an Eltwise join
BRANCHY = """
name: "branchy"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 2 dim: 17 dim: 17 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 3 kernel_size: 2 weight_filler { type: "gaussian" std: 0.5 }
  bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "r1" }
layer { name: "tanh1" type: "TanH" bottom: "conv1" top: "t1" }
layer { name: "sum" type: "Eltwise" bottom: "r1" bottom: "t1" top: "sum" }
layer { name: "pool1" type: "Pooling" bottom: "sum" top: "pool1" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
  convolution_param { num_output: 3 kernel_size: 2 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "abs2" type: "AbsVal" bottom: "conv2" top: "abs2" }
layer { name: "pool2" type: "Pooling" bottom: "abs2" top: "pool2" pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "conv3" type: "Convolution" bottom: "pool2" top: "conv3"
  convolution_param { num_output: 2 kernel_size: 1 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "prob" type: "Sigmoid" bottom: "conv3" top: "prob" }
"""


def _net(txt: str, dtype=np.float32) -> cct.Net:
    return cct.Net(text_format.Parse(txt, caffe_pb2.NetParameter()), cct.TEST, dtype=dtype)


def _twin(txt: str, dtype=np.float32) -> tuple[cct.Net, cct.Net]:
    a, b = _net(txt, dtype), _net(txt, dtype)
    for pa, pb in zip(a.params.values(), b.params.values()):
        for x, y in zip(pa, pb):
            y.data[...] = x.data
    return a, b


def _live_intervals(accesses, keep, end):
    """Naive liveness: each storage's first and last step (the reference for the slot plan)."""
    span = {}
    for k, acc in enumerate(accesses):
        for key in acc.reads + acc.writes:
            lo, _hi = span.get(key, (k, k))
            span[key] = (lo, k)
    for key in keep:
        span[key] = (span[key][0], end)
    return span


def _check_plan(accesses, elements, keep=()):
    plan = assign_slots(accesses, elements, keep=keep)
    span = _live_intervals(accesses, keep, len(accesses))
    for key, (lo, hi) in span.items():
        assert plan.sizes[plan.slot_of[key]] >= elements[key]
        for other, (lo2, hi2) in span.items():
            if other == key or plan.slot_of[other] != plan.slot_of[key]:
                continue
            # two storages in one slot: never both live, except an element-wise top taking over a dying bottom
            overlap = lo <= hi2 and lo2 <= hi
            handover = any(acc.elementwise and ((key in acc.reads and other in acc.writes and hi == k == lo2) or
                                                (other in acc.reads and key in acc.writes and hi2 == k == lo))
                           for k, acc in enumerate(accesses))
            assert not overlap or handover, (key, other, span[key], span[other])
    return plan


def test_slots_follow_liveness_on_a_chain():
    acc = [Access(("x",), ("a",)), Access(("a",), ("b",)), Access(("b",), ("c",)), Access(("c",), ("d",))]
    elements = {"x": 10, "a": 8, "b": 8, "c": 6, "d": 4}
    plan = _check_plan(acc, elements, keep=("d",))
    assert len(plan.sizes) == 2 and plan.elements == 18  # two buffers ping-pong: x/b/d and a/c
    # an element-wise layer takes over its dying bottom's slot; a Split-like second reader keeps it alive
    acc = [Access(("x",), ("a",)), Access(("a",), ("b",), elementwise=True), Access(("b",), ("c",))]
    plan = _check_plan(acc, {"x": 5, "a": 5, "b": 5, "c": 5}, keep=("c",))
    assert plan.slot_of["a"] == plan.slot_of["b"] and len(plan.sizes) == 2
    acc = [Access(("x",), ("a",)), Access(("a",), ("b",), elementwise=True), Access(("a", "b"), ("c",))]
    plan = _check_plan(acc, {"x": 5, "a": 5, "b": 5, "c": 5}, keep=("c",))
    assert plan.slot_of["a"] != plan.slot_of["b"]


def test_slots_on_random_access_lists():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(2, 12))
        names = [f"s{i}" for i in range(n + 1)]
        accesses = []
        for k in range(n):
            reads = tuple(sorted({names[int(j)] for j in rng.integers(0, k + 1, size=int(rng.integers(1, 3)))}))
            accesses.append(Access(reads, (names[k + 1],), elementwise=bool(rng.integers(0, 2))))
        elements = {s: int(rng.integers(1, 50)) for s in names}
        plan = _check_plan(accesses, elements, keep=(names[-1],))
        assert plan.elements <= sum(elements.values())


def test_pool_is_smaller_than_every_blob_and_mpf_buffer():
    net = _net(znni_prototxt("n337", fmaps=4, nd=3, kernels=REDUCED["n337"]))
    geom = analyze(net)
    mpf = (True,) * 3
    run = geom.input_size((2, 2, 2), mpf)
    slots, _steps, shape_of = plan_slots(net, geom, run, mpf, "prob")
    every = sum(int(np.prod(s)) for s in shape_of.values())
    assert 3 * slots.elements < every  # 7 convolutions, 3 pools of 3 stages each: a few live at a time
    runner = PatchRunner(net, geom, (2, 2, 2))
    assert sum(b.size for b in runner.pool) == slots.elements
    assert all(np.shares_memory(net.blobs[n].data, runner.pool[slots.slot_of[n]]) for n in ("data", "conv3", "prob"))


def test_storages_and_shapes_of_a_split_net():
    net = _net(BRANCHY)
    geom = analyze(net)
    roots = storage_roots(net)
    split_tops = [t for i, lp in enumerate(net.param.layer) if lp.type == "Split" for t in net.top_names[i]]
    assert split_tops and all(roots[t] == "conv1" for t in split_tops)
    run = geom.input_size((2, 2), (True, True))
    assert run == (14, 14)
    shapes = blob_shapes(net, geom, run, (True, True))
    assert shapes["sum"] == (1, 3, 13, 13) and shapes["pool1"] == (4, 3, 6, 6) and shapes["prob"] == (16, 2, 2, 2)
    steps, shape_of = net_accesses(net, geom, (True, True), shapes)
    assert len([s for s in steps if s[0] == [lp.name for lp in net.param.layer].index("pool1")]) == 3  # 2 axes + fold


@pytest.mark.parametrize("name,nd,pool,mpf,method", [
    ("n337", 3, "MAX", None, "mpf"), ("n537", 2, "AVE", None, "mpf"), ("n726", 2, "MAX", (False, True), "mpf"),
    ("n337", 2, "MAX", None, "shift"), ("n337", 2, "AVE", None, "strided"),
])
def test_reused_buffers_give_bit_identical_output(name, nd, pool, mpf, method):
    txt = znni_prototxt(name, fmaps=4, nd=nd, pool=pool, kernels=REDUCED[name], channels=2)
    a, b = _twin(txt)
    geom = analyze(a)
    grid = (2,) * nd
    reused = PatchRunner(a, geom, grid, mpf=mpf, method=method)
    plain = PatchRunner(b, analyze(b), grid, mpf=mpf, method=method, reuse=False)
    assert reused.pool and not plain.pool
    rng = np.random.default_rng(5)
    for _ in range(2):  # a second patch through the same (now dirty) buffers
        x = rng.standard_normal((2,) + reused.patch_shape).astype(np.float32)
        np.testing.assert_array_equal(reused.run(x), plain.run(x))


def test_split_and_out_of_place_layers_bit_identical():
    a, b = _twin(BRANCHY)
    reused, plain = PatchRunner(a, analyze(a), (3, 3)), PatchRunner(b, analyze(b), (3, 3), reuse=False)
    slot = reused.slots.slot_of
    assert slot["abs2"] == slot["conv2"]  # AbsVal took over conv2's buffer
    assert slot["r1"] != slot["conv1"] and slot["t1"] == slot["conv1"]  # TanH, conv1's last reader, took it over
    x = np.random.default_rng(6).standard_normal((2,) + reused.patch_shape).astype(np.float32)
    np.testing.assert_array_equal(reused.run(x), plain.run(x))


def test_pipeline_stages_get_separate_buffers():
    txt = znni_prototxt("n337", fmaps=4, nd=2, kernels=REDUCED["n337"])
    a, b = _twin(txt)
    geom = analyze(a)
    runner = PatchRunner(a, geom, (2, 2), theta=3)
    split = geom.ops[3].layer
    steps = plan_slots(a, geom, runner.run_shape, runner.mpf, runner.blob, split)[1]
    first_keys = {k for i, acc in steps if i < split for k in acc.writes} | {"data"}
    first = {runner.slots.slot_of[k] for k in first_keys}
    second = {runner.slots.slot_of[k] for i, acc in steps if i >= split for k in acc.writes if k not in first_keys}
    assert first and second and not first & second
    with pytest.raises(CctError, match="theta"):
        TwoStagePipeline(runner, 2)
    plain = PatchRunner(b, analyze(b), (2, 2), reuse=False)
    rng = np.random.default_rng(8)
    patches = [rng.standard_normal((1,) + runner.patch_shape).astype(np.float32) for _ in range(3)]
    want = [plain.run(p).copy() for p in patches]
    got = [out.copy() for _k, out in TwoStagePipeline(runner, 3).results(range(3), lambda k: patches[k])]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)




def test_shared_scratch_rezeroes_a_buffer_taken_over_by_another_tag():
    scratch = SharedScratch()
    a = scratch.zeros(("xpad", 1), (2, 3), np.float32)
    a[...] = 7
    again = scratch.zeros(("xpad", 1), (2, 3), np.float32)
    assert np.shares_memory(a, again) and (again == 7).all()  # the same tag: kept as written
    b = scratch.zeros(("xpad", 2), (3, 2), np.float32)
    assert np.shares_memory(a, b) and not b.any()  # another layer: the same memory, zeroed again
    c = scratch.zeros(("xpad", 3), (4, 4), np.float32)  # larger: a new buffer
    assert c.shape == (4, 4) and not c.any()
    assert not np.shares_memory(c, scratch.zeros(("y", 3), (4, 4), np.float32))  # another role: its own buffer


def test_direct_convolutions_share_one_scratch_bit_identical():
    txt = znni_prototxt("n337", fmaps=4, nd=3, kernels=REDUCED["n337"], channels=2)
    a, b = _twin(txt)
    for net in (a, b):
        for lp, layer in zip(net.param.layer, net.layers):
            if lp.type == "Convolution":
                layer.lowering = "direct"
    reused = PatchRunner(a, analyze(a), (2, 2, 2))
    plain = PatchRunner(b, analyze(b), (2, 2, 2), reuse=False)
    scratches = {id(layer.lowering._scratch) for _i, layer, _b, _t in reused.steps if hasattr(layer, "lowering")}
    assert len(scratches) == 1 and isinstance(reused.steps[0][1].lowering._scratch, SharedScratch)
    rng = np.random.default_rng(9)
    for _ in range(2):
        x = rng.standard_normal((2,) + reused.patch_shape).astype(np.float32)
        np.testing.assert_array_equal(reused.run(x), plain.run(x))
