"""The job a command runs in: its MPI communicator when started by ``mpiexec`` with several ranks."""
from __future__ import annotations


def mpi_world():
    """The job's communicator when started by mpiexec with more than one rank, else None (mpi4py is
    then not imported)."""
    from ..distributed.launch import under_mpi

    if not under_mpi():
        return None
    from ..distributed import world

    comm = world()
    return comm if comm.size > 1 else None
