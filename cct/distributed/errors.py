"""The error a distributed run raises (a :class:`cct.errors.CctError`)."""
from __future__ import annotations

from ..errors import CctError


class DistributedError(CctError):
    """An MPI job cannot go on: mismatched ranks, a failed collective, MPI missing, a rank that failed."""
