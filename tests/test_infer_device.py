"""Dense inference on a device (ZNNi VII) where the CPU can check it: GPU + host RAM sub-layers with the host
playing the device, the device planner, numpy/``out=`` placement and the clean errors of the GPU options."""
from __future__ import annotations

import os
import tracemalloc

import numpy as np
import pytest

from cct.cli import main
from cct.device.driver import HostDevice, cupy_available
from cct.errors import CctError, MemoryBudgetError
from cct.infer.example import MODEL
from cct.infer.geometry import analyze
from cct.infer.hostsplit import choose_split, split_costs
from cct.infer.pipeline import DenseInference
from cct.infer.placement import target_of
from cct.infer.plan import choose_plan, device_stage_bytes, predict
from cct.lowering.geometry import ConvGeometry
from cct.paths import repo_root
from cct.proto import caffe_pb2
from tests.infer_nets import TXT3, random_net


class CountingHost(HostDevice):
    """The host as a device that counts the bytes copied in and out (a real HostDevice: same copies)."""

    def __init__(self):
        super().__init__()
        self.up = self.down = 0

    def upload(self, host, out=None, stream=None):
        self.up += np.asarray(host).nbytes
        return super().upload(host, out, stream)

    def download(self, array, out=None, stream=None):
        self.down += np.asarray(array).nbytes
        return super().download(array, out, stream)


@pytest.fixture(scope="module")
def case():
    net = random_net(TXT3.replace("num_output: 2 ", "num_output: 6 "), dtype=np.float64)
    vol = np.random.default_rng(3).standard_normal((15, 13, 17))
    want = DenseInference(net, patch=(16, 16, 16))(vol).copy()
    return net, vol, want


def _split_run(net, vol, budget):
    """GPU + host RAM with the host as the device: the output, the device bytes measured, the transfers."""
    dev = CountingHost()
    di = DenseInference(net, patch=(16, 16, 16), device=dev, host_ram=True, device_budget=budget)
    tiles = len(list(di.prepare(vol.shape)))
    runners = di.runner.split_runners()
    tracemalloc.start()  # the split layers' first pass: type 1's work buffers are allocated here
    try:
        for sr in runners:
            _i, _r, bottom, top = next(st for st in di.runner.steps if st[1] is sr)
            sr.forward(bottom, top)
        _, transient = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    held = di.runner.split_memory.flat.nbytes + sum(sr.bias_bytes() for sr in runners)
    got = di(vol)
    moved = (tiles + 1) * sum(sr.plan.transfer_bytes for sr in runners) + sum(sr.bias_bytes() for sr in runners)
    assert dev.up + dev.down == moved  # the predicted transfers, all of them (the tiles and the pass above)
    return di, got, held + transient


