"""Moving a tensor between two splits over MPI ranks, point to point: the halo exchange of spatial splits.

Rank r holds the box ``own[r]`` of a global ``(N, C, H, W)`` tensor and needs the box ``need[r]`` (its part
of the next layer's input region, halo included). :class:`BoxExchange` sends each rank, from every other
rank, exactly the intersection of that rank's own box with its need (nothing where they do not meet:
neighbours only, for bands of a spatial split), and copies the local intersection in place. The backward
pass is the transpose: the gradient of each needed element goes back to its owner, which sums what
every reader returns (overlapping halos are summed, elements nobody read get zero).

The bytes a rank receives equal the planner's count (:mod:`.transfer`): the elements of the other
ranks' boxes inside its need, forward, and the same elements' gradients, backward. The message buffers are
made with the exchange (one per peer and direction, shared by forward and backward, which never run at
once): a pass only copies into them.
"""
from __future__ import annotations

import numpy as np

from .split import PlanError

#: the message tag of the exchanges (apart from any other point-to-point traffic on the communicator)
TAG = 3217


def intersect(a: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    """The ``(4, 2)`` intersection of boxes ``a`` and ``b`` (``[lo, hi)`` per axis), None if empty."""
    lo, hi = np.maximum(a[:, 0], b[:, 0]), np.minimum(a[:, 1], b[:, 1])
    if np.any(hi <= lo):
        return None
    return np.stack([lo, hi], axis=1)


def at_box(box: np.ndarray, origin: np.ndarray) -> tuple[slice, ...]:
    """Index of global ``box`` in a local array whose element ``[0, 0, 0, 0]`` is at global ``origin``."""
    return tuple(slice(int(lo - o), int(hi - o)) for (lo, hi), o in zip(box, origin))


def _extent(box: np.ndarray) -> tuple[int, ...]:
    return tuple(int(d) for d in box[:, 1] - box[:, 0])


class BoxExchange:
    """Rank-to-rank moves from the split ``own`` to the regions ``need`` (see module docstring).

    ``own``, ``need``: ``(ranks, 4, 2)`` global boxes; ``need_origin``: the global position of the local
    destination array's first element (a frame larger than ``need[rank]``, with explicit padding, may
    start before the tensor: negative coordinates); ``dtype``: the tensor's (its message buffers')."""

    def __init__(self, comm, own: np.ndarray, need: np.ndarray, need_origin: np.ndarray, dtype=np.float32):
        self.comm, self.rank = comm, comm.rank
        self.own_origin = own[comm.rank, :, 0].copy()
        self.need_origin = np.asarray(need_origin, dtype=np.int64)
        me = comm.rank
        peers = [q for q in range(comm.size) if q != me]
        #: (peer, box): what this rank sends forward (its own box inside the peer's need)
        self.sends = [(q, box) for q in peers if (box := intersect(own[me], need[q])) is not None]
        #: (peer, box): what this rank receives forward (the peer's own box inside this rank's need)
        self.recvs = [(q, box) for q in peers if (box := intersect(own[q], need[me])) is not None]
        self.local = intersect(own[me], need[me])
        self.dtype = np.dtype(dtype)
        #: (peer, box, buffer) of :attr:`sends` and of :attr:`recvs`: forward sends from the first and
        #: receives into the second, backward the reverse
        self._send_bufs = [(q, box, np.empty(_extent(box), self.dtype)) for q, box in self.sends]
        self._recv_bufs = [(q, box, np.empty(_extent(box), self.dtype)) for q, box in self.recvs]

    def _move(self, src: np.ndarray, src_origin: np.ndarray, outgoing, incoming) -> list[tuple[np.ndarray, np.ndarray]]:
        """Post the receives of ``incoming`` and the sends of ``outgoing`` from ``src`` (``(peer, box,
        buffer)`` each); wait; return ``(box, received buffer)`` pairs."""
        if src.dtype != self.dtype:
            raise PlanError(f"per-layer split: an exchange made for {self.dtype} tensors was given {src.dtype}")
        reqs = [self.comm.irecv(buf, q, TAG) for q, _box, buf in incoming]
        for q, box, buf in outgoing:
            np.copyto(buf, src[at_box(box, src_origin)])
            reqs.append(self.comm.isend(buf, q, TAG))
        for r in reqs:
            r.wait()
        return [(box, buf) for _q, box, buf in incoming]

    def forward(self, src: np.ndarray, dst: np.ndarray) -> int:
        """Fill ``dst`` (the need frame) from every rank's ``src`` (its own box); elements of the frame
        outside the tensor are left as they are (the caller's padding). Returns the bytes received."""
        got = self._move(src, self.own_origin, self._send_bufs, self._recv_bufs)
        if self.local is not None:
            dst[at_box(self.local, self.need_origin)] = src[at_box(self.local, self.own_origin)]
        for box, buf in got:
            dst[at_box(box, self.need_origin)] = buf
        return sum(buf.nbytes for _, buf in got)

    def backward(self, dst_grad: np.ndarray, src_grad: np.ndarray) -> int:
        """``src_grad`` (this rank's own box) = the sum of every rank's ``dst_grad`` over it (the
        transpose of :meth:`forward`). Returns the bytes received."""
        got = self._move(dst_grad, self.need_origin, self._recv_bufs, self._send_bufs)
        src_grad[...] = 0
        if self.local is not None:
            src_grad[at_box(self.local, self.own_origin)] += dst_grad[at_box(self.local, self.need_origin)]
        for box, buf in got:
            src_grad[at_box(box, self.own_origin)] += buf
        return sum(buf.nbytes for _, buf in got)
