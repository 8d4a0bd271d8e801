"""Synchronous data-parallel training under mpiexec (MPICH on loopback): N ranks at batch b equal one
process at batch N*b (and real Caffe, which ran solver_sgd_lenet at batch 4), rank-0-only logs and
snapshots, resume with the same and a different rank count, and failing ranks ending the job."""
import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
from mpirun import ROOT, mpiexec, needs_mpi, run_logs, run_mpi, script

from cct.cli import main
from cct.io.caffemodel import read_weights
from cct.io.prototxt import read_net_prototxt, to_text
from cct.net import Net
from cct.paths import shared_path

CASE = shared_path("reference", "solver_sgd_lenet")
pytestmark = [needs_mpi(), pytest.mark.skipif(not CASE.is_dir(), reason="shared/reference not available")]


@pytest.fixture
def case(tmp_path):
    work = tmp_path / "case"
    shutil.copytree(CASE, work)
    return work


def _rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _compare(got_path, want_path, tol):
    got, want = read_weights(str(got_path)), read_weights(str(want_path))
    worst = 0.0
    for name, blobs in want.items():
        for g, w in zip(got[name], blobs):
            worst = max(worst, _rel(g, w))
    assert worst <= tol, f"{got_path} vs {want_path}: worst relative L2 difference {worst:.3g} > {tol}"
    return worst


def _plain_env():
    """The environment of a process not started by mpiexec, importing this tree's cct."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "MPI_"))}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _train(case, n, batch, iters, out, *extra, timeout=90):
    """train_run.py on n ranks (n = 0: one plain process without mpiexec)."""
    return _train_runs(n, [(case, batch, iters, out, *extra)], timeout=timeout)[0]


def _train_runs(n, runs, timeout=90, env=None):
    """Several train_run.py runs (``(workdir, batch, iters, out, *extra)`` each) one after another in one
    launch on n ranks (n = 0: one plain process without mpiexec): one start and one import of cct for all.
    ``env``: variables set for the launch. Returns the finished process, and its stderr cut into the runs' logs."""
    args = ["python", script("train_run.py")]
    for run in runs:
        args += [str(x) for x in run] + ["++"]
    args, timeout = args[:-1], timeout * len(runs)
    if n == 0:
        p = subprocess.run([sys.executable] + args[1:], capture_output=True, text=True, timeout=timeout,
                           env={**_plain_env(), **(env or {})})
        assert p.returncode == 0, p.stderr[-3000:]
    else:
        p = run_mpi(n, args, timeout=timeout, env=env)
    logs = run_logs(p.stderr)
    assert len(logs) == len(runs), p.stderr[-3000:]
    return p, logs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The runs the tests below check, from Caffe's initial weights in one copy of the case: the 2-rank runs in
    one launch, their one-process references in one plain process (each run writes its own output file).
    Returns the case folder and each run's log by name."""
    case = tmp_path_factory.mktemp("runs") / "case"
    shutil.copytree(CASE, case)
    solver = (case / "solver.prototxt").read_text()
    (case / "solver_test.prototxt").write_text(solver + "test_iter: 3\ntest_interval: 2\n")
    init = ("--init", "init.caffemodel")
    test = ("--solver", "solver_test.prototxt", "--test_batch", "4")
    two = {"data": (case, 2, 10, case / "out.caffemodel", *init),
           "shares 3,1": (case, 2, 10, case / "shares_3_1.caffemodel", *init, "--shares", "3,1"),
           "shares auto": (case, 2, 10, case / "shares_auto.caffemodel", *init, "--shares", "auto"),
           "test two": (case, 2, 4, case / "two.caffemodel", *init, *test),
           # the last: the devices stay set for the rest of the process's runs
           "devices": (case, 2, 10, case / "devices.caffemodel", *init, "--devices", "cpu:0:threads=1,cpu:1:threads=1")}
    one = {"test one": (case, 4, 4, case / "one.caffemodel", *init, *test),
           "iter_size one": (case, 6, 4, case / "iter_size_one.caffemodel", *init, "--iter_size", "2")}
    logs = dict(zip(two, _train_runs(2, list(two.values()))[1]))
    logs.update(zip(one, _train_runs(0, list(one.values()))[1]))
    return case, logs


def test_two_ranks_at_batch_2_equal_caffe_at_batch_4(runs):
    case, _ = runs
    _compare(case / "out.caffemodel", case / "final.caffemodel", 1e-4)
    got = json.loads((case / "out.caffemodel.json").read_text())
    want = json.loads((case / "losses.json").read_text())["losses"]
    assert got["ranks"] == 2 and np.allclose(got["losses"], want, rtol=1e-5)  # the global batch's loss
    stats = got["stats"]
    assert stats["iterations"] == 10 and stats["bytes"] == 4 * 431080 and stats["buckets"] >= 2
    # the gradient all-reduce writes into the diffs: every rank trained with the flat parameter views intact
    # (test_flat_params.py)
    assert got["flat_params_intact"] is True


