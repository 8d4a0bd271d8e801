"""The communication layer of cct's distributed training: one small API over MPI (mpi4py).

Everything distributed in cct (synchronous data parallelism, Omnivore's compute groups) talks
through a :class:`Comm`: a group of ``size`` processes, this one being ``rank`` (0 = the root).
Two implementations:

* :class:`MPIComm` wraps an :mod:`mpi4py` communicator (``world()`` under ``mpiexec``, or one a
  caller built and passed in with :func:`from_mpi4py`);
* :class:`LocalComm` is the one-process group (``size == 1``): every collective is a copy, and
  point-to-point messages to rank 0 are delivered to itself. Code written against ``Comm`` runs
  unchanged without ``mpiexec`` and without mpi4py installed.

Arrays are host (numpy) arrays, C-contiguous, of the same dtype and shape on every rank
(``float32``/``float64``/integer types map to the MPI type of the same size). Objects (``*_obj``)
are pickled. Every MPI failure is raised as :class:`~cct.distributed.errors.DistributedError`
naming the rank and the operation.

Example (run with ``mpiexec -n 2 python example.py``)::

    import numpy as np
    from cct.distributed import world

    comm = world()
    grad = np.full(4, comm.rank + 1.0, np.float32)
    comm.allreduce(grad, out=grad)                 # in place: [3, 3, 3, 3] on both ranks
    req = comm.iallreduce(grad)                    # non-blocking; req.wait() -> the sum
    if comm.rank == 0:
        comm.send(np.arange(3.0), dest=1, tag=7)
    else:
        x = comm.recv(np.empty(3), source=0, tag=7)
    pair = comm.split(color=comm.rank % 2)         # sub-communicators (compute groups)
"""
from __future__ import annotations

import pickle
import time
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

from .errors import DistributedError
from .launch import under_mpi

#: Reduction names accepted by the collectives.
OPS = ("sum", "max", "min", "prod")
ANY_SOURCE = -1
ANY_TAG = -1
ABORT_GRACE_S = 0.3  # see MPIComm.abort


def as_message(array: np.ndarray, what: str) -> np.ndarray:
    """``array`` itself when it is a C-contiguous host array (what a message buffer must be); else a clean error."""
    if not isinstance(array, np.ndarray):
        raise DistributedError(f"{what}: expected a numpy array, got {type(array).__name__} "
                               "(copy device arrays to the host first)")
    if not array.flags.c_contiguous:
        raise DistributedError(f"{what}: the array must be C-contiguous")
    return array


def check_op(op: str) -> str:
    """``op`` when it names a reduction cct's communicators know; else a clean error."""
    if op not in OPS:
        raise DistributedError(f"unknown reduction '{op}' (use one of {', '.join(OPS)})")
    return op


class Request:
    """A pending non-blocking operation. ``wait()`` blocks until it is done and returns its result
    (the output array of an all-reduce or receive, None for a send); ``test()`` says whether it is
    done without blocking (and drives MPI's progress)."""

    def __init__(self, handle: Any = None, result: Any = None, on_done: Callable[[], Any] | None = None,
                 what: str = "request", rank: int = 0):
        self._handle = handle
        self._result = result
        self._on_done = on_done
        self._done = handle is None and on_done is None
        self._what = what
        self._rank = rank

    def _finish(self) -> Any:
        if not self._done:
            self._done = True
            if self._on_done is not None:
                out = self._on_done()
                if out is not None:
                    self._result = out
        return self._result

    def wait(self) -> Any:
        """Block until done; returns the result."""
        if not self._done and self._handle is not None:
            try:
                self._handle.Wait()
            except Exception as e:  # mpi4py raises MPI.Exception
                raise DistributedError(f"rank {self._rank}: {self._what} failed: {e}") from None
        return self._finish()

    def test(self) -> bool:
        """True when done (the result is then ready for ``wait()`` without blocking)."""
        if self._done:
            return True
        if self._handle is None:
            return False  # a local receive waiting for its message
        try:
            done = bool(self._handle.Test())
        except Exception as e:
            raise DistributedError(f"rank {self._rank}: {self._what} failed: {e}") from None
        if done:
            self._finish()
        return done


