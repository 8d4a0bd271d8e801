"""cct.distributed.threadcomm: every Comm operation over worker threads of one process, checked against numpy
(results identical on every worker, reductions in rank order), and failures: a worker that raises ends the
others with its error, a worker that never joins ends them at the deadline, mismatched collectives are named."""
import time

import numpy as np
import pytest

from cct.distributed import ANY_SOURCE, DistributedError, ThreadComm, run_workers


def _data(rank: int, shape=(3, 5)) -> np.ndarray:
    return np.random.default_rng(rank).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_collectives_equal_numpy_on_every_worker(n):
    parts = [_data(r) for r in range(n)]

    def work(c: ThreadComm):
        assert isinstance(c, ThreadComm) and c.size == n
        a = _data(c.rank)
        got = {"sum": c.allreduce(a), "max": c.allreduce(a, op="max"), "min": c.allreduce(a, op="min")}
        inplace = a.copy()
        c.allreduce(inplace, out=inplace)
        req = c.iallreduce(a, op="prod")
        c.barrier()
        got["prod"] = req.wait()
        got["inplace"] = inplace
        b = a.copy() if c.rank == n - 1 else np.zeros_like(a)
        got["bcast"] = c.bcast(b, root=n - 1)
        got["allgather"] = c.allgather(a, np.empty((n,) + a.shape, a.dtype))
        send = np.stack([a + 10 * q for q in range(n)])
        got["alltoall"] = c.alltoall(send, np.empty_like(send))
        got["reduce_scatter"] = c.reduce_scatter(send, np.empty_like(a))
        got["objs"] = (c.bcast_obj({"root": c.rank}, root=0), c.gather_obj(c.rank * 2, root=0),
                       c.allgather_obj(f"w{c.rank}"))
        c.agree("same", "the definitions")
        return got

    results = run_workers(n, work, timeout_s=30)
    acc = parts[0].copy()
    for p in parts[1:]:
        acc += p  # the reduction order: rank 0, 1, 2 (the same on every worker, run after run)
    for r, got in enumerate(results):
        assert np.array_equal(got["sum"], acc) and np.array_equal(got["inplace"], acc)
        assert np.array_equal(got["max"], np.max(parts, axis=0)) and np.array_equal(got["min"], np.min(parts, axis=0))
        assert np.allclose(got["prod"], np.prod(parts, axis=0), rtol=1e-6)
        assert np.array_equal(got["bcast"], parts[n - 1])
        assert np.array_equal(got["allgather"], np.stack(parts))
        assert np.array_equal(got["alltoall"], np.stack([parts[q] + 10 * r for q in range(n)]))
        assert np.allclose(got["reduce_scatter"], sum(parts[q] + 10 * r for q in range(n)), rtol=1e-6)
        assert got["objs"] == ({"root": 0}, list(range(0, 2 * n, 2)) if r == 0 else None,
                               [f"w{q}" for q in range(n)])


def test_point_to_point_matches_by_source_and_tag_in_order_and_counts_bytes():
    def work(c: ThreadComm):
        a = _data(c.rank, (4,))
        peer = 1 - c.rank
        if c.rank == 0:  # receive posted before the send (the sender copies into it) ...
            early = c.irecv(np.empty(4, np.float32), source=1, tag=5)
            c.barrier()
            got = [early.wait()]
            c.send(a, dest=1, tag=6)
            c.send(a * 2, dest=1, tag=6)
            c.send_obj({"x": 1}, dest=1, tag=9)
        else:  # ... and after it (the receiver copies)
            req = c.isend(a, dest=0, tag=5)
            c.barrier()
            req.wait()
            second = np.empty(4, np.float32)
            got = [c.recv(np.empty(4, np.float32), source=0, tag=6), c.recv(second, source=ANY_SOURCE, tag=6)]
            got.append(c.recv_any())
        reqs = [c.irecv(np.empty(2, np.float64), peer, 1), c.isend(np.full(2, c.rank, np.float64), peer, 1)]
        got.append(reqs[0].wait())
        reqs[1].wait()
        assert reqs[1].test()
        return got, c.bytes_received

    (g0, b0), (g1, b1) = run_workers(2, work, timeout_s=30)
    assert np.array_equal(g0[0], _data(1, (4,))) and np.array_equal(g0[1], [1.0, 1.0])
    assert np.array_equal(g1[0], _data(0, (4,))) and np.array_equal(g1[1], 2 * _data(0, (4,)))
    assert g1[2] == ({"x": 1}, 0, 9) and np.array_equal(g1[3], [0.0, 0.0])
    assert b0 == 16 + 16 and b1 == 2 * 16 + 16


def test_split_makes_sub_groups_ordered_by_key():
    def work(c: ThreadComm):
        sub = c.split(c.rank % 2 if c.rank < 3 else None, key=-c.rank)
        if sub is None:
            return None
        return sub.rank, sub.size, sub.allgather_obj(c.rank), float(sub.allreduce(np.array([c.rank + 1.0]))[0])

    got = run_workers(4, work, timeout_s=30)
    assert got == [(1, 2, [2, 0], 4.0), (0, 1, [1], 2.0), (0, 2, [2, 0], 4.0), None]


def test_a_worker_that_raises_ends_every_other_with_its_error():
    def work(c: ThreadComm):
        if c.rank == 1:
            raise ValueError("injected on worker 1")
        c.allreduce(np.ones(3))  # the others would wait for worker 1 forever
        c.recv(np.empty(3), source=1)

    t = time.monotonic()
    with pytest.raises(ValueError, match="injected on worker 1"):
        run_workers(3, work, timeout_s=60)
    assert time.monotonic() - t < 10


def test_waits_have_deadlines_and_mismatched_or_bad_calls_are_named():
    def late(c: ThreadComm):
        if c.rank == 0:
            c.recv(np.empty(2), source=1, tag=3)

    with pytest.raises(DistributedError, match=r"worker 0: irecv from worker 1 \(tag 3\): no answer .* 0.3 s"):
        run_workers(2, late, timeout_s=0.3)

    def mixed(c: ThreadComm):
        c.barrier() if c.rank == 0 else c.allgather_obj(1)
        time.sleep(0.2)
    with pytest.raises(DistributedError, match=r"collective #0 is (barrier|allgather_obj) here but"):
        run_workers(2, mixed, timeout_s=5)

    def bad(c: ThreadComm):
        if c.rank == 0:
            c.send(np.ones(2), dest=2)
    with pytest.raises(DistributedError, match="worker 0: send: worker 2 does not exist in a group of 2"):
        run_workers(2, bad, timeout_s=5)

    def too_big(c: ThreadComm):
        if c.rank == 0:
            c.send(np.ones(5), dest=1)
        else:
            c.recv(np.empty(2), source=0)
    with pytest.raises(DistributedError, match="message of 5 values into a buffer of 2"):
        run_workers(2, too_big, timeout_s=5)
