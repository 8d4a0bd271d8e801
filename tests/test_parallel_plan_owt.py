"""Per-layer parallelism executed on MPI ranks (cct.parallel_plan.owt, .execute): LeNet's convolutions
by sample, its fully-connected tail by output channel (OWT) or by channel within groups of samples;
every run equals one process at the global batch (real Caffe's batch-4 run for 2 ranks at batch 2)."""
import json
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import test_distributed_train as dp
from mpirun import needs_mpi, run_mpi, script

from cct.cli import main

pytestmark = [needs_mpi(), pytest.mark.skipif(not dp.CASE.is_dir(), reason="shared/reference not available"),
              pytest.mark.usefixtures("numpy_kernels")]  # conftest.py: the ranks run the numpy kernels
case = dp.case  # the fixture: a fresh copy of Caffe's solver_sgd_lenet case
_compare = dp._compare


def train(case, ranks: int, batch: int, iters: int, out: str, *extra: str):
    args = ["python", script("train_run.py"), str(case), str(batch), str(iters), str(case / out), *extra]
    if ranks == 0:  # one plain process
        p = subprocess.run([sys.executable] + args[1:], capture_output=True, text=True, timeout=120,
                           env=dp._plain_env())
        assert p.returncode == 0, p.stderr[-3000:]
        return p
    return run_mpi(ranks, args, timeout=180)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The runs the tests below check, in one 2-rank launch (and one plain process for their one-process
    references): in a copy of the case, OWT for 5 iterations with a snapshot, data parallelism resumed to 8,
    OWT and data parallelism resumed from there to 10 with a TEST net; in a second copy with the CaffeNet-like
    net, OWT for 5 iterations. Returns both folders and each run's log by name."""
    case, other = (tmp_path_factory.mktemp("owt") / name for name in ("case", "caffenet"))
    for path in (case, other):
        shutil.copytree(dp.CASE, path)
    (other / "net.prototxt").write_text(CAFFENET_LIKE)
    solver = (case / "solver.prototxt").read_text()
    (case / "solver_test.prototxt").write_text(solver + "test_iter: 2\ntest_interval: 9\n")  # mid-run: no snapshot
    test = ("--solver", "solver_test.prototxt", "--resume", "snap_iter_8.solverstate")
    init = ("--init", "init.caffemodel")
    two = {"a": (case, 2, 5, case / "a.caffemodel", *init, "--snapshot", "5", "--parallel", "owt"),
           "b": (case, 2, 8, case / "b.caffemodel", "--resume", "snap_iter_5.solverstate", "--snapshot", "8"),
           "c": (case, 2, 10, case / "c.caffemodel", *test, "--parallel", "owt"),
           "d": (case, 2, 10, case / "d.caffemodel", *test),
           "caffenet": (other, 2, 5, other / "owt.caffemodel", "--parallel", "owt")}
    one = {"caffenet one": (other, 4, 5, other / "one.caffemodel"),
           "uneven one": (case, 12, 3, case / "one.caffemodel", *init)}
    logs = dict(zip(two, dp._train_runs(2, list(two.values()))[1]))
    logs.update(zip(one, dp._train_runs(0, list(one.values()))[1]))
    return case, other, logs


def test_owt_equals_caffe_and_resumes_across_configurations(runs):
    """10 SGD iterations (momentum, weight decay, step lr) of LeNet on 2 ranks at batch 2 in three runs:
    OWT (ip1, ip2 by output channel: 250 and 5 per rank) for 5 with a snapshot (the slices and their
    momentum gathered: single-process files), data parallelism resumed for 3 more with a snapshot, OWT
    resumed to 10 with a TEST net: real Caffe's batch-4 weights, and rank 0's test of the whole net. The
    first run's losses are Caffe's, only the convolutions' gradients are all-reduced, and the tail's
    exchanges move exactly the bytes counted below."""
    case, _, logs = runs
    assert "OWT on 2 MPI ranks" in logs["a"]
    got = json.loads((case / "a.caffemodel.json").read_text())
    want = json.loads((case / "losses.json").read_text())["losses"]
    assert np.allclose(got["losses"], want[:5], rtol=1e-5)
    assert got["stats"]["bytes"] == 4 * (20 * 25 + 20 + 50 * 20 * 25 + 50)  # ip1/ip2's 1.7 MB never all-reduced
    # floats a rank receives per forward: the other rank's pool2 (2 x 800), its ip1 slice (4 x 250), its ip2
    # slice of my samples (2 x 5); the backward the same (all-to-all, reduce-scatters by channel and by sample);
    # 5 iterations and the forward that displays the last loss
    forward = 2 * 800 + 4 * 250 + 2 * 5
    assert got["owt_bytes"] == 4 * (5 * 2 * forward + forward)
    _compare(case / "c.caffemodel", case / "final.caffemodel", 1e-5)  # measured 1.2e-7 straight
    # rank 0 tested the whole net (the slices gathered first): the same outputs as data parallelism's test
    outputs = re.compile(r"Test net output #\d+: \w+ = [-\d.e]+")
    assert outputs.findall(logs["c"]) and outputs.findall(logs["c"]) == outputs.findall(logs["d"])