def test_ranks_compose_with_each_ranks_own_devices(runs):
    """Each rank splits its batch of 2 over two CPU devices (the scheduler's executor): the gradients
    are final only after its finish_backward, and the run still equals Caffe's batch-4 run."""
    case, _ = runs
    _compare(case / "devices.caffemodel", case / "final.caffemodel", 1e-4)


@pytest.mark.parametrize("shares", ["3,1", "auto"])
def test_unequal_batch_shares_keep_the_update_exact(runs, shares):
    """Stretch goal: rank 0 takes 3 and rank 1 takes 1 record of every global batch of 4 (or shares
    set from the measured speeds); gradients weighted by share: still Caffe's batch-4 run."""
    case, _ = runs
    out = case / f"shares_{shares.replace(',', '_')}.caffemodel"
    _compare(out, case / "final.caffemodel", 1e-4)
    got = json.loads(out.with_name(out.name + ".json").read_text())
    want = json.loads((case / "losses.json").read_text())["losses"]
    assert np.allclose(got["losses"], want, rtol=1e-5)
    assert sum(got["shares"]) == 4 and (shares == "auto" or got["shares"] == [3, 1])


def test_three_ranks_with_iter_size_equal_one_process_at_the_combined_batch(runs):
    case, _ = runs  # the one-process run at batch 6 (iter_size 2) is the fixture's
    _train(case, 3, 2, 4, case / "three.caffemodel", "--init", "init.caffemodel", "--iter_size", "2")
    _compare(case / "three.caffemodel", case / "iter_size_one.caffemodel", 1e-5)
    a = json.loads((case / "three.caffemodel.json").read_text())["losses"]
    b = json.loads((case / "iter_size_one.caffemodel.json").read_text())["losses"]
    assert np.allclose(a, b, rtol=1e-5)


_TEST_OUTPUT = re.compile(r"Test net output #\d+: (\w+) = ([-\d.e]+)")


def test_test_outputs_are_the_mean_over_test_iter_batches_as_in_one_process(runs, monkeypatch):
    """test_iter: 3 (test batch 4, the prototxt's, on the root as in Caffe's multi-GPU): rank 0 of a
    2-rank run logs at iterations 0, 2 and 4 what one process at the global batch logs, and the last
    values are the mean over the last three test batches under the final weights (computed directly here)."""
    case, logs = runs
    got, want = _TEST_OUTPUT.findall(logs["test two"]), _TEST_OUTPUT.findall(logs["test one"])
    assert len(got) == 6 and [n for n, _ in got] == [n for n, _ in want] == ["accuracy", "loss"] * 3
    assert np.allclose([float(v) for _, v in got], [float(v) for _, v in want], rtol=1e-5, atol=1e-6)
    monkeypatch.chdir(case)  # the HDF5 list names data.h5 relative to the case
    net = Net("net.prototxt", "TEST", weights="two.caffemodel")
    batches = []
    for _ in range(9):  # the test net reads on: the tests at iterations 0 and 2 took the first 6 batches
        net.forward()
        batches.append([float(net.blobs[b].data.ravel()[0]) for b in ("accuracy", "loss")])
    batches = batches[6:]
    mean = np.mean(np.array(batches, np.float64), axis=0)
    assert np.allclose([float(v) for _, v in got[-2:]], mean, rtol=1e-5)
    assert not np.allclose(batches[0][1], mean[1], rtol=1e-3)  # a single batch's loss is not the mean


def _cli_case(case, batch, name):
    net = read_net_prototxt(str(case / "net.prototxt"))
    for layer in net.layer:
        layer.hdf5_data_param.batch_size = batch
    (case / f"net_{name}.prototxt").write_text(to_text(net))
    solver = (case / "solver.prototxt").read_text()
    solver = solver.replace('net: "net.prototxt"', f'net: "net_{name}.prototxt"')
    solver = re.sub(r"snapshot: \d+", "snapshot: 5", solver).replace('snapshot_prefix: "solver_sgd_lenet"',
                                                                       'snapshot_prefix: "snap/lenet"')
    (case / f"solver_{name}.prototxt").write_text(solver)
    return f"solver_{name}.prototxt"


