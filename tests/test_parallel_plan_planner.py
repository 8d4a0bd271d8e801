"""Strategies, plan files, the planner on CaffeNet and ``cct plan`` (cct.parallel_plan)."""
from __future__ import annotations

import itertools

import pytest
from mpirun import needs_mpi, run_mpi

from cct import cli
from cct.parallel_plan.cluster import Cluster
from cct.parallel_plan.compute import MeasuredCompute, ScaledCompute, compute_cache
from cct.parallel_plan.costs import price
from cct.parallel_plan.graph import graph_from_net, planning_net
from cct.parallel_plan.planfile import read_plan, write_plan
from cct.parallel_plan.planner import plan_net
from cct.parallel_plan.plans import Plan, data_parallel, one_weird_trick, optimal
from cct.parallel_plan.split import PlanError, Split
from cct.paths import repo_root

SMALL = """
name: "small"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 8 dim: 3 dim: 12 dim: 12 } shape { dim: 8 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "norm1" type: "LRN" bottom: "pool1" top: "norm1" lrn_param { local_size: 3 } }
layer { name: "fc1" type: "InnerProduct" bottom: "norm1" top: "fc1" inner_product_param { num_output: 16 } }
layer { name: "fc2" type: "InnerProduct" bottom: "fc1" top: "fc2" inner_product_param { num_output: 4 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc2" bottom: "label" top: "loss" }
"""


def small_net(tmp_path):
    path = tmp_path / "small.prototxt"
    path.write_text(SMALL)
    return str(path)


def flat_rates(graph, per_element: float = 1e-9) -> ScaledCompute:
    return ScaledCompute({n.name: per_element for n in graph.nodes})


def test_strategies_and_the_optimum_equal_brute_force(tmp_path):
    net, batch = planning_net(small_net(tmp_path))
    assert batch == 8
    graph = graph_from_net(net, batch)
    assert [n.name for n in graph.nodes] == ["data", "conv1", "pool1", "norm1", "fc1", "fc2", "loss"]
    cluster = Cluster(1, 2, 1e6, 1e6)
    priced = price(graph, 2, cluster.inv_bandwidth(), flat_rates(graph, 1e-6))
    data, owt = data_parallel(priced), one_weird_trick(priced)
    assert set(data.splits.values()) == {Split(n=2)}
    assert owt.splits["fc1"] == Split(c=2) and owt.splits["conv1"] == Split(n=2)
    auto, residual = optimal(priced)
    assert residual <= 2
    cg = priced.cost_graph()
    best = min(itertools.product(*[range(len(s)) for s in priced.splits]), key=cg.cost)
    assert cg.cost(auto.assignment(priced)) == pytest.approx(cg.cost(best))
    est = {name: priced.estimate(p.assignment(priced)) for name, p in (("data", data), ("owt", owt), ("auto", auto))}
    assert est["auto"].seconds == pytest.approx(cg.cost(best))
    assert est["auto"].seconds <= min(est["data"].seconds, est["owt"].seconds) + 1e-12
    # data parallelism moves no activations, only every parameter's gradient (ring: 2 (W-1) P)
    params = sum(n.param_bytes for n in graph.nodes)
    assert est["data"].xfer_bytes == 0 and est["data"].update_bytes == pytest.approx(2 * params)


def test_caffenet_on_a_slow_network_moves_5x_fewer_bytes_than_data_parallelism():
    """16 workers on 4 machines whose network is slow next to compute: the optimum keeps the FC layers on
    few workers by channel and moves at least 5x fewer bytes than data parallelism."""
    net, _ = planning_net(str(repo_root() / "models/caffenet/train_val_synthetic.prototxt"))
    graph = graph_from_net(net, 512)
    result = plan_net(net, Cluster(4, 4, 10e9, 0.5e9), flat_rates(graph, 2e-11), "auto", batch=512)
    data, auto = result.estimates["data"], result.estimates["auto"]
    assert data.total_bytes >= 5 * auto.total_bytes
    assert auto.seconds <= result.estimates["owt"].seconds <= data.seconds
    assert result.residual <= 2