def test_uneven_slices_on_3_ranks_and_a_mixed_tail_on_4_ranks_equal_one_process(runs):
    """One process at batch 12 (the fixture's); OWT on 3 ranks at batch 4 (ip1's 500 outputs as 167/167/166,
    ip2's 10 as 4/3/3: padded exchanges); the tail as n=2 c=2 on 4 ranks at batch 3 (two groups of samples,
    each splitting the channels; ranks 0 and 2 holding the same slices all-reduce their gradients)."""
    case = runs[0]
    train(case, 3, 4, 3, "owt3.caffemodel", "--init", "init.caffemodel", "--parallel", "owt")
    p = train(case, 4, 3, 3, "mixed4.caffemodel", "--init", "init.caffemodel", "--parallel", "owt2")
    assert "Tail split n=2 c=2 on 4 MPI ranks" in p.stderr
    for out in ("owt3", "mixed4"):
        _compare(case / f"{out}.caffemodel", case / "one.caffemodel", 1e-5)


CAFFENET_LIKE = """name: "caffenet_like"
layer { name: "data" type: "HDF5Data" top: "data" top: "label" include { phase: TRAIN }
        hdf5_data_param { source: "data_list.txt" batch_size: 4 } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 8 kernel_size: 5 stride: 1 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "norm1" type: "LRN" bottom: "conv1" top: "norm1" lrn_param { local_size: 3 alpha: 0.1 beta: 0.75 } }
layer { name: "pool1" type: "Pooling" bottom: "norm1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
        convolution_param { num_output: 16 kernel_size: 3 pad: 1 group: 2 weight_filler { type: "gaussian" std: 0.1 }
                            bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "norm2" type: "LRN" bottom: "conv2" top: "norm2" lrn_param { local_size: 3 alpha: 0.1 beta: 0.75 } }
layer { name: "pool2" type: "Pooling" bottom: "norm2" top: "pool2"
        pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "fc6" type: "InnerProduct" bottom: "pool2" top: "fc6"
        inner_product_param { num_output: 64 weight_filler { type: "gaussian" std: 0.05 } } }
layer { name: "relu6" type: "ReLU" bottom: "fc6" top: "fc6" }
layer { name: "fc7" type: "InnerProduct" bottom: "fc6" top: "fc7"
        inner_product_param { num_output: 32 weight_filler { type: "gaussian" std: 0.05 } } }
layer { name: "relu7" type: "ReLU" bottom: "fc7" top: "fc7" }
layer { name: "fc8" type: "InnerProduct" bottom: "fc7" top: "fc8"
        inner_product_param { num_output: 10 weight_filler { type: "gaussian" std: 0.05 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc8" bottom: "label" top: "loss" }
"""


def test_a_caffenet_like_net_with_groups_and_lrn_under_owt_equals_one_process(runs):
    """Grouped convolution, LRN, max pooling and a three-layer FC tail with ReLUs: OWT on 2 ranks at
    batch 2 ends with one process's weights at batch 4 (5 iterations, momentum and weight decay)."""
    _, other, logs = runs
    assert "fc6 (32 of 64 outputs per rank), fc7 (16 of 32 outputs per rank), fc8 (5 of 10" in logs["caffenet"]
    _compare(other / "owt.caffemodel", other / "one.caffemodel", 1e-5)


def test_cct_train_parallel_auto_and_omnivore_refused(case, monkeypatch, capfd):
    """--parallel auto measures the links and the layers, logs the cost model's cheapest executable plan
    beside DeePa's unrestricted optimum, then runs the measured pick (test_parallel_plan_measured.py); Omnivore's
    --groups is refused with any per-layer plan. (Plan files: the family check below; the same setup.)"""
    p = run_mpi(2, ["python", "-m", "cct", "train", "--solver", "solver.prototxt", "--weights", "init.caffemodel",
                    "--parallel", "auto", "--iterations", "2", "--noprogress"], cwd=str(case), timeout=180)
    assert "Per-layer parallelism on 1 machine(s) x 2 worker(s)" in p.stderr
    assert "DeePa's unrestricted optimum (" in p.stderr and "update ms" in p.stderr
    assert "--parallel auto: the optimum cct train executes ('deepa') splits " in p.stderr
    assert "--parallel auto: measured step ms" in p.stderr
    monkeypatch.chdir(case)  # checked before any rank's work: in this process (cct.cli.main, what cct runs)
    capfd.readouterr()
    assert main(["train", "--solver", "solver.prototxt", "--parallel", "owt", "--groups", "2"]) == 1
    assert "cannot be combined with Omnivore's --groups" in capfd.readouterr().err
    p = run_mpi(2, ["python", "-m", "cct", "train", "--solver", "solver.prototxt", "--parallel", "owt", "--devices",
                    "cpu,cpu:1"], cwd=str(case), timeout=60, check=False)  # in-process workers inside a rank: refused
    assert p.returncode != 0 and "--parallel owt with several --devices per MPI rank is not supported" in p.stderr


def test_a_killed_rank_ends_an_owt_job_quickly(case):
    t = time.perf_counter()
    p = run_mpi(2, ["python", script("train_run.py"), str(case), "2", "10", str(case / "x.caffemodel"),
                    "--parallel", "owt", "--die", "1:3:kill"], timeout=60, check=False)
    assert p.returncode != 0 and time.perf_counter() - t < 30
    assert "EXIT CODE: 9" in p.stdout + p.stderr
