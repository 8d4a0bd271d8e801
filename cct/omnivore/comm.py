"""The few MPI calls Omnivore's executor makes, over mpi4py, behind one small class.

Waiting is polled (``Iprobe``/``Test`` with a short sleep) rather than blocking: MPICH's blocking calls
spin, and when several ranks share a core (this project's 2-core machine runs 3-8 ranks) spinning
ranks would take the core from the ranks doing the work. Objects travel pickled (numpy arrays as
pickle-5 buffers); the messages are a few conv layers' weights or activations.
"""
from __future__ import annotations

import time
from typing import Any

from ..errors import CctError


class CommError(CctError):
    """An MPI peer failed or is unreachable; the message names the rank."""


def mpi_world():
    """COMM_WORLD of mpi4py, or a :class:`CctError` saying how to get it."""
    try:
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - mpi4py is a dependency
        raise CctError(f"Omnivore needs mpi4py ({e}); pip install mpi4py") from None
    return MPI.COMM_WORLD


class Comm:
    """Point-to-point messaging on an MPI communicator with polled waits.

    ``rank``/``size``; ``send(obj, dest, tag)``; ``recv(source=ANY, tag=ANY) -> (obj, source, tag)``;
    ``split(color)`` gives the :class:`Comm` of a sub-communicator (``None`` for ``color=None``);
    ``abort(code)`` ends the whole job.
    """

    def __init__(self, mpi_comm=None, poll_s: float = 2e-5):
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = mpi_comm if mpi_comm is not None else mpi_world().Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.poll_s = poll_s
        self.ANY_SOURCE = MPI.ANY_SOURCE
        self.ANY_TAG = MPI.ANY_TAG

    def _wait(self, req) -> Any:
        delay = self.poll_s
        while True:
            done, value = req.test()
            if done:
                return value
            time.sleep(delay)
            delay = min(delay * 2, 2e-4)

    def send(self, obj: Any, dest: int, tag: int) -> None:
        """Send ``obj`` to ``dest`` (returns when the buffer can be reused)."""
        self._wait(self.comm.isend(obj, dest=dest, tag=tag))

    def recv(self, source: int | None = None, tag: int | None = None) -> tuple[Any, int, int]:
        """Wait for a message; returns (object, source rank, tag)."""
        source = self.ANY_SOURCE if source is None else source
        tag = self.ANY_TAG if tag is None else tag
        status = self._MPI.Status()
        delay = self.poll_s
        while not self.comm.Iprobe(source=source, tag=tag, status=status):
            time.sleep(delay)
            delay = min(delay * 2, 2e-4)
        src, tg = status.Get_source(), status.Get_tag()
        return self.comm.recv(source=src, tag=tg), src, tg

    def split(self, color: int | None, key: int = 0) -> Comm | None:
        sub = self.comm.Split(self._MPI.UNDEFINED if color is None else color, key)
        if sub == self._MPI.COMM_NULL:
            return None
        return Comm(sub, self.poll_s)

    def free(self) -> None:
        """Release the communicator (collective over its ranks)."""
        self.comm.Free()

    def abort(self, code: int = 1) -> None:
        """End every rank of the job now (MPI_Abort)."""
        self.comm.Abort(code)
