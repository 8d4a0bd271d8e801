"""OWT execution on MPI ranks (cct.parallel_plan.owt): LeNet's convolutions by sample, its
fully-connected layers by output channel, on 2 ranks at batch 2 equal real Caffe at batch 4."""
import json
import time

import numpy as np
import pytest
import test_distributed_train as dp
from mpirun import needs_mpi, run_mpi, script

pytestmark = [needs_mpi(), pytest.mark.skipif(not dp.CASE.is_dir(), reason="shared/reference not available")]
case = dp.case  # the fixture: a fresh copy of Caffe's solver_sgd_lenet case
_compare = dp._compare


def test_owt_on_two_ranks_at_batch_2_equals_caffe_at_batch_4(case):
    """10 SGD iterations (momentum, weight decay, step lr) of LeNet: conv1-pool2 by sample, ip1 and ip2
    by output channel (250 and 5 per rank); the weights (rank 0 gathers the slices) and the logged
    losses equal Caffe's batch-4 run; only the convolutions' gradients are all-reduced."""
    out = case / "owt.caffemodel"
    p = run_mpi(2, ["python", script("train_run.py"), str(case), "2", "10", str(out), "--init", "init.caffemodel",
                    "--parallel", "owt"], timeout=120)
    assert "OWT on 2 MPI ranks" in p.stderr
    assert _compare(out, case / "final.caffemodel", 1e-6) > 0  # measured 1.2e-7, as data parallelism
    got = json.loads((case / "owt.caffemodel.json").read_text())
    want = json.loads((case / "losses.json").read_text())["losses"]
    assert np.allclose(got["losses"], want, rtol=1e-5)
    conv_param_bytes = 4 * (20 * 1 * 5 * 5 + 20 + 50 * 20 * 5 * 5 + 50)
    assert got["stats"]["bytes"] == conv_param_bytes  # ip1/ip2 (1.7 MB of weights) are never all-reduced
    # floats each rank receives: forward: the other rank's pool2 (2 x 800), its ip1 slice (4 x 250), its ip2
    # slice of my samples (2 x 5); backward: the same amounts (all-to-all, then reduce-scatters by channel and
    # by sample); 10 iterations and the forward that displays the final loss
    forward = 2 * 800 + 4 * 250 + 2 * 5
    assert got["owt_bytes"] == 4 * (10 * 2 * forward + forward)


def test_owt_on_three_ranks_with_uneven_slices_equals_data_parallelism(case):
    """3 ranks: ip1's 500 outputs split 167/167/166, ip2's 10 split 4/3/3 (exchanges padded); 5 iterations
    at batch 1 per rank end with the weights of data parallelism on the same 3 ranks (= one process at
    batch 3), and the OWT run all-reduces only the convolutions' gradients."""
    outs = {}
    for mode in ("data", "owt"):
        outs[mode] = case / f"{mode}3.caffemodel"
        run_mpi(3, ["python", script("train_run.py"), str(case), "1", "5", str(outs[mode]), "--init",
                    "init.caffemodel", "--parallel", mode], timeout=120)
    assert _compare(outs["owt"], outs["data"], 1e-6) > 0
    got = json.loads((case / "owt3.caffemodel.json").read_text())
    assert got["stats"]["bytes"] == 4 * (20 * 25 + 20 + 50 * 20 * 25 + 50) and got["owt_bytes"] > 0


def test_a_mixed_tail_split_n2_c2_on_four_ranks_equals_data_parallelism(case):
    """4 ranks: the FC tail as n=2 c=2 (ranks 0-1 split the channels of their samples, ranks 2-3 of theirs;
    ranks 0 and 2 hold the same slices and all-reduce their gradients): data parallelism's weights."""
    outs = {}
    for mode in ("data", "owt2"):
        outs[mode] = case / f"{mode}4.caffemodel"
        p = run_mpi(4, ["python", script("train_run.py"), str(case), "1", "4", str(outs[mode]), "--init",
                        "init.caffemodel", "--parallel", mode], timeout=180)
    assert "Tail split n=2 c=2 on 4 MPI ranks" in p.stderr
    assert _compare(outs["owt2"], outs["data"], 1e-6) > 0


