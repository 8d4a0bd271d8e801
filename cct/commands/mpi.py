"""The job a command runs in: its MPI communicator when started by ``mpiexec`` with several ranks."""
from __future__ import annotations

from ..distributed import world
from ..distributed.launch import under_mpi


def mpi_world():
    """The job's communicator when started by mpiexec with more than one rank, else None (mpi4py is
    then not imported)."""
    if not under_mpi():
        return None

    comm = world()
    return comm if comm.size > 1 else None
