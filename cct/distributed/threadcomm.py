"""A :class:`~.comm.Comm` over threads of one process: N workers sharing memory (the in-process devices).

:func:`run_workers` starts ``n`` threads, worker r calling ``fn(comm)`` with a :class:`ThreadComm` of rank r,
and returns their results (index = rank). Code written against ``Comm`` (data parallelism, the per-layer
executor) runs on them unchanged, exchanging arrays by in-process copies instead of MPI messages:

* point to point: a send and a receive are matched per (source, destination, tag) in posting order (MPI's
  rule); whichever of the two is posted second copies the sender's array straight into the receiver's
  ``out`` (one copy, no staging). :meth:`~ThreadComm.isend` keeps a reference to the array (do not modify
  it before ``wait()``); the blocking :meth:`~ThreadComm.send` and the object messages copy at once (they
  never wait for the receiver);
* collectives: every worker deposits its part under the operation's sequence number (every worker calls the
  collectives of a group in the same order, as under MPI); the last to arrive combines the parts -- a
  reduction in rank order, so the result is the same on every worker and from run to run -- and each worker
  copies its share of the result out. The non-blocking :meth:`~ThreadComm.iallreduce` deposits at once and
  collects at ``wait()``;
* :meth:`~ThreadComm.split` makes sub-groups (a collective), sharing the world's lock and failure state.

A worker that raises ends every other one: the failure is recorded, each waiting worker wakes and raises a
:class:`~.errors.DistributedError` naming the failed rank, and :func:`run_workers` re-raises the first
failure itself. Every wait has a deadline (``timeout_s``): a worker that never joins an operation ends the
others with an error naming the operation, instead of a hang.
"""
from __future__ import annotations

import pickle
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np

from .comm import ANY_SOURCE, ANY_TAG, Comm, Request, as_message, check_op
from .errors import DistributedError

#: seconds a worker waits for its peers in one operation before the job is ended
DEFAULT_TIMEOUT_S = 600.0
_REDUCE = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}


class _World:
    """What every group of one :func:`run_workers` job shares: the lock, the first failure, the deadline."""

    def __init__(self, timeout_s: float):
        self.cond = threading.Condition()
        self.timeout_s = timeout_s
        self.failure: tuple[int, BaseException] | None = None

    def fail(self, rank: int, exc: BaseException) -> None:
        """Record the first failure (world rank, exception) and wake every waiting worker."""
        with self.cond:
            if self.failure is None:
                self.failure = (rank, exc)
            self.cond.notify_all()

    def wait_for(self, ready: Callable[[], bool], rank: int, what: str) -> None:
        """Block (holding ``cond``) until ``ready()``; a DistributedError when a worker failed or on timeout."""
        deadline = time.monotonic() + self.timeout_s
        while not ready():
            if self.failure is not None:
                who, exc = self.failure
                raise DistributedError(f"worker {rank}: {what}: worker {who} failed: {type(exc).__name__}: {exc}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise DistributedError(f"worker {rank}: {what}: no answer from the other workers in "
                                       f"{self.timeout_s:g} s (a worker did not join the operation)")
            self.cond.wait(min(left, 1.0))


@dataclass
class _Slot:
    """One collective operation in progress: every worker's part, then the combined result."""

    what: str
    parts: list
    arrived: int = 0
    result: Any = None
    ready: bool = False
    taken: int = 0


@dataclass
class _Message:
    """A posted send waiting for its receive (``array``: the sender's data; ``obj``: a pickled object)."""

    source: int
    tag: int
    array: np.ndarray | None = None
    obj: bytes | None = None
    done: bool = False


@dataclass
class _Receive:
    """A posted receive waiting for its send."""

    source: int
    tag: int
    out: np.ndarray
    done: bool = False
    nbytes: int = 0


@dataclass
class _Group:
    """The shared state of one group of workers (the world or a sub-group made by ``split``)."""

    world: _World
    size: int
    world_ranks: list[int]
    slots: dict[int, _Slot] = field(default_factory=dict)
    sends: list[deque] = field(default_factory=list)     # per destination: _Message in posting order
    receives: list[deque] = field(default_factory=list)  # per destination: _Receive in posting order

    def __post_init__(self) -> None:
        self.sends = [deque() for _ in range(self.size)]
        self.receives = [deque() for _ in range(self.size)]