def test_plan_file_round_trip_and_errors(tmp_path):
    net, batch = planning_net(small_net(tmp_path))
    graph = graph_from_net(net, batch)
    priced = price(graph, 4, Cluster(1, 4, 1e9, 1e9).inv_bandwidth(), flat_rates(graph))
    auto, _ = optimal(priced)
    path = tmp_path / "plan.txt"
    write_plan(path, auto, priced.estimate(auto.assignment(priced)), ["a header"])
    text = path.read_text()
    assert "# a header" in text and "workers: 4" in text and "compute" in text
    back = read_plan(path)
    assert back.splits == auto.splits and back.workers == 4
    assert back.assignment(priced) == auto.assignment(priced)

    path.write_text(text.replace("fc1: ", "fc9: "))
    with pytest.raises(PlanError, match=r"plan.txt: line \d+: no layer 'fc9'"):
        read_plan(path).assignment(priced)
    path.write_text(text.replace("workers: 4", "workers: 2"))
    with pytest.raises(PlanError, match="does not divide 2|for 2 workers"):
        read_plan(path).assignment(priced)
    lines = [ln if not ln.startswith("fc1:") else "fc1: h=2" for ln in text.splitlines()]
    path.write_text("\n".join(lines))
    with pytest.raises(PlanError, match=r"line \d+: layer 'fc1' \(fc.*cannot take n=1 h=2"):
        read_plan(path).assignment(priced)
    path.write_text("fc1: n=2\n")
    with pytest.raises(PlanError, match="no 'workers: N' line"):
        read_plan(path)
    path.write_text("workers: 2\nfc1 n=2\n")
    with pytest.raises(PlanError, match=r"plan.txt:2: expected 'layer: "):
        read_plan(path)
    with pytest.raises(PlanError, match="no configuration for layer"):
        Plan(4, {"data": Split(n=4)}).assignment(priced)


def test_cluster_description_and_bad_clusters():
    c = Cluster.parse("4x4,intra=10G,inter=1.25GB/s,speed=50")
    assert (c.workers, c.intra, c.inter, c.speed) == (16, 10e9, 1.25e9, 50.0)
    inv = c.inv_bandwidth()
    assert inv[0, 0] == 0 and inv[0, 3] == pytest.approx(1e-10) and inv[0, 4] == pytest.approx(1 / 1.25e9)
    for bad, msg in (("4", "MACHINESxWORKERS"), ("2x2,fast=1", "unknown option"), ("2x2,inter=slow", "bandwidth")):
        with pytest.raises(PlanError, match=msg):
            Cluster.parse(bad)


def test_cct_plan_command_writes_the_plan_and_logs_the_table(tmp_path, capfd):
    out = tmp_path / "plan.txt"
    assert cli.main(["plan", "--model", small_net(tmp_path), "--cluster", "2x2,intra=10G,inter=1G",
                     "--reference_batch", "2", "--out", str(out)]) == 0
    log = capfd.readouterr().err
    assert "left after node and edge elimination" in log and "fc1" in log and "update ms" in log
    assert "owt" in log and "auto" in log
    plan = read_plan(out)
    assert plan.workers == 4 and set(plan.splits) == {"data", "conv1", "pool1", "norm1", "fc1", "fc2", "loss"}
    assert "; with relu1" in out.read_text()
    assert cli.main(["plan", "--model", small_net(tmp_path), "--cluster", "2x2,intra=10G,inter=1G",
                     "--reference_batch", "2", "--parallel", str(out)]) == 0
    assert "\nfile" in capfd.readouterr().err.replace("] file ", "\nfile ")
    assert cli.main(["plan", "--model", small_net(tmp_path), "--workers", "3", "--cluster", "1x3"]) == 1
    assert "give --workers or --cluster, not both" in capfd.readouterr().err
    assert cli.main(["plan", "--model", str(tmp_path / "nope.prototxt"), "--workers", "2"]) == 1
    assert "nope.prototxt: no such file" in capfd.readouterr().err


@needs_mpi()
def test_cct_plan_on_two_mpi_ranks_measures_the_link(tmp_path):
    out = tmp_path / "plan.txt"
    p = run_mpi(2, ["python", "-m", "cct", "plan", "--model", small_net(tmp_path), "--reference_batch", "2",
                    "--out", str(out)], timeout=120)
    assert "1 machine(s) x 2 worker(s), links" in p.stderr
    assert read_plan(out).workers == 2


def test_measured_compute_times_every_part_and_caches_them(tmp_path, capfd):
    """--compute measured: each configuration's part net timed and cached (a second planner reads the same
    times from the cache file instead of measuring again)."""
    net, batch = planning_net(small_net(tmp_path))
    graph = graph_from_net(net, batch)
    fc1 = graph.index("fc1")
    splits = [Split(), Split(c=2), Split(n=2)]
    first = MeasuredCompute(net, compute_cache()).seconds(graph, fc1, splits)
    assert all(t > 0 for t in first)
    again = MeasuredCompute(net, compute_cache()).seconds(graph, fc1, splits)
    assert list(again) == list(first)  # from the cache file
    assert cli.main(["plan", "--model", small_net(tmp_path), "--workers", "2", "--compute", "measured"]) == 0
    assert "(measured compute)" in capfd.readouterr().err
