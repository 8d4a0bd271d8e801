"""Omnivore on real MPI ranks (mpiexec on loopback, MPICH): g = 1 equals synchronous SGD, asynchronous
groups converge on a convex problem, the optimizer's decisions are logged, a failing rank stops the job
with an error naming it and leaves no snapshot behind."""
import glob
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

h5py = pytest.importorskip("h5py")
pytest.importorskip("mpi4py")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")

CONV_FC = """
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
        convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "ip" type: "InnerProduct" bottom: "conv2" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""
# multinomial logistic regression written as a 6x6 convolution: convex, and no FC tail (data parallel)
CONVEX = """
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 3 kernel_size: 6 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "conv1" bottom: "label" top: "loss" }
"""


def make_problem(d, body, max_iter, lr=0.05, extra=""):
    """An HDF5 data set of 96 6x6 images labelled by a linear teacher, a net and its solver in ``d``."""
    d = str(d)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((96, 1, 6, 6)).astype(np.float32)
    y = np.argmax(x.reshape(96, -1) @ rng.standard_normal((36, 3)), axis=1).astype(np.float32)
    with h5py.File(os.path.join(d, "train.h5"), "w") as f:
        f["data"] = x
        f["label"] = y
    with open(os.path.join(d, "list.txt"), "w") as f:
        f.write(os.path.join(d, "train.h5") + "\n")
    with open(os.path.join(d, "net.prototxt"), "w") as f:
        f.write(f'name: "t"\nlayer {{ name: "d" type: "HDF5Data" top: "data" top: "label" '
                f'hdf5_data_param {{ source: "{d}/list.txt" batch_size: 8 }} }}\n{body}')
    solver = os.path.join(d, "solver.prototxt")
    with open(solver, "w") as f:
        f.write(f'net: "{d}/net.prototxt"\nbase_lr: {lr}\nmomentum: 0.9\nweight_decay: 0.0005\nlr_policy: "fixed"\n'
                f'max_iter: {max_iter}\ndisplay: 1\nrandom_seed: 1\nsnapshot_prefix: "{d}/out"\n{extra}')
    return solver


def mpirun(n, *args, timeout=120):
    # numpy kernels: three ranks loading the numba kernels at once on 2 cores cost more than these tiny nets
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), CCT_KERNELS="numpy")
    return subprocess.run([MPIEXEC, "-n", str(n), sys.executable, "-m", "cct", "train", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def losses(log):
    return [float(x) for x in re.findall(r"Iteration \d+, loss = (\S+)", log)]


def weights(path):
    from cct.proto import caffe_pb2

    m = caffe_pb2.NetParameter()
    with open(path, "rb") as f:
        m.ParseFromString(f.read())
    return {layer.name: [np.array(b.data) for b in layer.blobs] for layer in m.layer if layer.blobs}


@pytest.mark.parametrize("body,layers", [(CONV_FC, {"conv1", "conv2", "ip"}), (CONVEX, {"conv1"})],
                         ids=["fc_tail", "data_parallel"])
def test_one_group_equals_synchronous_sgd(tmp_path, body, layers):
    from cct.solver import get_solver

    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    solver = get_solver(make_problem(ref_dir, body, 12, extra="snapshot_after_train: true\n"))
    solver.solve()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    r = mpirun(3, "--solver", make_problem(run_dir, body, 12, extra="snapshot_after_train: true\n"),
               "--groups", "sync")
    assert r.returncode == 0, r.stderr[-3000:]
    split = "FC tail ip..loss (inputs conv2, label)" if body is CONV_FC else "no FC tail"
    assert split in r.stderr and "g=1 groups of 2 conv ranks" in r.stderr
    assert re.search(r"Omnivore: ranks: 0=pid \d+@\S+, 1=pid \d+@\S+, 2=pid \d+@", r.stderr)
    a, b = weights(ref_dir / "out_iter_12.caffemodel"), weights(run_dir / "out_iter_12.caffemodel")
    assert a.keys() == b.keys() == layers
    for name in a:
        for x, y in zip(a[name], b[name]):
            np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-6)
    assert np.abs(a["conv1"][0]).max() > 0.05  # trained, not a trivial match


def test_async_groups_converge_on_a_convex_problem(tmp_path):
    r = mpirun(3, "--solver", make_problem(tmp_path, CONVEX, 60), "--groups", "async")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "no FC tail" in r.stderr and "g=2 groups of 1/1 conv ranks, explicit momentum 0.8" in r.stderr
    ls = losses(r.stderr)
    assert len(ls) == 60
    assert np.mean(ls[-10:]) < 0.5 * np.mean(ls[:5]), ls


def test_optimizer_on_ranks_logs_its_decisions(tmp_path):
    r = mpirun(3, "--solver", make_problem(tmp_path, CONV_FC, 80, lr=0.01), "--groups", "auto",
               "--omnivore_epoch", "40")
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"Omnivore: cold start: g=1 mu=0\.9 lr=\S+ \(trials: g=1 mu=0\.9 lr=1e-05: ", r.stderr)
    assert re.search(r"Omnivore: epoch 1: g=[12] mu=\S+ lr=\S+ \(trials: ", r.stderr)
    assert re.search(r"Omnivore: search took \d+\.\d% of the iterations", r.stderr)
    assert os.path.exists(tmp_path / "out_iter_80.caffemodel")


def test_a_failing_conv_rank_stops_the_job_naming_it(tmp_path):
    r = mpirun(3, "--solver", make_problem(tmp_path, CONVEX, 20, extra="snapshot: 10\n"), "--groups", "2",
               "--omnivore_fail_rank", "2")
    assert r.returncode != 0
    assert "Omnivore: rank 2 (conv compute) failed: injected failure at iteration" in r.stderr
    assert not glob.glob(str(tmp_path / "out_*")) and not glob.glob(str(tmp_path / ".tmp-*"))


def test_a_killed_conv_rank_ends_the_job_quickly_naming_it(tmp_path):
    """SIGKILL leaves no Python to report: mpiexec ends the job and names the process by PID, and rank 0's
    log maps every PID to its rank; nothing is half-written."""
    t = time.perf_counter()
    r = mpirun(3, "--solver", make_problem(tmp_path, CONVEX, 20, extra="snapshot: 10\n"), "--groups", "2",
               "--omnivore_fail_rank", "2", "--omnivore_fail_kill", timeout=60)
    assert r.returncode != 0 and time.perf_counter() - t < 45
    pids = dict(re.findall(r"(\d+)=pid (\d+)@", r.stderr))
    assert set(pids) == {"0", "1", "2"}, r.stderr[-2000:]
    named = set(re.findall(r"PID (\d+) ", r.stdout + r.stderr))
    assert named and named <= set(pids.values()), (named, pids)
    assert not glob.glob(str(tmp_path / ".tmp-*")) and not glob.glob(str(tmp_path / "*.tmp"))


def test_bad_group_count_is_a_clean_error(tmp_path):
    r = mpirun(3, "--solver", make_problem(tmp_path, CONVEX, 5), "--groups", "5")
    assert r.returncode != 0
    assert "--groups 5: with 2 conv ranks (mpiexec -n 3) g must be in 1..2" in r.stderr