def test_cct_train_parallel_owt_equals_data_parallelism(case):
    """The command line: the same run under --parallel data and --parallel owt on 2 ranks (batch 4 each)
    ends with the same snapshot, written by rank 0 alone in the single-process format."""
    finals = {}
    for mode in ("data", "owt"):
        run_mpi(2, ["python", "-m", "cct", "train", "--solver", "solver.prototxt", "--weights", "init.caffemodel",
                    "--parallel", mode, "--noprogress"], cwd=str(case), timeout=120)
        snap = case / "solver_sgd_lenet_iter_10.caffemodel"
        finals[mode] = case / f"{mode}.caffemodel"
        snap.rename(finals[mode])
    assert _compare(finals["owt"], finals["data"], 1e-6) > 0


def test_cct_train_parallel_auto_and_plan_files(case):
    """--parallel auto runs the cost model's cheapest executable plan and logs it beside DeePa's optimum; a
    plan file of the executed family runs (here OWT, written by hand); one outside it is refused naming the
    layer; --groups is refused with any per-layer plan."""
    p = run_mpi(2, ["python", "-m", "cct", "train", "--solver", "solver.prototxt", "--weights", "init.caffemodel",
                    "--parallel", "auto", "--noprogress"], cwd=str(case), timeout=180)
    assert "Per-layer parallelism on 1 machine(s) x 2 worker(s)" in p.stderr
    assert "DeePa's unrestricted optimum" in p.stderr and "update ms" in p.stderr
    plan = case / "tail.plan"
    names = ["mnist", "conv1", "pool1", "conv2", "pool2", "ip1", "ip2", "loss"]
    lines = ["workers: 2"] + [f"{n}: {'c=2' if n.startswith('ip') else 'n=2'}" for n in names]
    plan.write_text("\n".join(lines) + "\n")
    p = run_mpi(2, ["python", "-m", "cct", "train", "--solver", "solver.prototxt", "--weights", "init.caffemodel",
                    "--parallel", str(plan), "--noprogress"], cwd=str(case), timeout=180)
    assert "OWT on 2 MPI ranks" in p.stderr
    plan.write_text(plan.read_text().replace("conv2: n=2", "conv2: h=2"))
    p = run_mpi(2, ["python", "-m", "cct", "train", "--solver", "solver.prototxt", "--parallel", str(plan)],
                cwd=str(case), timeout=180, check=False)
    assert p.returncode != 0 and "tail.plan: line 5: layer 'conv2' n=1 h=2 w=1 c=1: cct train executes" in p.stderr
    p = run_mpi(1, ["python", "-m", "cct", "train", "--solver", "solver.prototxt", "--parallel", "owt", "--groups",
                    "2"], cwd=str(case), timeout=60, check=False)
    assert p.returncode == 1 and "cannot be combined with Omnivore's --groups" in p.stderr


@pytest.mark.parametrize("first,then", [("owt", "data"), ("data", "owt")])
def test_resume_across_configurations(case, first, then):
    """5 iterations under one configuration with a snapshot (single-process files: the OWT slices and their
    momentum gathered), 5 more resumed under the other: Caffe's batch-4 run to float rounding."""
    run_mpi(2, ["python", script("train_run.py"), str(case), "2", "5", str(case / "half.caffemodel"), "--init",
                "init.caffemodel", "--snapshot", "5", "--parallel", first], timeout=120)
    run_mpi(2, ["python", script("train_run.py"), str(case), "2", "10", str(case / "resumed.caffemodel"),
                "--resume", "snap_iter_5.solverstate", "--parallel", then], timeout=120)
    assert _compare(case / "resumed.caffemodel", case / "final.caffemodel", 1e-5) > 0


def test_a_killed_rank_ends_an_owt_job_quickly(case):
    t = time.perf_counter()
    p = run_mpi(2, ["python", script("train_run.py"), str(case), "2", "10", str(case / "x.caffemodel"),
                    "--parallel", "owt", "--die", "1:3:kill"], timeout=60, check=False)
    assert p.returncode != 0 and time.perf_counter() - t < 30
    assert "EXIT CODE: 9" in p.stdout + p.stderr