def _matches(source: int, tag: int, msg_source: int, msg_tag: int) -> bool:
    return source in (ANY_SOURCE, msg_source) and tag in (ANY_TAG, msg_tag)


def _deliver(msg: _Message, recv: _Receive, rank: int) -> None:
    """Copy a send into its receive (called holding the lock; both are marked done)."""
    if msg.array is None:
        raise DistributedError(f"worker {rank}: an array receive (tag {recv.tag}) matched an object message "
                               f"from worker {msg.source}")
    if msg.array.size != recv.out.size:
        raise DistributedError(f"worker {rank}: receive from worker {msg.source} (tag {msg.tag}): message of "
                               f"{msg.array.size} values into a buffer of {recv.out.size}")
    np.copyto(recv.out, msg.array.reshape(recv.out.shape), casting="unsafe")
    recv.nbytes = msg.array.nbytes
    msg.done = recv.done = True


class _Pending:
    """The handle of a :class:`Request` of a ThreadComm: ``Wait()`` and ``Test()`` as mpi4py's."""

    def __init__(self, comm: ThreadComm, done: Callable[[], bool], what: str,
                 finish: Callable[[], Any] | None = None):
        self._comm, self._done, self._what, self._finish = comm, done, what, finish

    def Wait(self) -> None:  # noqa: N802 - mpi4py's name
        world = self._comm._group.world
        with world.cond:
            world.wait_for(self._done, self._comm.rank, self._what)
        if self._finish is not None:
            self._finish()

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name
        with self._comm._group.world.cond:
            done = self._done()
        if done and self._finish is not None:
            self._finish()
            self._finish = None
        return done


