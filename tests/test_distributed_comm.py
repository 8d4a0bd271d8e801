"""cct.distributed's communication layer: every operation under mpiexec (MPICH on loopback), and the
one-process LocalComm that code runs on without mpiexec."""
import re

import numpy as np
import pytest
from mpirun import needs_mpi, run_mpi, script

from cct.distributed import DistributedError, LocalComm, launcher_rank_size, under_mpi, world


def test_launcher_detection_reads_the_environment_only():
    assert launcher_rank_size({}) is None and not under_mpi({})
    assert launcher_rank_size({"PMI_RANK": "1", "PMI_SIZE": "3"}) == (1, 3)
    assert launcher_rank_size({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4"}) == (2, 4)
    assert launcher_rank_size({"PMI_RANK": "x", "PMI_SIZE": "3"}) is None


def test_world_without_mpiexec_is_local_and_does_not_import_mpi4py():
    import subprocess
    import sys

    code = ("import sys; from cct.distributed import world, LocalComm; c = world(); "
            "assert isinstance(c, LocalComm) and c.size == 1 and c.is_root; "
            "import cct.solver, cct.cli; assert 'mpi4py' not in sys.modules; print('ok')")
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("PMI_", "OMPI_", "MPI_"))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_local_comm_collectives_and_messages():
    c = LocalComm()
    a = np.arange(4, dtype=np.float32)
    assert np.array_equal(c.allreduce(a), a) and c.allreduce(a) is not a
    assert np.array_equal(c.iallreduce(a, op="max").wait(), a)
    assert c.bcast_obj(5) == 5 and c.gather_obj(1) == [1] and c.allgather_obj(2) == [2]
    c.send(a, dest=0, tag=4)
    req = c.irecv(np.empty(4, np.float32), source=0, tag=4)
    assert np.array_equal(req.wait(), a)
    c.send_obj({"k": 1}, dest=0)
    assert c.recv_obj() == {"k": 1}
    assert c.split(3).size == 1 and c.split(None) is None
    c.send_obj("a", dest=0, tag=7)
    assert c.recv_any() == ("a", 0, 7)
    with pytest.raises(DistributedError, match="rank 1 does not exist"):
        c.send(a, dest=1)
    with pytest.raises(DistributedError, match="wait forever"):
        c.recv(np.empty(4))
    with pytest.raises(DistributedError, match="unknown reduction"):
        c.allreduce(a, op="avg")
    c.agree("x", "the nets")
    assert world().size == 1
    assert np.array_equal(c.allgather(a, np.empty((1, 4), np.float32))[0], a)
    assert np.array_equal(c.alltoall(a.reshape(1, 4), np.empty((1, 4), np.float32)), a.reshape(1, 4))
    assert np.array_equal(c.reduce_scatter(a.reshape(1, 4), np.empty(4, np.float32)), a)


@needs_mpi()
@pytest.mark.parametrize("n", [2, 3])
def test_every_comm_operation_under_mpiexec(n):
    p = run_mpi(n, ["python", script("comm_check.py")], timeout=60)
    assert sorted(re.findall(r"rank \d+ of \d+: ok", p.stdout)) == [f"rank {r} of {n}: ok" for r in range(n)]