def test_gpu_plus_host_ram_equals_the_host_run_and_fits_the_device(case):
    net, vol, want = case
    free = _split_run(net, vol, None)[0]
    assert not any(sp.split for sp in free.plan.splits)
    whole = free.plan.device_peak_bytes
    plans = []
    for budget in (whole * 7 // 10, whole // 2):  # (conv1, one input map of batch 1, cannot go much lower)
        di, got, measured = _split_run(net, vol, budget)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        plan = di.plan
        assert any(sp.split for sp in plan.splits) and measured <= plan.device_peak_bytes <= budget
        text = plan.describe()
        assert "GPU + host RAM" in text and "sub-layers (S=" in text
        plans.append(plan)
    coarse, fine = plans
    assert sum(sp.sub_layers for sp in fine.splits) > sum(sp.sub_layers for sp in coarse.splits)


def test_choose_split_minimises_transfers_under_the_budget():
    lp = caffe_pb2.ConvolutionParameter(num_output=12, kernel_size=[3])
    cg = ConvGeometry.from_param(lp, (8, 6, 10, 10, 10))
    budget = 200_000
    sp = choose_split("c", cg, 8, budget, 4)
    brute = min((split_costs(cg, 8, s, fi, fo, 4)[1], (8 // s) * (6 // fi) * (12 // fo))
                for s in (1, 2, 4, 8) for fi in (1, 2, 3, 6) for fo in (1, 2, 3, 4, 6, 12)
                if split_costs(cg, 8, s, fi, fo, 4)[0] <= budget)
    assert (sp.transfer_bytes, sp.sub_layers) == brute and sp.device_bytes <= budget and sp.split
    assert choose_split("c", cg, 8, None, 4).sub_layers == 1
    counts = [choose_split("c", cg, 8, b, 4).sub_layers for b in (budget * 4, budget, budget // 2)]
    assert counts[0] < counts[1] < counts[2]  # a smaller budget gives finer splits
    with pytest.raises(MemoryBudgetError, match="layer 'c'.*smallest sub-layer"):
        choose_split("c", cg, 8, 1000, 4)


def test_device_planner_counts_device_bytes_and_shrinks_the_patch():
    net = random_net(TXT3, dtype=np.float32)
    geom = analyze(net)
    host = predict(net, geom, (2, 2, 2), (True, True))
    gpu = predict(net, geom, (2, 2, 2), (True, True), target="gpu")
    assert all(lp.strategy == "type1" for lp in gpu.layers) and gpu.target == "gpu"
    assert "on the GPU" in gpu.describe() and "host cost model" in gpu.describe()
    assert gpu.seconds > 0 and host.target == "host"
    big = choose_plan(net, geom, 1 << 30, (4, 4, 4), target="gpu")
    small = choose_plan(net, geom, big.peak_bytes // 4, (4, 4, 4), target="gpu")
    assert small.peak_bytes <= big.peak_bytes // 4 and np.prod(small.tile) < np.prod(big.tile)


def test_placement_of_the_output_and_clean_errors(case):
    net, vol, want = case
    di = DenseInference(net, patch=(16, 16, 16))
    out = np.full(want.shape, np.nan)
    assert di(vol, out=out) is out and di.target == "host"
    np.testing.assert_array_equal(out, want)
    with pytest.raises(CctError, match="out= has shape"):
        di(vol, out=np.empty((1, 2, 3)))
    with pytest.raises(CctError, match="needs the device"):
        target_of(HostDevice(), None, True)
    with pytest.raises(CctError, match="two different modes"):
        DenseInference(net, patch=(16, 16, 16), device=HostDevice(), host_ram=True, pipeline=1)


def test_cpu_gpu_pipeline_with_the_host_as_the_device_gives_the_one_stage_output(case):
    net, vol, want = case
    for pipeline in (1, 3, "auto"):
        di = DenseInference(net, patch=(16, 16, 16), device=HostDevice(), pipeline=pipeline, device_speedup=4.0)
        got = di(vol)
        assert di.target == "cpu-gpu" and di.device_net is not net and di.stages.device == HostDevice()
        assert di.plan.target == "cpu-gpu" and di.stages.second_runner.net is di.device_net
        if pipeline != "auto":
            assert di.plan.theta == pipeline
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert "CPU-GPU pipeline: first" in di.plan.describe() and "on host" in di.stages.describe()
    slow = DenseInference(net, patch=(16, 16, 16), device=HostDevice(), pipeline="auto", device_speedup=0.25)
    slow.prepare(vol.shape)
    assert slow.plan.theta > di.plan.theta  # a slower device gets fewer layers
    for theta in (1, 4, 7):  # auto balances the host's and the device's seconds best
        fixed = DenseInference(net, patch=(16, 16, 16), device=HostDevice(), pipeline=theta, device_speedup=0.25)
        assert max(slow.plan.stage_seconds) <= max(fixed.make_plan(vol.shape).stage_seconds) * (1 + 1e-9)


def test_cpu_gpu_pipeline_keeps_the_device_stage_within_the_device_budget(case):
    """The device copy's memory (its activation pool, type 1's work buffers after the split, the output tile, the
    weights) is checked against the device's budget: auto takes the best split that fits, a --patch that cannot
    fit at any split is refused in one line, and without --patch the planner takes a patch whose stage fits."""
    net, vol, _want = case
    free = DenseInference(net, patch=(16, 16, 16), device=HostDevice(), pipeline="auto", device_speedup=4.0,
                          device_budget=1 << 40).make_plan(vol.shape)
    needs = {th: device_stage_bytes(net, analyze(net), free, th) for th in range(1, len(analyze(net).ops))}
    assert free.device_peak_bytes == needs[free.theta] and "device stage" in free.describe()
    tight = sorted(set(needs.values()))[0]
    if needs[free.theta] > tight:  # a budget below the free choice's need moves the split to one that fits
        plan = DenseInference(net, patch=(16, 16, 16), device=HostDevice(), pipeline="auto", device_speedup=4.0,
                              device_budget=tight).make_plan(vol.shape)
        assert plan.device_peak_bytes <= tight and plan.theta != free.theta
    with pytest.raises(MemoryBudgetError, match="device stage needs .* device's memory budget"):
        DenseInference(net, patch=(16, 16, 16), device=HostDevice(), pipeline="auto", device_speedup=4.0,
                       device_budget=tight - 1).make_plan(vol.shape)
    auto = DenseInference(net, device=HostDevice(), pipeline="auto", device_speedup=4.0, device_budget=tight - 1)
    plan = auto.make_plan(vol.shape)
    assert plan.device_peak_bytes <= tight - 1 < free.device_peak_bytes and plan.target == "cpu-gpu"


@pytest.mark.skipif(cupy_available(), reason="checks the error of a machine without a GPU")
def test_gpu_flag_without_a_gpu_is_a_one_line_error(tmp_path, capsys):
    model = os.path.join(repo_root(), MODEL)
    args = ["infer", "--model", model, "--input", str(tmp_path / "v.h5"), "--output", str(tmp_path / "o.h5"),
            "--noprogress", "--plan_only"]
    assert main(args + ["--gpu", "0"]) != 0
    assert "no GPU is available" in capsys.readouterr().err
    assert main(args + ["--host_ram"]) != 0
    assert "need --gpu" in capsys.readouterr().err


def test_direct_buffers_are_counted_per_partition_thread():
    net = random_net(TXT3.replace("num_output: 2 ", "num_output: 6 "), dtype=np.float32)
    vol = np.random.default_rng(7).standard_normal((32, 32, 32)).astype(np.float32)
    di = DenseInference(net, patch=(32, 32, 32))
    di(vol)
    roles = di.plan.scratch_roles  # per thread: bytes per role (padded input, blocked output, blocked weights)
    split = [st[1].lowering for st in di.runner.steps
             if getattr(getattr(st[1], "lowering", None), "partitions", 1) not in (1, "model")]
    assert roles and (len(roles) > 1) == any(p.partitions > 1 and p.inner.name == "direct" for p in split)
    want = sorted((role, n) for r in roles for role, n in r.items() if n and role != "weights")  # weights: per layer
    assert di.runner.scratch.sizes() == want  # every thread's set, each its largest request
