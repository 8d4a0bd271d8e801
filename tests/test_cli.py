"""``python -m cct`` end to end on tiny generated data: train, snapshot, resume, test, time, errors."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cct.cli import main

GPU_FALLBACK = ("solver_mode: GPU but no GPU is available (CuPy missing or no device visible); "
                "training on the CPU")

ROOT = Path(__file__).resolve().parents[1]
GLOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ [\w.]+:\d+\] ")

NET = """name: "TinyDigits"
layer { name: "mnist" type: "Data" top: "data" top: "label" include { phase: TRAIN }
  transform_param { scale: 0.00390625 mirror: true }
  data_param { source: "data/digits_train_lmdb" batch_size: 8 backend: LMDB } }
layer { name: "mnist" type: "Data" top: "data" top: "label" include { phase: TEST }
  transform_param { scale: 0.00390625 } data_param { source: "data/digits_test_lmdb" batch_size: 8 backend: LMDB } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "accuracy" type: "Accuracy" bottom: "ip" bottom: "label" top: "accuracy" include { phase: TEST } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""

SOLVER = """net: "net.prototxt"
test_iter: 2
test_interval: 5
base_lr: 0.01
momentum: 0.9
weight_decay: 0.0005
lr_policy: "inv"
gamma: 0.0001
power: 0.75
display: 2
max_iter: 10
snapshot: 5
snapshot_prefix: "snap/tiny"
solver_mode: CPU
random_seed: 1
"""

DUMMY_NET = """name: "Dummy"
layer { name: "data" type: "DummyData" top: "x" top: "y"
  dummy_data_param { shape { dim: 4 dim: 5 } shape { dim: 4 dim: 2 }
                     data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "out"
  inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "out" bottom: "y" top: "loss" }
"""


def cct(*args: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "cct", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("digits")
    # in this process (make_digits as a process: tests/test_models.py)
    assert main(["make_digits", str(base / "data"), "--train", "48", "--test", "24", "--seed", "3"]) == 0
    assert (base / "data" / "digits_train_lmdb").is_dir()
    return base


@pytest.fixture
def workdir(digits, tmp_path) -> Path:
    shutil.copytree(digits / "data", tmp_path / "data")
    (tmp_path / "net.prototxt").write_text(NET)
    (tmp_path / "solver.prototxt").write_text(SOLVER)
    return tmp_path


def _lines(stderr: str) -> list[str]:
    """Messages of the glog lines (prefix stripped)."""
    return [GLOG.sub("", l) for l in stderr.splitlines() if GLOG.match(l)]


def _main_here(args, cwd, monkeypatch, capfd) -> tuple[int, str]:
    """``cct ARGS`` in this process (``cct.cli.main``, what ``python -m cct`` runs) in ``cwd``: the exit
    status and what it wrote to stderr."""
    monkeypatch.chdir(cwd)
    capfd.readouterr()
    try:
        code = main(list(args))
    except SystemExit as e:  # what python -m cct's sys.exit(main()) exits with
        code = e.code
    return code, capfd.readouterr().err


def test_train_snapshot_resume_test_time(workdir, monkeypatch, capfd):
    """train and test as real processes; the resume and time in this process (``cct.cli.main``; ``cct time``
    as a process: tests/test_runtime.py)."""
    r = cct("train", "--solver=solver.prototxt", cwd=workdir)
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr  # no progress bar when stderr is not a TTY
    msgs = _lines(r.stderr)
    assert all(GLOG.match(l) for l in r.stderr.splitlines() if l.startswith("I1"))
    assert "Iteration 0, Testing net (#0)" in msgs and "Iteration 5, Testing net (#0)" in msgs
    assert "Iteration 10, Testing net (#0)" in msgs  # the final test after max_iter
    assert any(re.fullmatch(r"    Test net output #0: accuracy = [\d.e-]+", m) for m in msgs)
    assert any(re.fullmatch(r"    Test net output #1: loss = \S+ \(\* 1 = \S+ loss\)", m) for m in msgs)
    assert any(re.fullmatch(r"Iteration 2 \(\S+ iter/s, \S+s/2 iters\), loss = \S+", m) for m in msgs)
    assert any(re.fullmatch(r"    Train net output #0: loss = \S+ \(\* 1 = \S+ loss\)", m) for m in msgs)
    assert any(re.fullmatch(r"Iteration 4, lr = 0\.00999\d*", m) for m in msgs)
    assert "Snapshotting to binary proto file snap/tiny_iter_5.caffemodel" in msgs
    assert "Snapshotting solver state to binary proto file snap/tiny_iter_5.solverstate" in msgs
    assert "Optimization Done." in msgs
    for n in (5, 10):
        for ext in (".caffemodel", ".solverstate", ".cctstate"):
            assert (workdir / "snap" / f"tiny_iter_{n}{ext}").is_file()

    # resume from iteration 5 in a second directory: same weights at 10 as the straight run
    other = workdir / "resume"
    other.mkdir()
    shutil.copytree(workdir / "data", other / "data")
    for f in ("net.prototxt", "solver.prototxt"):
        shutil.copy(workdir / f, other / f)
    (other / "snap").mkdir()
    for ext in (".caffemodel", ".solverstate", ".cctstate"):
        shutil.copy(workdir / "snap" / f"tiny_iter_5{ext}", other / "snap" / f"tiny_iter_5{ext}")
    code, err = _main_here(["train", "-solver", "solver.prototxt", "-snapshot", "snap/tiny_iter_5.solverstate"],
                           other, monkeypatch, capfd)
    assert code == 0, err
    msgs2 = _lines(err)
    assert "Resuming from snap/tiny_iter_5.solverstate" in msgs2
    assert not any(m.startswith("Iteration 4,") for m in msgs2)
    assert (other / "snap" / "tiny_iter_10.caffemodel").is_file()
    a = (workdir / "snap" / "tiny_iter_10.caffemodel").read_bytes()
    b = (other / "snap" / "tiny_iter_10.caffemodel").read_bytes()
    assert a == b, "resumed run does not reproduce the straight run's weights"
    # and the final test (same weights, same test batches) reports the same numbers
    assert [m for m in msgs if "Test net output" in m][-2:] == [m for m in msgs2 if "Test net output" in m][-2:]

    # score the trained weights
    r3 = cct("test", "--model=net.prototxt", "--weights=snap/tiny_iter_10.caffemodel", "--iterations=3", cwd=workdir)
    assert r3.returncode == 0, r3.stderr
    m3 = _lines(r3.stderr)
    accs = [float(m.split(" = ")[1]) for m in m3 if re.fullmatch(r"Batch \d, accuracy = \S+", m)]
    assert len(accs) == 3 and len([m for m in m3 if re.fullmatch(r"Batch \d, loss = \S+", m)]) == 3
    mean_line = [m for m in m3 if m.startswith("accuracy = ")]
    assert len(mean_line) == 1 and float(mean_line[0].split(" = ")[1]) == pytest.approx(sum(accs) / 3, abs=1e-5)
    assert any(re.fullmatch(r"loss = \S+ \(\* 1 = \S+ loss\)", m) for m in m3)
    assert any(m.startswith("Loss: ") for m in m3)

    # time the net
    code, err = _main_here(["time", "-model", "net.prototxt", "-iterations", "2"], workdir, monkeypatch, capfd)
    assert code == 0, err
    m4 = _lines(err)
    for key in ("Average Forward pass: ", "Average Backward pass: ", "Average Forward-Backward: ", "Total Time: "):
        assert any(m.startswith(key) and m.endswith(" ms.") for m in m4), key
    assert any(re.fullmatch(r"\s*ip\tforward: \S+ ms\.", m) for m in m4)
    assert any(re.fullmatch(r"\s*ip\tbackward: \S+ ms\.", m) for m in m4)


def test_train_positional_iterations_and_weights(workdir, monkeypatch, capfd):
    """In this process: the positional solver, ``--iterations`` and a comma list of ``--weights``."""
    code, err = _main_here(["train", "solver.prototxt", "--iterations", "3"], workdir, monkeypatch, capfd)
    assert code == 0, err
    assert (workdir / "snap" / "tiny_iter_3.caffemodel").is_file()  # snapshot_after_train at the new max_iter
    code, err = _main_here(["train", "--solver", "solver.prototxt", "--iterations=1", "--weights",
                            "snap/tiny_iter_3.caffemodel,snap/tiny_iter_3.caffemodel"], workdir, monkeypatch, capfd)
    assert code == 0, err
    assert _lines(err).count("Finetuning from snap/tiny_iter_3.caffemodel") >= 2


@pytest.mark.parametrize("args,needle", [
    (["train", "--solver=missing.prototxt"], "missing.prototxt"),
    (["train"], "Need a solver definition"),
    (["train", "--solver=solver.prototxt", "--weights=a.caffemodel", "--snapshot=b.solverstate"], "not both"),
    (["train", "--solver=solver.prototxt", "--sigint_effect=explode"], 'Invalid signal effect "explode"'),
    (["train", "--solver=solver.prototxt", "--snapshot=nothere.solverstate"], "nothere.solverstate"),
    (["train", "--solver=bad.prototxt"], "bad.prototxt:2:"),
    (["train", "--solver=solver.prototxt", "--bogus=1"], "unrecognized arguments"),
    (["test", "--model=net.prototxt"], "Need model weights"),
    (["test", "--model=net.prototxt", "--weights=none.caffemodel"], "none.caffemodel"),
    (["time"], "Need a model definition"),
    (["frobnicate"], "unknown command 'frobnicate'"),
])
def test_bad_input_exits_nonzero_with_message(workdir, args, needle, monkeypatch, capfd):
    """In this process (``cct.cli.main``, what ``python -m cct`` runs; one process end to end below)."""
    (workdir / "bad.prototxt").write_text('net: "net.prototxt"\nbase_lr: oops\n')
    monkeypatch.chdir(workdir)
    try:
        code = main(args)
    except SystemExit as e:  # what python -m cct's sys.exit(main()) exits with
        code = e.code
    stderr = capfd.readouterr().err
    assert code not in (0, None)
    assert needle in stderr
    assert "Traceback" not in stderr


def test_bad_input_exits_nonzero_with_message_as_a_process(workdir):
    r = cct("train", "--solver=solver.prototxt", "--bogus=1", cwd=workdir)
    assert r.returncode != 0
    assert "unrecognized arguments" in r.stderr
    assert "Traceback" not in r.stderr


def test_gpu_flag_without_gpu_is_an_error(workdir, monkeypatch, capfd):
    from cct.device.driver import cupy_available

    if cupy_available():
        pytest.skip("a GPU is present")
    monkeypatch.chdir(workdir)  # the error in this process (cct.cli.main); the fallback run below is a process
    assert main(["train", "--solver=solver.prototxt", "--gpu=0"]) == 1
    err = capfd.readouterr().err
    assert "Traceback" not in err
    assert "no GPU is available" in err or "CuPy is not installed" in err
    # solver_mode GPU in the file falls back to the CPU with a log line
    (workdir / "gpu_solver.prototxt").write_text(SOLVER.replace("solver_mode: CPU", "solver_mode: GPU")
                                                 .replace("max_iter: 10", "max_iter: 1"))
    r = cct("train", "--solver=gpu_solver.prototxt", cwd=workdir)
    assert r.returncode == 0, r.stderr
    assert GPU_FALLBACK in _lines(r.stderr)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the loss overflowing is the case
def test_nan_loss_exits_nonzero_naming_iteration(tmp_path, monkeypatch, capfd):
    """In this process (the exit status and message ``python -m cct`` gives: the bad-input tests above)."""
    (tmp_path / "net.prototxt").write_text(DUMMY_NET)
    (tmp_path / "solver.prototxt").write_text('net: "net.prototxt" base_lr: 1e18 momentum: 0.9 lr_policy: "fixed" '
                                              'max_iter: 100 display: 1 solver_mode: CPU random_seed: 2 '
                                              'snapshot_prefix: "out/d"\n')
    code, err = _main_here(["train", "--solver=solver.prototxt"], tmp_path, monkeypatch, capfd)
    assert code == 1
    m = re.search(r"error: Iteration (\d+): loss is (\S+)", err)
    assert m and m.group(2) in ("inf", "nan"), err
    assert (tmp_path / "out" / f"d_iter_{m.group(1)}.caffemodel").is_file()
    assert "Traceback" not in err


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="POSIX signals")
def test_sighup_snapshots_and_sigint_stops(tmp_path):
    (tmp_path / "net.prototxt").write_text(DUMMY_NET)
    (tmp_path / "solver.prototxt").write_text('net: "net.prototxt" base_lr: 0.001 lr_policy: "fixed" '
                                              'max_iter: 100000000 display: 1000 solver_mode: CPU '
                                              'snapshot_prefix: "out/s"\n')
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "cct", "train", "--solver=solver.prototxt"], cwd=tmp_path, env=env,
                            stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        deadline = time.time() + 30
        for line in proc.stderr:
            lines.append(line)
            if "Starting Optimization" in line or time.time() > deadline:
                break
        time.sleep(0.3)
        proc.send_signal(signal.SIGHUP)
        t0 = time.time()
        while not list((tmp_path / "out").glob("*.solverstate")) and time.time() - t0 < 20:
            time.sleep(0.05)
        assert list((tmp_path / "out").glob("*.solverstate")), "SIGHUP did not snapshot"
        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read()
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, rest
    assert "Optimization stopped early." in rest
    assert len(list((tmp_path / "out").glob("s_iter_*.caffemodel"))) == 2  # SIGHUP + stop's snapshot


def test_device_query_and_help(tmp_path):
    """device_query as a real process (--help and no command: test_help_and_no_command, in this process)."""
    r = cct("device_query", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "BLAS backend:" in r.stdout and "CPU cores:" in r.stdout


def test_help_and_no_command(capsys):
    """In this process (``cct.cli.main``, what ``python -m cct`` runs)."""
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "train" in out and "make_digits" in out
    assert main([]) == 1 and "usage: cct" in capsys.readouterr().err
