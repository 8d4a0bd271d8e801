"""The training loop's runtime: solver phase timers, idle-thread spin settings."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from cct.blas.spin import DEFAULT_OMP_SPINCOUNT, set_openmp_spin_defaults
from cct.solver import get_solver
from cct.solver.timing import PHASES, PhaseTimer
from cct.tools.convert_mnist import write_images_db

NET = """
name: "tiny"
layer {{ name: "data" type: "Data" top: "data" top: "label" include {{ phase: TRAIN }}
  data_param {{ source: "{train}" batch_size: 8 backend: LMDB }} transform_param {{ scale: 0.00390625 }} }}
layer {{ name: "data" type: "Data" top: "data" top: "label" include {{ phase: TEST }}
  data_param {{ source: "{test}" batch_size: 10 backend: LMDB }} transform_param {{ scale: 0.00390625 }} }}
layer {{ name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param {{ num_output: 4 kernel_size: 3 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "relu" type: "ReLU" bottom: "conv" top: "conv" }}
layer {{ name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
  inner_product_param {{ num_output: 3 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}
"""

SOLVER = """
net: "{net}"
test_iter: 2
test_interval: 4
base_lr: 0.05
momentum: 0.9
weight_decay: 0.0005
lr_policy: "fixed"
display: 2
max_iter: 8
snapshot: 4
snapshot_prefix: "{prefix}"
random_seed: 3
solver_mode: CPU
"""


def _digits(path, n, seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, n)
    images = (rng.random((n, 8, 8)) * 60 + labels[:, None, None] * 60).astype(np.uint8)
    write_images_db(str(path), images, labels)


@pytest.fixture
def solver_file(tmp_path):
    _digits(tmp_path / "train_lmdb", 40, 1)
    _digits(tmp_path / "test_lmdb", 20, 2)
    net = tmp_path / "net.prototxt"
    net.write_text(NET.format(train=tmp_path / "train_lmdb", test=tmp_path / "test_lmdb"))
    solver = tmp_path / "solver.prototxt"
    solver.write_text(SOLVER.format(net=net, prefix=tmp_path / "snap" / "tiny"))
    return solver


class FakeClock:
    """A clock that advances by a fixed step at every reading."""

    def __init__(self, step: float):
        self.t, self.step = 0.0, step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


def test_phase_timer_books_phases_and_the_rest_as_other():
    clock = FakeClock(0.5)
    timer = PhaseTimer(clock=clock)
    for _ in range(2):
        timer.start_iteration()               # t = 0.5
        timer.split_forward(3.0, 1.0)         # data 1, forward 2
        timer.add("backward", 4.0)
        with timer.phase("update"):           # reads 1.0, 1.5: 0.5 s
            pass
        timer.end_iteration()                 # reads 2.0: 1.5 s elapsed, 7.5 claimed -> other 0
    s = timer.summary()
    assert s["iterations"] == 2
    assert s["phases"]["data"]["total_s"] == 2.0
    assert s["phases"]["forward"]["mean_ms"] == 2000.0
    assert s["phases"]["backward"]["median_ms"] == 4000.0
    assert s["phases"]["update"]["total_s"] == 1.0
    assert s["phases"]["other"]["total_s"] == 0.0
    assert s["total_s"] == 15.0
    assert abs(sum(p["share"] for p in s["phases"].values()) - 1.0) < 1e-12
    # the gap nobody claimed is "other"
    timer = PhaseTimer(clock=FakeClock(1.0))
    timer.start_iteration()
    timer.add("forward", 0.25)
    timer.end_iteration()
    assert timer.summary()["phases"]["other"]["total_s"] == 0.75
    with pytest.raises(KeyError, match="unknown phase 'load'"):
        timer.add("load", 1.0)
    assert len(timer.table()) == 1 + len(PHASES)


def test_split_forward_clamps_data_time():
    timer = PhaseTimer(clock=FakeClock(0.0))
    timer.split_forward(1.0, 2.0)
    timer.split_forward(1.0, -1.0)
    assert timer.totals["data"] == 1.0 and timer.totals["forward"] == 1.0


def test_solver_phase_times_cover_the_loop_and_change_nothing(solver_file, caplog):
    plain = get_solver(str(solver_file))
    plain.solve()
    w_plain = [p.data.copy() for p in plain.net.learnable_params]
    plain.net.close()
    for n in plain.test_nets:
        n.close()
    timed = get_solver(str(solver_file), phase_times=True)
    with caplog.at_level(logging.INFO, logger="cct"):
        timed.solve()
    for a, b in zip(w_plain, timed.net.learnable_params):
        np.testing.assert_array_equal(a, b.data)  # timing does not change one bit
    s = timed.phase_timer.summary()
    assert s["iterations"] == 8
    ph = s["phases"]
    for name in ("data", "forward", "backward", "update", "test", "snapshot"):
        assert ph[name]["total_s"] > 0, name
    # tests at iterations 0 and 4 (in the loop) and 8 (after it); snapshots after iterations 4 and 8
    per_iter = timed.phase_timer.per_iteration
    assert [it["test"] > 0 for it in per_iter] == [i in (0, 4) for i in range(8)]
    assert [it["snapshot"] > 0 for it in per_iter] == [i in (3, 7) for i in range(8)]
    assert ph["data"]["total_s"] <= timed.net.layers[0].forward_seconds + 1e-9
    assert s["wall_s"] >= sum(sum(it.values()) for it in per_iter) - 1e-6
    assert any("Phase times over 8 iterations" in r.getMessage() for r in caplog.records)
    assert any(r.getMessage().strip().startswith("update:") for r in caplog.records)
    timed.net.close()
    for n in timed.test_nets:
        n.close()


def test_cct_train_phase_times_flag(solver_file, tmp_path):
    env = dict(os.environ, CCT_CALIBRATE="0")
    out = subprocess.run([sys.executable, "-m", "cct", "train", str(solver_file), "--phase_times",
                          "--iterations", "3"], capture_output=True, text=True, cwd=tmp_path, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Phase times over 3 iterations" in out.stderr
    for name in PHASES:
        assert f"{name}:" in out.stderr


def test_openmp_spin_defaults():
    env: dict[str, str] = {}
    assert set_openmp_spin_defaults(env) == {"GOMP_SPINCOUNT": str(DEFAULT_OMP_SPINCOUNT), "KMP_BLOCKTIME": "0"}
    assert env == {"GOMP_SPINCOUNT": str(DEFAULT_OMP_SPINCOUNT), "KMP_BLOCKTIME": "0"}
    env = {"CCT_OMP_SPINCOUNT": "50"}
    set_openmp_spin_defaults(env)
    assert env["GOMP_SPINCOUNT"] == "50"
    env = {"OMP_WAIT_POLICY": "active", "KMP_BLOCKTIME": "200"}  # the user's settings win
    assert set_openmp_spin_defaults(env) == {}
    assert "GOMP_SPINCOUNT" not in env and env["KMP_BLOCKTIME"] == "200"
    env = {"CCT_OMP_SPINCOUNT": "off"}
    assert set_openmp_spin_defaults(env) == {} and env == {"CCT_OMP_SPINCOUNT": "off"}


def test_import_sets_the_spin_defaults_before_the_runtimes_load():
    code = ("import os, cct\n"
            "print(os.environ['GOMP_SPINCOUNT'], os.environ['KMP_BLOCKTIME'])\n"
            "print(any('libgomp' in line or 'libiomp' in line for line in open('/proc/self/maps')))\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_WAIT_POLICY", "CCT_OMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(DEFAULT_OMP_SPINCOUNT), "0", "False"]


def test_openblas_spin_limit_applies_beside_a_data_thread():
    """A data layer's prefetch thread (never a GEMM) must not keep the spin limit from applying."""
    code = (
        "import threading, numpy as np\n"
        "from cct import blas\n"
        "from cct.blas import openblas\n"
        "from cct.data.prefetch import Prefetcher\n"
        "p = Prefetcher(lambda buf: np.zeros(3), depth=1, name='cct-data-mnist')\n"
        "p.get()\n"
        "assert p.thread_alive\n"
        "lib = openblas.numpy_openblas_cdll()\n"
        "print('applied' if blas.limit_openblas_spin() else ('nolib' if lib is None else 'refused'))\n"
        "p.close()\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_THREAD_TIMEOUT", "CCT_BLAS_THREAD_TIMEOUT")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ("applied", "nolib"), out.stdout


@pytest.mark.parametrize("shape", [(3, 4, 5), (64, 500, 10), (64, 800, 30)])  # tiny, small (1 thread), larger
@pytest.mark.parametrize("trans_a,trans_b,alpha,beta", [(False, True, 1.0, 0.0), (True, False, 0.5, 1.0),
                                                        (False, False, 2.0, 0.5)])
def test_small_gemms_on_mkl_match_float64(shape, trans_a, trans_b, alpha, beta):
    from cct import blas

    if not blas.mkl_available():
        pytest.skip("MKL not installed")
    m, k, n = shape
    rng = np.random.default_rng(0)
    a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
    out = rng.standard_normal((m, n)).astype(np.float32)
    opa = (a.T if trans_a else a).astype(np.float64)
    opb = (b.T if trans_b else b).astype(np.float64)
    ref = alpha * opa @ opb + beta * out.astype(np.float64)
    got = blas.gemm(a, b, out=out, trans_a=trans_a, trans_b=trans_b, alpha=alpha, beta=beta, backend="mkl")
    assert got is out
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-4 * np.sqrt(k))


def test_cct_time_reports_inner_product_vs_bare_gemm(tmp_path):
    from cct.net import Net
    from cct.net.overhead import gemm_overhead

    proto = tmp_path / "ip.prototxt"
    proto.write_text('''
        layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 64 dim: 800 } } }
        layer { name: "ip1" type: "InnerProduct" bottom: "x" top: "y"
          inner_product_param { num_output: 500 weight_filler { type: "gaussian" std: 0.01 } } }''')
    net = Net(str(proto), 1)
    samples = [[0.002, 0.001, 0.003], [0.004, 0.002, 0.006]]
    rows = gemm_overhead(net, samples, repeats=3)
    assert len(rows) == 1
    r = rows[0]
    assert (r["layer"], r["M"], r["K"], r["N"]) == ("ip1", 64, 800, 500)
    assert r["in_net_s"] == 0.004 and r["bare_numpy_s"] > 0 and r["bare_backend_s"] > 0
    assert r["ratio"] == pytest.approx(0.004 / r["bare_numpy_s"])
    out = subprocess.run([sys.executable, "-m", "cct", "time", "--model", str(proto), "--iterations", "3"],
                         capture_output=True, text=True, env=dict(os.environ, CCT_CALIBRATE="0"), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ip1\tforward (median)" in out.stderr and "vs bare GEMM 64x800x500: numpy.matmul" in out.stderr


def test_small_kernel_calls_run_serially_and_restore_the_thread_count():
    from cct import kernels

    if not kernels.numba_available():
        pytest.skip("numba not installed")
    seen = []
    before = kernels.get_num_threads()
    kernels.launch(lambda piece, pieces, a: seen.append((pieces, a)), 7, work=10)
    assert seen == [(1, 7)] and kernels.get_num_threads() == before
    with pytest.raises(ZeroDivisionError):
        kernels.launch(lambda piece, pieces: 1 / 0, work=1)
    assert kernels.get_num_threads() == before
    # the serial and the threaded runs of a kernel give the same bits (the update of a bias and of a weight)
    ku = kernels.get("update")
    rng = np.random.default_rng(0)
    for n in (500, kernels.SMALL_WORK + 3):
        w, g, h = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
        ref_w, ref_g, ref_h = w.copy(), g.copy(), h.copy()
        ref_g += np.float32(5e-4) * ref_w
        ref_h = ref_h * np.float32(0.9) + np.float32(0.01) * ref_g
        ku.sgd_l2(w, g, h, 5e-4, 0.01, 0.9)
        np.testing.assert_array_equal(h, ref_h)
        np.testing.assert_array_equal(g, ref_h)