class Comm:
    """A group of processes (see module docstring). Subclasses: :class:`MPIComm`, :class:`LocalComm`."""

    rank: int = 0
    size: int = 1

    @property
    def is_root(self) -> bool:
        """True on rank 0 (the rank that logs, tests and snapshots)."""
        return self.rank == 0

    def __repr__(self) -> str:
        return f"<{type(self).__name__} rank {self.rank} of {self.size}>"

    # The methods below are implemented by the subclasses.
    def barrier(self) -> None:
        """Block until every rank has called it."""
        raise NotImplementedError

    def allreduce(self, array: np.ndarray, op: str = "sum", out: np.ndarray | None = None) -> np.ndarray:
        """Element-wise reduction over ranks; the result lands on every rank in ``out`` (a new
        array if None; ``out=array`` reduces in place). Returns ``out``."""
        raise NotImplementedError

    def iallreduce(self, array: np.ndarray, op: str = "sum", out: np.ndarray | None = None) -> Request:
        """Non-blocking :meth:`allreduce`: ``array`` must stay untouched and ``out`` unread until
        ``wait()`` (which returns ``out``)."""
        raise NotImplementedError

    def bcast(self, array: np.ndarray, root: int = 0) -> np.ndarray:
        """Overwrite ``array`` on every rank with the root's (in place); returns it."""
        raise NotImplementedError

    def allgather(self, array: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Every rank's ``array`` on every rank: ``out[r]`` is rank r's (``out``: ``(size,) + array.shape``)."""
        raise NotImplementedError

    def alltoall(self, send: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Personalised exchange: ``send[q]`` goes to rank q, ``out[r]`` comes from rank r (both ``(size, ...)``)."""
        raise NotImplementedError

    def reduce_scatter(self, send: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``out`` = the sum over ranks of their ``send[rank]`` (``send``: ``(size,) + out.shape``)."""
        raise NotImplementedError

    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        """The root's ``obj`` on every rank (pickled)."""
        raise NotImplementedError

    def gather_obj(self, obj: Any, root: int = 0) -> list | None:
        """Every rank's ``obj`` as a list (index = rank) on the root, None elsewhere."""
        raise NotImplementedError

    def allgather_obj(self, obj: Any) -> list:
        """Every rank's ``obj`` as a list (index = rank) on every rank."""
        raise NotImplementedError

    def send(self, array: np.ndarray, dest: int, tag: int = 0) -> None:
        """Send ``array`` to rank ``dest`` (blocks until the buffer may be reused)."""
        raise NotImplementedError

    def recv(self, out: np.ndarray, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> np.ndarray:
        """Receive an array of ``out``'s shape and dtype into ``out``; returns it."""
        raise NotImplementedError

    def isend(self, array: np.ndarray, dest: int, tag: int = 0) -> Request:
        """Non-blocking :meth:`send` (do not modify ``array`` before ``wait()``)."""
        raise NotImplementedError

    def irecv(self, out: np.ndarray, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:
        """Non-blocking :meth:`recv`; ``wait()`` returns ``out``."""
        raise NotImplementedError

    def send_obj(self, obj: Any, dest: int, tag: int = 0) -> None:
        """Send a picklable object to ``dest``."""
        raise NotImplementedError

    def recv_obj(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Any:
        """Receive an object sent with :meth:`send_obj`."""
        raise NotImplementedError

    def recv_any(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> tuple[Any, int, int]:
        """Receive an object sent with :meth:`send_obj` from any matching sender: ``(object, source, tag)``."""
        raise NotImplementedError

    def split(self, color: int | None, key: int | None = None) -> Comm | None:
        """A sub-communicator of the ranks that pass the same ``color`` (ordered by ``key``, default
        this rank); None for the ranks that pass ``color=None`` (in no sub-group). Collective: every
        rank of this group must call it."""
        raise NotImplementedError

    def free(self) -> None:
        """Release a communicator made by :meth:`split` (collective over its ranks)."""

    def abort(self, message: str = "", code: int = 1) -> NoReturn:
        """End the whole job now (every rank, every group) with exit status ``code``."""
        raise NotImplementedError

    def allreduce_scalar(self, value: float, op: str = "sum") -> float:
        """:meth:`allreduce` of one float64 number."""
        buf = np.array([value], dtype=np.float64)
        return float(self.allreduce(buf, op=op, out=buf)[0])

    def agree(self, value: Any, what: str) -> None:
        """Raise :class:`DistributedError` on every rank unless all ranks passed an equal ``value``
        (e.g. a hash of the net and solver definitions); the message names the ranks that differ."""
        values = self.allgather_obj(value)
        odd = [r for r, v in enumerate(values) if v != values[0]]
        if odd:
            raise DistributedError(f"{what} differ across ranks: rank(s) {', '.join(map(str, odd))} "
                                   f"differ from rank 0 ({values[odd[0]]!r} vs {values[0]!r})")


class LocalComm(Comm):
    """The one-process group: collectives copy, messages to rank 0 come back to this process."""

    def __init__(self) -> None:
        self.rank = 0
        self.size = 1
        self._mailbox: defaultdict[int, deque] = defaultdict(deque)

    def _self_only(self, rank: int, what: str) -> None:
        if rank not in (0, ANY_SOURCE):
            raise DistributedError(f"{what}: rank {rank} does not exist in a group of 1 process")

    def barrier(self) -> None:
        pass

    def allreduce(self, array, op="sum", out=None):
        check_op(op)
        as_message(array, "allreduce")
        if out is None:
            return array.copy()
        if out is not array:
            np.copyto(out, array)
        return out

    def iallreduce(self, array, op="sum", out=None):
        return Request(result=self.allreduce(array, op, out))

    def bcast(self, array, root=0):
        self._self_only(root, "bcast")
        return array

    def allgather(self, array, out):
        out[0] = as_message(array, "allgather")
        return out

    def alltoall(self, send, out):
        np.copyto(out, as_message(send, "alltoall"))
        return out

    def reduce_scatter(self, send, out):
        np.copyto(out, as_message(send, "reduce_scatter")[0])
        return out

    def bcast_obj(self, obj, root=0):
        self._self_only(root, "bcast_obj")
        return obj

    def gather_obj(self, obj, root=0):
        self._self_only(root, "gather_obj")
        return [obj]

    def allgather_obj(self, obj):
        return [obj]

    def send(self, array, dest, tag=0):
        self._self_only(dest, "send")
        self._mailbox[tag].append(np.array(as_message(array, "send"), copy=True))

    def _take(self, tag: int, what: str):
        return self._take_tagged(tag, what)[0]

    def _take_tagged(self, tag: int, what: str) -> tuple[Any, int]:
        queues = [(t, q) for t, q in self._mailbox.items() if q and (tag == ANY_TAG or t == tag)]
        if not queues:
            raise DistributedError(f"{what}: no message (tag {tag}) was sent to this single process; "
                                   "it would wait forever")
        t, q = queues[0]
        return q.popleft(), t

    def recv(self, out, source=ANY_SOURCE, tag=ANY_TAG):
        self._self_only(source, "recv")
        msg = self._take(tag, "recv")
        if msg.shape != out.shape and msg.size != out.size:
            raise DistributedError(f"recv: message of {msg.size} values into a buffer of {out.size}")
        np.copyto(out, msg.reshape(out.shape), casting="unsafe")
        return out

    def isend(self, array, dest, tag=0):
        self.send(array, dest, tag)
        return Request()

    def irecv(self, out, source=ANY_SOURCE, tag=ANY_TAG):
        self._self_only(source, "irecv")
        return Request(on_done=lambda: self.recv(out, source, tag), what="irecv")

    def send_obj(self, obj, dest, tag=0):
        self._self_only(dest, "send_obj")
        self._mailbox[tag].append(pickle.loads(pickle.dumps(obj)))

    def recv_obj(self, source=ANY_SOURCE, tag=ANY_TAG):
        self._self_only(source, "recv_obj")
        return self._take(tag, "recv_obj")

    def recv_any(self, source=ANY_SOURCE, tag=ANY_TAG):
        self._self_only(source, "recv_any")
        obj, t = self._take_tagged(tag, "recv_any")
        return obj, 0, t

    def split(self, color, key=None):
        return None if color is None else LocalComm()

    def abort(self, message="", code=1):
        import os
        import sys

        if message:
            sys.stderr.write(f"{message}\n")
            sys.stderr.flush()
        os._exit(code)


class MPIComm(Comm):
    """A :class:`Comm` over an :mod:`mpi4py` communicator (``comm.handle`` is the mpi4py object).

    ``poll_s``: when set, the object messages (:meth:`send_obj`, :meth:`recv_obj`, :meth:`recv_any`)
    wait by polling (``Iprobe``/``Test`` with sleeps from ``poll_s`` growing to 0.2 ms) instead of
    MPICH's blocking calls, which spin: with more ranks than cores (Omnivore's groups on a small
    machine) spinning ranks take the cores from the ranks doing the work. Sub-communicators keep it.
    """

    def __init__(self, handle: Any, poll_s: float | None = None):
        from mpi4py import MPI

        self._MPI = MPI
        self.handle = handle
        self.rank = handle.Get_rank()
        self.size = handle.Get_size()
        self.poll_s = poll_s
        self._ops = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}

    def _sleep_until(self, ready: Callable[[], bool]) -> None:
        delay = self.poll_s
        while not ready():
            time.sleep(delay)
            delay = min(delay * 2, 2e-4)

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except self._MPI.Exception as e:
            raise DistributedError(f"rank {self.rank} of {self.size}: {what} failed: {e}") from None

    def barrier(self):
        self._call("barrier", self.handle.Barrier)

    def allreduce(self, array, op="sum", out=None):
        as_message(array, "allreduce")
        mop = self._ops[check_op(op)]
        if out is None:
            out = np.empty_like(array)
        send = self._MPI.IN_PLACE if out is array else array
        self._call("allreduce", self.handle.Allreduce, send, out, mop)
        return out

    def iallreduce(self, array, op="sum", out=None):
        as_message(array, "iallreduce")
        mop = self._ops[check_op(op)]
        if out is None:
            out = np.empty_like(array)
        send = self._MPI.IN_PLACE if out is array else array
        handle = self._call("iallreduce", self.handle.Iallreduce, send, out, mop)
        return Request(handle, result=out, what="iallreduce", rank=self.rank)

    def bcast(self, array, root=0):
        self._call("bcast", self.handle.Bcast, as_message(array, "bcast"), root)
        return array

    def allgather(self, array, out):
        self._call("allgather", self.handle.Allgather, as_message(array, "allgather"), as_message(out, "allgather"))
        return out

    def alltoall(self, send, out):
        self._call("alltoall", self.handle.Alltoall, as_message(send, "alltoall"), as_message(out, "alltoall"))
        return out

    def reduce_scatter(self, send, out):
        self._call("reduce_scatter", self.handle.Reduce_scatter_block, as_message(send, "reduce_scatter"),
                   as_message(out, "reduce_scatter"), self._MPI.SUM)
        return out

    def bcast_obj(self, obj, root=0):
        return self._call("bcast_obj", self.handle.bcast, obj, root)

    def gather_obj(self, obj, root=0):
        return self._call("gather_obj", self.handle.gather, obj, root)

    def allgather_obj(self, obj):
        return self._call("allgather_obj", self.handle.allgather, obj)

    def send(self, array, dest, tag=0):
        self._call("send", self.handle.Send, as_message(array, "send"), dest, tag)

    def recv(self, out, source=ANY_SOURCE, tag=ANY_TAG):
        self._call("recv", self.handle.Recv, as_message(out, "recv"), self._src(source), self._tag(tag))
        return out

    def isend(self, array, dest, tag=0):
        handle = self._call("isend", self.handle.Isend, as_message(array, "isend"), dest, tag)
        return Request(handle, what="isend", rank=self.rank)

    def irecv(self, out, source=ANY_SOURCE, tag=ANY_TAG):
        handle = self._call("irecv", self.handle.Irecv, as_message(out, "irecv"), self._src(source),
                            self._tag(tag))
        return Request(handle, result=out, what="irecv", rank=self.rank)

    def send_obj(self, obj, dest, tag=0):
        if self.poll_s is None:
            self._call("send_obj", self.handle.send, obj, dest, tag)
            return
        req = self._call("send_obj", self.handle.isend, obj, dest, tag)
        self._sleep_until(lambda: self._call("send_obj", req.Test))

    def recv_obj(self, source=ANY_SOURCE, tag=ANY_TAG):
        if self.poll_s is None:
            return self._call("recv_obj", self.handle.recv, None, self._src(source), self._tag(tag))
        return self.recv_any(source, tag)[0]

    def recv_any(self, source=ANY_SOURCE, tag=ANY_TAG):
        status = self._MPI.Status()
        src, tg = self._src(source), self._tag(tag)
        if self.poll_s is None:
            self._call("recv_any", self.handle.Probe, src, tg, status)
        else:
            self._sleep_until(lambda: self._call("recv_any", self.handle.Iprobe, src, tg, status))
        src, tg = status.Get_source(), status.Get_tag()
        return self._call("recv_any", self.handle.recv, None, src, tg), src, tg

    def split(self, color, key=None):
        mcolor = self._MPI.UNDEFINED if color is None else int(color)
        sub = self._call("split", self.handle.Split, mcolor, self.rank if key is None else int(key))
        return None if sub == self._MPI.COMM_NULL else MPIComm(sub, self.poll_s)

    def free(self):
        self._call("free", self.handle.Free)

    def abort(self, message="", code=1):
        import sys

        if message:
            sys.stderr.write(f"{message}\n")
        sys.stdout.flush()
        sys.stderr.flush()
        # mpiexec kills every process at once on MPI_Abort, this one's output pipes included: give it a
        # moment to forward the lines just written (the error that names the failed rank), or they are lost
        time.sleep(ABORT_GRACE_S)
        self._MPI.COMM_WORLD.Abort(code)
        raise SystemExit(code)  # pragma: no cover - Abort does not return

    def _src(self, source: int) -> int:
        return self._MPI.ANY_SOURCE if source == ANY_SOURCE else source

    def _tag(self, tag: int) -> int:
        return self._MPI.ANY_TAG if tag == ANY_TAG else tag


def from_mpi4py(handle: Any) -> Comm:
    """A :class:`Comm` over a communicator the caller made with mpi4py (e.g. ``MPI.COMM_WORLD.Split``)."""
    return MPIComm(handle)


class abort_on_error:  # noqa: N801 - a context manager, named like one
    """``with abort_on_error(comm): ...``: an exception escaping the block on any rank ends the whole
    job at once (``MPI_Abort``, exit status 1; 130 for KeyboardInterrupt) with a message naming the
    rank and the error, so that no other rank waits forever in a collective. A no-op for one process."""

    def __init__(self, comm: Comm, what: str = "cct"):
        self.comm = comm
        self.what = what

    def __enter__(self) -> Comm:
        return self.comm

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None or self.comm.size == 1 or (isinstance(exc, SystemExit) and not exc.code):
            return
        import traceback

        if not isinstance(exc, DistributedError) and not isinstance(exc, KeyboardInterrupt):
            traceback.print_exception(exc_type, exc, tb)
        code = 130 if isinstance(exc, KeyboardInterrupt) else 1
        self.comm.abort(f"{self.what}: MPI rank {self.comm.rank} of {self.comm.size} failed, ending the job: "
                        f"{exc_type.__name__}: {exc}", code)


_WORLD: Comm | None = None


def world() -> Comm:
    """Every process of the job: :class:`MPIComm` over ``MPI.COMM_WORLD`` under ``mpiexec``, else a
    :class:`LocalComm` (mpi4py is then not imported). The same object on every call."""
    global _WORLD
    if _WORLD is None:
        if under_mpi():
            try:
                from mpi4py import MPI
            except ImportError as e:
                raise DistributedError(
                    f"started by mpiexec but mpi4py cannot be imported ({e}); install it with "
                    "pip install 'cct[mpi]'") from None
            _WORLD = MPIComm(MPI.COMM_WORLD)
        else:
            _WORLD = LocalComm()
    return _WORLD
