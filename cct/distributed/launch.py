"""Is this process one rank of an MPI job? Decided from the launcher's environment only.

``mpiexec`` (MPICH's Hydra, Open MPI, Intel MPI, Slurm's PMI) sets a rank/size variable in every
process it starts; a plain ``python``/``cct`` run has none, and then :mod:`mpi4py` is never
imported (importing it initialises MPI, which a single-process user should not pay for or see).
"""
from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping

#: (rank variable, size variable) pairs of the launchers cct knows, most specific first.
LAUNCHER_VARIABLES = (
    ("PMI_RANK", "PMI_SIZE"),                          # MPICH Hydra, Intel MPI
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),  # Open MPI
    ("PMIX_RANK", "OMPI_COMM_WORLD_SIZE"),             # PMIx launchers
    ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),            # MPICH, single host
)


def launcher_rank_size(environ: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """``(rank, size)`` the MPI launcher announced in the environment, or None outside ``mpiexec``."""
    env = os.environ if environ is None else environ
    for rank_var, size_var in LAUNCHER_VARIABLES:
        if rank_var in env and size_var in env:
            try:
                return int(env[rank_var]), int(env[size_var])
            except ValueError:
                continue
    return None


def under_mpi(environ: Mapping[str, str] | None = None) -> bool:
    """True when this process was started by an MPI launcher (``mpiexec -n N ...``), whatever N."""
    return launcher_rank_size(environ) is not None


def mpiexec_path() -> str | None:
    """The ``mpiexec`` to start jobs with: the one beside this Python (the MPICH wheel's), else one on
    PATH, else None."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.path.exists(beside) else shutil.which("mpiexec")