def test_cli_rank0_logs_and_snapshots_and_resume_with_same_and_other_rank_count(case, monkeypatch, capfd):
    s2 = _cli_case(case, 2, "b2")
    p = run_mpi(2, ["python", "-m", "cct", "train", "--solver", s2, "--weights", "init.caffemodel"], cwd=case,
                timeout=120)
    log = p.stderr
    assert log.count("Data parallel on 2 MPI ranks: each rank batch 2, global batch 4") == 1
    assert len(re.findall(r"Iteration 9 \(.*\), loss = ", log)) == 1  # rank 0 alone logs
    assert log.count("Snapshotting to binary proto file snap/lenet_iter_5.caffemodel") == 1
    files = sorted(os.listdir(case / "snap"))
    assert files == [f"lenet_iter_{i}.{e}" for i in (10, 5) for e in ("caffemodel", "cctstate", "solverstate")]
    _compare(case / "snap" / "lenet_iter_10.caffemodel", case / "final.caffemodel", 1e-4)
    extra = json.loads((case / "snap" / "lenet_iter_5.cctstate").read_text())
    assert extra["ranks"] == 2 and len(extra["train_net_ranks"]) == 2
    offsets = sorted(s["mnist"]["offset"] for s in extra["train_net_ranks"])
    assert offsets == [19, 20]  # 5 iterations x 4 records; rank 0 stands after record 18, rank 1 after 19
    shutil.copy(case / "snap" / "lenet_iter_10.caffemodel", case / "straight.caffemodel")

    # same rank count: continues exactly
    p = run_mpi(2, ["python", "-m", "cct", "train", "--solver", s2, "--snapshot", "snap/lenet_iter_5.solverstate"],
                cwd=case, timeout=120)
    _compare(case / "snap" / "lenet_iter_10.caffemodel", case / "straight.caffemodel", 1e-6)
    # one process at the same global batch: data restarts from the shared record counter (in this process:
    # cct.cli.main, what cct runs; the launches above are cct train processes)
    s4 = _cli_case(case, 4, "b4")
    monkeypatch.chdir(case)
    capfd.readouterr()
    code = main(["train", "--solver", s4, "--snapshot", "snap/lenet_iter_5.solverstate"])
    err = capfd.readouterr().err
    assert code == 0, err[-3000:]
    assert "was written by 2 rank(s), this run has 1: the data read positions restart from the shared record " \
           "counter (mnist at record 20)" in err
    _compare(case / "snap" / "lenet_iter_10.caffemodel", case / "final.caffemodel", 1e-4)


@pytest.mark.parametrize("how", ["kill", "raise"])
def test_a_failing_rank_ends_the_job_quickly(case, how):
    t = time.perf_counter()
    p = _train_fail(case, how)
    took = time.perf_counter() - t
    assert p.returncode != 0 and took < 30
    if how == "raise":
        assert "MPI rank 1 of 2 failed, ending the job: CctError: injected failure at iteration 3" in p.stderr
    else:
        assert "EXIT CODE: 9" in p.stdout + p.stderr
        pids = dict(re.findall(r"(\d+)=pid (\d+)@", p.stderr))
        # mpiexec names processes by pid only (which one it names varies); rank 0's log maps each to its rank
        named = set(re.findall(r"PID (\d+) ", p.stdout + p.stderr))
        assert named and named <= set(pids.values()), (named, pids)


def _train_fail(case, how):
    return run_mpi(2, ["python", script("train_run.py"), str(case), "2", "10", str(case / "x.caffemodel"),
                       "--die", f"1:3:{how}"], timeout=60, check=False)


def test_mismatched_solvers_or_missing_files_across_ranks_are_reported(case):
    s2 = _cli_case(case, 2, "b2")
    s4 = _cli_case(case, 4, "b4")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [mpiexec(), "-n", "1", sys.executable, "-m", "cct", "train", "--solver", s2, ":",
           "-n", "1", sys.executable, "-m", "cct", "train", "--solver", s4]
    p = subprocess.run(cmd, cwd=case, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert "the solver and net definitions (solver prototxt, net prototxt, level/stage) differ across ranks: " \
           "rank(s) 1 differ from rank 0" in p.stderr
    cmd[-1] = "missing.prototxt"
    p = subprocess.run(cmd, cwd=case, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "MPI rank 1 of 2 failed, ending the job" in p.stderr
    assert "missing.prototxt" in p.stderr


def test_ctrl_c_on_mpiexec_stops_every_rank_with_one_snapshot(case):
    """MPICH's mpiexec forwards the first SIGINT to every rank; the ranks agree to stop at the end of the
    same iteration, and rank 0 writes the final snapshot (snapshot_after_train)."""
    s2 = _cli_case(case, 2, "b2")
    text = (case / s2).read_text()
    text = re.sub(r"max_iter: \d+", "max_iter: 1000000", text).replace("snapshot: 5", "snapshot: 10")
    (case / s2).write_text(re.sub(r"display: \d+", "display: 100", text))
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.Popen([mpiexec(), "-n", "2", sys.executable, "-m", "cct", "train", "--solver", s2,
                             "--weights", "init.caffemodel"], cwd=case, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while not (case / "snap" / "lenet_iter_10.cctstate").exists():
            assert proc.poll() is None and time.time() < deadline, "training did not reach iteration 10"
            time.sleep(0.1)
        proc.send_signal(2)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert err.count("Optimization stopped early.") == 1
    stopped = [int(m) for m in re.findall(r"lenet_iter_(\d+)\.caffemodel", " ".join(os.listdir(case / "snap")))]
    last = max(stopped)
    assert last > 10 and err.count(f"Snapshotting to binary proto file snap/lenet_iter_{last}.caffemodel") == 1
    extra = json.loads((case / "snap" / f"lenet_iter_{last}.cctstate").read_text())
    assert extra["iter"] == last and extra["ranks"] == 2