class ThreadComm(Comm):
    """Worker ``rank`` of a group of threads (see module docstring); made by :func:`run_workers` and
    :meth:`split`."""

    def __init__(self, group: _Group, rank: int):
        self._group = group
        self.rank = rank
        self.size = group.size
        self._seq = 0
        #: bytes this worker received by point-to-point messages (arrays) since it was made
        self.bytes_received = 0

    # -- collectives --------------------------------------------------------------------------------
    def _post(self, what: str, part: Any, combine: Callable[[list], Any]) -> tuple[int, _Slot]:
        """Deposit this worker's ``part`` of the next collective; the last worker combines. Returns its number
        and its slot (kept until every worker has collected it)."""
        g, seq = self._group, self._seq
        self._seq += 1
        with g.world.cond:
            slot = g.slots.setdefault(seq, _Slot(what, [None] * g.size))
            if slot.what != what:
                raise DistributedError(f"worker {self.rank}: collective #{seq} is {what} here but {slot.what} on "
                                       "another worker (the workers must call collectives in the same order)")
            slot.parts[self.rank] = part
            slot.arrived += 1
            last = slot.arrived == g.size
        if last:  # every part is in and no worker reads the slot before it is ready: combine unlocked
            try:
                result = combine(slot.parts)
            except BaseException as e:
                g.world.fail(g.world_ranks[self.rank], e)
                raise
            with g.world.cond:
                slot.result, slot.ready = result, True
                slot.parts = []
                g.world.cond.notify_all()
        return seq, slot

    def _collect(self, seq: int) -> Any:
        """Wait for collective ``seq``'s result (shared by every worker: copy what you keep)."""
        g = self._group
        with g.world.cond:
            slot = g.slots[seq]
            g.world.wait_for(lambda: slot.ready, self.rank, slot.what)
            slot.taken += 1
            if slot.taken == g.size:
                del g.slots[seq]
            return slot.result

    def _collective(self, what: str, part: Any, combine: Callable[[list], Any]) -> Any:
        return self._collect(self._post(what, part, combine)[0])

    def barrier(self) -> None:
        self._collective("barrier", None, lambda parts: None)

    @staticmethod
    def _reduce(op: str) -> Callable[[list], np.ndarray]:
        ufunc = _REDUCE[op]

        def combine(parts: list) -> np.ndarray:
            acc = parts[0].copy()
            for p in parts[1:]:
                ufunc(acc, p, out=acc)
            return acc
        return combine

    def allreduce(self, array, op="sum", out=None):
        return self.iallreduce(array, op, out).wait()

    def iallreduce(self, array, op="sum", out=None):
        as_message(array, "iallreduce")
        combine = self._reduce(check_op(op))
        if out is None:
            out = np.empty_like(array)
        seq, slot = self._post("allreduce", array, combine)
        return Request(_Pending(self, lambda: slot.ready, "allreduce",
                                lambda: np.copyto(out, self._collect(seq))), result=out, what="allreduce",
                       rank=self.rank)

    def bcast(self, array, root=0):
        self._check_rank(root, "bcast")
        part = as_message(array, "bcast") if self.rank == root else None
        np.copyto(array, self._collective("bcast", part, lambda parts: parts[root].copy()))
        return array

    def allgather(self, array, out):
        np.copyto(out, self._collective("allgather", as_message(array, "allgather"), np.stack))
        return out

    def alltoall(self, send, out):
        got = self._collective("alltoall", as_message(send, "alltoall"), lambda parts: [p.copy() for p in parts])
        for r, part in enumerate(got):
            out[r] = part[self.rank]
        return out

    def reduce_scatter(self, send, out):
        total = self._collective("reduce_scatter", as_message(send, "reduce_scatter"), self._reduce("sum"))
        np.copyto(out, total[self.rank])
        return out

    def bcast_obj(self, obj, root=0):
        self._check_rank(root, "bcast_obj")
        data = self._collective("bcast_obj", pickle.dumps(obj) if self.rank == root else None,
                                lambda parts: parts[root])
        return pickle.loads(data)

    def gather_obj(self, obj, root=0):
        self._check_rank(root, "gather_obj")
        parts = self._collective("gather_obj", pickle.dumps(obj), list)
        return [pickle.loads(p) for p in parts] if self.rank == root else None

    def allgather_obj(self, obj):
        return [pickle.loads(p) for p in self._collective("allgather_obj", pickle.dumps(obj), list)]

    def split(self, color, key=None):
        g = self._group

        def combine(parts: list) -> dict:
            groups: dict[int, list[int]] = {}
            for r, (c, k) in enumerate(parts):
                if c is not None:
                    groups.setdefault(c, []).append((k, r))
            out = {}
            for c, members in groups.items():
                ranks = [r for _k, r in sorted(members)]
                out[c] = (_Group(g.world, len(ranks), [g.world_ranks[r] for r in ranks]), ranks)
            return out

        made = self._collective("split", (None if color is None else int(color),
                                          self.rank if key is None else int(key)), combine)
        if color is None:
            return None
        sub, ranks = made[int(color)]
        return ThreadComm(sub, ranks.index(self.rank))

    def free(self) -> None:
        """Nothing to release (a sub-group is shared memory, collected when unused)."""

    def abort(self, message: str = "", code: int = 1) -> NoReturn:
        """End every worker: record the failure and raise it here (the others raise at their next wait)."""
        exc = DistributedError(message or f"worker {self.rank} aborted (status {code})")
        self._group.world.fail(self._group.world_ranks[self.rank], exc)
        raise exc

    # -- point to point -------------------------------------------------------------------------------
    def _check_rank(self, rank: int, what: str, any_ok: bool = False) -> None:
        if not (0 <= rank < self.size or (any_ok and rank == ANY_SOURCE)):
            raise DistributedError(f"worker {self.rank}: {what}: worker {rank} does not exist in a group of "
                                   f"{self.size}")

    def _post_send(self, msg: _Message, dest: int) -> _Message:
        g = self._group
        with g.world.cond:
            for recv in g.receives[dest]:
                if not recv.done and _matches(recv.source, recv.tag, msg.source, msg.tag):
                    _deliver(msg, recv, dest)
                    g.receives[dest].remove(recv)
                    break
            else:
                g.sends[dest].append(msg)
            g.world.cond.notify_all()
        return msg

    def _take(self, source: int, tag: int, what: str) -> _Message:
        """The first posted send to this worker matching ``source`` and ``tag`` (waits for it)."""
        g, box = self._group, self._group.sends[self.rank]
        found: list[_Message] = []

        def ready() -> bool:
            for msg in box:
                if _matches(source, tag, msg.source, msg.tag):
                    found.append(msg)
                    return True
            return False

        with g.world.cond:
            g.world.wait_for(ready, self.rank, f"{what} from worker {source} (tag {tag})")
            box.remove(found[0])
            found[0].done = True
            g.world.cond.notify_all()
        return found[0]

    def send(self, array, dest, tag=0):
        self._check_rank(dest, "send")
        self._post_send(_Message(self.rank, tag, np.array(as_message(array, "send"), copy=True)), dest)

    def isend(self, array, dest, tag=0):
        self._check_rank(dest, "isend")
        msg = self._post_send(_Message(self.rank, tag, as_message(array, "isend")), dest)
        return Request(_Pending(self, lambda: msg.done, f"isend to worker {dest}"), what="isend", rank=self.rank)

    def irecv(self, out, source=ANY_SOURCE, tag=ANY_TAG):
        self._check_rank(source, "irecv", any_ok=True)
        as_message(out, "irecv")
        g, recv = self._group, _Receive(source, tag, out)
        with g.world.cond:
            box = g.sends[self.rank]
            for msg in box:
                if _matches(source, tag, msg.source, msg.tag):
                    _deliver(msg, recv, self.rank)
                    box.remove(msg)
                    g.world.cond.notify_all()
                    break
            else:
                g.receives[self.rank].append(recv)

        def count() -> None:
            self.bytes_received += recv.nbytes
        return Request(_Pending(self, lambda: recv.done, f"irecv from worker {source} (tag {tag})", count),
                       result=out, what="irecv", rank=self.rank)

    def recv(self, out, source=ANY_SOURCE, tag=ANY_TAG):
        return self.irecv(out, source, tag).wait()

    def send_obj(self, obj, dest, tag=0):
        self._check_rank(dest, "send_obj")
        self._post_send(_Message(self.rank, tag, obj=pickle.dumps(obj)), dest)

    def recv_any(self, source=ANY_SOURCE, tag=ANY_TAG):
        self._check_rank(source, "recv_any", any_ok=True)
        msg = self._take(source, tag, "recv_any")
        if msg.obj is None:
            raise DistributedError(f"worker {self.rank}: an object receive (tag {tag}) matched an array message "
                                   f"from worker {msg.source}")
        return pickle.loads(msg.obj), msg.source, msg.tag

    def recv_obj(self, source=ANY_SOURCE, tag=ANY_TAG):
        return self.recv_any(source, tag)[0]


