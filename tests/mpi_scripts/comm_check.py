"""Run under mpiexec by tests/test_distributed_comm.py: every Comm operation, asserted on each rank."""
import numpy as np

from cct.distributed import DistributedError, MPIComm, world

comm = world()
assert isinstance(comm, MPIComm), comm
r, n = comm.rank, comm.size

# all-reduce: blocking (new array, in place), non-blocking, every op, float32/float64/int
for dt in (np.float32, np.float64, np.int64):
    a = np.arange(5, dtype=dt) + r
    total = sum(np.arange(5, dtype=dt) + k for k in range(n))
    assert np.array_equal(comm.allreduce(a), total)
    b = a.copy()
    assert comm.allreduce(b, out=b) is b and np.array_equal(b, total)
    assert np.array_equal(comm.iallreduce(a).wait(), total)
    assert np.array_equal(comm.allreduce(a, op="max"), np.arange(5, dtype=dt) + n - 1)
    assert np.array_equal(comm.allreduce(a, op="min"), np.arange(5, dtype=dt))
req = comm.iallreduce(np.ones(1000, np.float32))
while not req.test():
    pass
assert np.all(req.wait() == n)
assert comm.allreduce_scalar(r + 0.5) == sum(k + 0.5 for k in range(n))

# all-gather, all-to-all, reduce-scatter of arrays (per-layer parallelism's exchanges)
got = comm.allgather(np.full(2, r, np.int64), np.empty((n, 2), np.int64))
assert np.array_equal(got, np.repeat(np.arange(n), 2).reshape(n, 2))
send = np.array([[10 * r + q] for q in range(n)], np.float64)  # send[q] goes to rank q
got = comm.alltoall(send, np.empty_like(send))
assert np.array_equal(got[:, 0], [10 * q + r for q in range(n)])  # got[q] came from rank q
send = np.arange(n * 3, dtype=np.float32).reshape(n, 3) + r
got = comm.reduce_scatter(send, np.empty(3, np.float32))
assert np.array_equal(got, n * (np.arange(3) + 3 * r) + sum(range(n)))

# broadcast and object collectives
x = np.full(3, r, np.float32)
comm.bcast(x, root=n - 1)
assert np.all(x == n - 1)
assert comm.bcast_obj({"r": r}, root=0) == {"r": 0}
g = comm.gather_obj(r * 10, root=0)
assert g == ([k * 10 for k in range(n)] if r == 0 else None)
assert comm.allgather_obj(r) == list(range(n))

# point to point: a ring of arrays and objects, blocking and non-blocking
right, left = (r + 1) % n, (r - 1) % n
out = np.empty(4, np.float64)
sreq = comm.isend(np.full(4, r, np.float64), dest=right, tag=3)
assert np.all(comm.irecv(out, source=left, tag=3).wait() == left)
sreq.wait()
if r == 0:
    comm.send(np.arange(6, dtype=np.int32).reshape(2, 3), dest=1, tag=9)
    comm.send_obj(("hello", 1), dest=1)
elif r == 1:
    got = comm.recv(np.empty((2, 3), np.int32), source=0, tag=9)
    assert np.array_equal(got, np.arange(6).reshape(2, 3))
    assert comm.recv_obj(source=0) == ("hello", 1)

# sub-communicators: even and odd ranks
sub = comm.split(color=r % 2)
assert sub.size == len(range(r % 2, n, 2)) and sub.rank == r // 2
assert sub.allreduce(np.array([1.0]))[0] == sub.size

# polled object messages (Omnivore's): from any sender, with its rank and tag; ranks not in a sub-group
polled = MPIComm(comm.handle.Dup(), poll_s=1e-5)
if r == 0:
    got = sorted(polled.recv_any() for _ in range(n - 1))
    assert got == [(("from", k), k, 20 + k) for k in range(1, n)], got
    polled.send_obj("bye", dest=n - 1, tag=5)
else:
    polled.send_obj(("from", r), dest=0, tag=20 + r)
if r == n - 1:
    assert polled.recv_obj(source=0, tag=5) == "bye"
odd = polled.split(None if r == 0 else 1)
assert (odd is None) == (r == 0)
if odd is not None:
    assert odd.size == n - 1 and odd.poll_s == 1e-5
    odd.free()
polled.free()

# agreement check and clean errors
comm.agree("same", "the nets")
try:
    comm.agree(r == 0, "the solver files")
except DistributedError as e:
    assert "rank(s) 1" in str(e) and "solver files" in str(e), e
else:
    raise AssertionError("mismatch not detected")
try:
    comm.allreduce(np.ones((3, 3))[:, 0])
except DistributedError as e:
    assert "C-contiguous" in str(e)
else:
    raise AssertionError("non-contiguous array accepted")
comm.barrier()
print(f"rank {r} of {n}: ok", flush=True)
