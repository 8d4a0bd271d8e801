"""Start MPI jobs from the tests: ``mpiexec -n N python ...`` on loopback, with a time limit."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cct.distributed.launch import mpiexec_path

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPTS = os.path.join(HERE, "mpi_scripts")


def mpiexec() -> str | None:
    """The mpiexec beside this Python (the MPICH wheel's), else one on PATH."""
    return mpiexec_path()


def needs_mpi():
    """Skip unless mpi4py and an mpiexec are installed (``pip install 'cct[mpi]'``)."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return pytest.mark.skip(reason="mpi4py not installed (pip install 'cct[mpi]')")
    if mpiexec() is None:
        return pytest.mark.skip(reason="no mpiexec (pip install 'cct[mpi]')")
    return pytest.mark.skipif(False, reason="")


def run_mpi(n: int, args: list[str], cwd: str | None = None, timeout: float = 60,
            env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """``mpiexec -n n <args>`` (args[0] 'python' means this interpreter); returns the finished process."""
    if args and args[0] == "python":
        args = [sys.executable] + args[1:]
    e = dict(os.environ)
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("OMP_NUM_THREADS", "1")
    e.setdefault("OPENBLAS_NUM_THREADS", "1")
    e.setdefault("MKL_NUM_THREADS", "1")
    if env:
        e.update(env)
    cmd = [mpiexec(), "-n", str(n)] + list(args)
    p = subprocess.run(cmd, cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}\nstdout:\n{p.stdout[-4000:]}\n"
                             f"stderr:\n{p.stderr[-4000:]}")
    return p


def script(name: str) -> str:
    return os.path.join(SCRIPTS, name)


#: the line train_run.py's rank 0 writes to stderr before each of the runs of one launch (``++``-separated)
RUN_MARK = "=== train_run.py run"


def run_logs(stderr: str) -> list[str]:
    """The stderr of a train_run.py launch cut into its runs (what came before the first run dropped)."""
    return [part.split("\n", 1)[1] if "\n" in part else "" for part in stderr.split(RUN_MARK)[1:]]
