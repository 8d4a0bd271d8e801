"""Repository hygiene: no committed run artifacts, no machine paths, shared/ found from the repo root,
and the temp files of a snapshot killed mid-write are removed by the next run."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cct.io.atomic import atomic_write, atomic_write_bytes, remove_stale_temps
from cct.paths import repo_root, shared_dir, shared_path

ROOT = Path(__file__).resolve().parents[1]


def _tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return out.splitlines()


def test_no_run_artifacts_committed():
    artifacts = [f for f in _tracked_files()
                 if Path(f).suffix in (".caffemodel", ".solverstate", ".cctstate") and "_iter_" in f]
    assert artifacts == []


def test_gitignore_covers_snapshot_artifacts():
    ignored = subprocess.run(["git", "check-ignore", "_iter_0.caffemodel", "_iter_0.solverstate",
                              "_iter_0.cctstate", "x_iter_12.solverstate.h5"],
                             cwd=ROOT, capture_output=True, text=True)
    if ignored.returncode == 128:
        pytest.skip("not a git checkout")
    assert len(ignored.stdout.split()) == 4


def test_no_absolute_machine_paths():
    needles = ("/work/", "/home/", "/Users/", "/root/")
    offenders = []
    for f in _tracked_files():
        if Path(f).suffix not in (".py", ".md", ".toml", ".cfg", ".txt", ".prototxt", ".sh", ".yml", ".yaml"):
            continue
        if f.startswith("tests/data/"):  # fixtures in upstream formats keep their original paths
            continue
        text = (ROOT / f).read_text(encoding="utf-8", errors="replace")
        offenders += [f"{f}: {n}" for n in needles if n in text and f != "tests/test_hygiene.py"]
    assert offenders == []


def test_shared_dir_from_repo_root_and_env(monkeypatch, tmp_path):
    monkeypatch.delenv("CCT_SHARED_DIR", raising=False)
    assert repo_root() == ROOT
    assert shared_dir() == ROOT.parent / "shared"
    monkeypatch.setenv("CCT_SHARED_DIR", str(tmp_path))
    assert shared_dir() == tmp_path
    assert shared_path("reference", "README.md") == tmp_path / "reference" / "README.md"


KILLED_WRITER = textwrap.dedent("""
    import sys, time
    from cct.io.atomic import atomic_write
    def write(tmp):
        with open(tmp, "wb") as f:
            f.write(b"partial")
            f.flush()
            print(tmp, flush=True)
            time.sleep(60)
    atomic_write(sys.argv[1], write)
""")


def _killed_mid_write(target: Path) -> Path:
    """Run a real writer process, SIGKILL it while it writes ``target``; return its temp file."""
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(target)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    tmp = Path(proc.stdout.readline().strip())
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()
    assert tmp.exists() and tmp.name.startswith(".tmp-" + target.name) and not target.exists()
    return tmp


def test_next_write_removes_temp_of_killed_writer(tmp_path):
    target = tmp_path / "net_iter_5.caffemodel"
    left = _killed_mid_write(target)
    other = tmp_path / "unrelated.txt"
    atomic_write_bytes(other, b"x")
    assert left.exists()  # another target: not touched
    atomic_write_bytes(target, b"whole")
    assert target.read_bytes() == b"whole"
    assert not left.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []


def test_live_writer_temp_is_kept(tmp_path):
    target = tmp_path / "a.bin"
    seen = []

    def write(tmp: str) -> None:
        Path(tmp).write_bytes(b"1")
        seen.append(remove_stale_temps(tmp_path, "a.bin"))  # our own temp: writer alive
        assert Path(tmp).exists()

    atomic_write(target, write)
    assert seen == [[]] and target.read_bytes() == b"1"
    # a pid-less name (older cct) is stale only once old
    old = tmp_path / ".tmp-a.bin.k3j2h1"
    old.write_bytes(b"")
    assert remove_stale_temps(tmp_path, "a.bin") == []
    past = time.time() - 7200
    os.utime(old, (past, past))
    assert remove_stale_temps(tmp_path, "a.bin") == [str(old)]


def test_solver_start_removes_stale_snapshot_temps(tmp_path, caplog):
    import logging

    from cct.solver import get_solver

    prefix = tmp_path / "snaps" / "lenet"
    prefix.parent.mkdir()
    left = _killed_mid_write(Path(f"{prefix}_iter_100.caffemodel"))
    net = tmp_path / "net.prototxt"
    net.write_text('layer { name: "d" type: "DummyData" top: "x" dummy_data_param { shape { dim: 2 dim: 3 } } }\n'
                   'layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" '
                   'inner_product_param { num_output: 2 } }\n'
                   'layer { name: "l" type: "Reduction" bottom: "y" top: "loss" loss_weight: 1 }\n')
    solver = tmp_path / "solver.prototxt"
    solver.write_text(f'net: "{net}" base_lr: 0.1 lr_policy: "fixed" max_iter: 1 snapshot: 1 '
                      f'snapshot_prefix: "{prefix}" solver_mode: CPU\n')
    with caplog.at_level(logging.INFO, logger="cct"):
        get_solver(str(solver))
    assert not left.exists()
    assert any("half-written" in r.getMessage() for r in caplog.records)