def ranks_word(comm: Comm) -> str:
    """How the log names ``comm``'s members: "in-process workers" (a ThreadComm) or "MPI ranks"."""
    return "in-process workers" if isinstance(comm, ThreadComm) else "MPI ranks"


def thread_group(n: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[ThreadComm]:
    """``n`` workers' communicators of one new group (worker r's is element r); each is used by one thread."""
    if n < 1:
        raise DistributedError(f"a group of threads needs at least 1 worker, not {n}")
    group = _Group(_World(timeout_s), n, list(range(n)))
    return [ThreadComm(group, r) for r in range(n)]


def run_workers(n: int, fn: Callable[[ThreadComm], Any], timeout_s: float = DEFAULT_TIMEOUT_S,
                names: Sequence[str] | None = None) -> list[Any]:
    """Run ``fn(comm)`` on ``n`` threads, one per worker of a new :class:`ThreadComm` group; return the
    results by rank. When a worker raises, the others end at their next wait and the first failure is
    re-raised here (the other workers' consequent DistributedErrors are dropped)."""
    comms = thread_group(n, timeout_s)
    world = comms[0]._group.world
    results: list[Any] = [None] * n

    def body(comm: ThreadComm) -> None:
        try:
            results[comm.rank] = fn(comm)
        except BaseException as e:  # noqa: BLE001 - handed to the caller by run_workers
            world.fail(comm.rank, e)

    threads = [threading.Thread(target=body, args=(c,), name=names[c.rank] if names else f"cct-worker-{c.rank}",
                                daemon=True) for c in comms]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if world.failure is not None:
        raise world.failure[1]
    return results
