"""Link bandwidths measured on this machine: an in-process copy (between devices of one process: the workers
of a ThreadComm), and an MPI ping-pong between ranks (shared memory between ranks of one host, the network
between hosts); cached per machine.

:func:`measure_links` runs on every rank of a communicator: rank 0 ping-pongs with the first rank of
its own host (``shm``) and with the first rank of another host (``network``), and the result is
broadcast; :func:`cluster_of_ranks` then describes the job's ranks as a :class:`~.cluster.Cluster`.
"""
from __future__ import annotations

import socket
import time

import numpy as np

from .. import blas
from ..distributed.comm import Comm
from ..distributed.threadcomm import ThreadComm
from .cluster import Cluster
from .split import PlanError

#: bytes of one ping-pong message and of the in-process copy
MESSAGE_BYTES = 8 << 20
#: round trips timed (the best is kept)
ROUNDS = 5
#: bumped when the measurement changes
LINKS_VERSION = 1


def copy_bandwidth(nbytes: int = MESSAGE_BYTES, rounds: int = ROUNDS) -> float:
    """Bytes per second of one in-process copy (the link between devices of one process)."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(rounds + 1):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def pingpong(comm: Comm, a: int, b: int, nbytes: int = MESSAGE_BYTES, rounds: int = ROUNDS) -> float | None:
    """Bytes per second from rank ``a`` to rank ``b`` (half the best round trip), measured by both; None
    on the other ranks."""
    if comm.rank not in (a, b):
        return None
    buf = np.ones(nbytes // 4, np.float32)
    best = float("inf")
    for _ in range(rounds + 1):
        t = time.perf_counter()
        if comm.rank == a:
            comm.send(buf, b, tag=71)
            comm.recv(buf, b, tag=72)
        else:
            comm.recv(buf, a, tag=71)
            comm.send(buf, a, tag=72)
        best = min(best, time.perf_counter() - t)
    return 2.0 * nbytes / best


def _cache_name() -> str:
    return f"deepa-links-{blas.machine_key()}.json"


def measure_links(comm: Comm, cache: bool = True) -> dict[str, float]:
    """``{"copy", "shm", "network"}`` bytes/s among ``comm``'s ranks (a kind absent from the job is left
    out); the same answer on every rank. Cached per machine when every rank is on this host. The workers of a
    :class:`~cct.distributed.threadcomm.ThreadComm` (in-process devices) are linked by the in-process copy
    alone (measured by worker 0)."""
    if isinstance(comm, ThreadComm):
        return {"copy": comm.bcast_obj(copy_bandwidth() if comm.rank == 0 else None)}
    hosts = comm.allgather_obj(socket.gethostname())
    one_host = len(set(hosts)) == 1
    stamp = f"{LINKS_VERSION}|{comm.size}"
    if cache and one_host:
        hit = blas.read_cache(_cache_name()) if comm.rank == 0 else None
        hit = comm.bcast_obj(hit if hit and hit.get("stamp") == stamp else None)
        if hit:
            return dict(hit["rates"])
    rates: dict[str, float] = {"copy": copy_bandwidth()}
    same = [r for r in range(1, comm.size) if hosts[r] == hosts[0]]
    other = [r for r in range(1, comm.size) if hosts[r] != hosts[0]]
    for kind, peers in (("shm", same), ("network", other)):
        if not comm.bcast_obj(bool(peers)):
            continue
        value = pingpong(comm, 0, peers[0])
        rates[kind] = comm.bcast_obj(value)
    rates = comm.bcast_obj(rates)
    if cache and one_host and comm.rank == 0:
        try:
            blas.write_cache(_cache_name(), {"stamp": stamp, "rates": rates})
        except OSError:
            pass  # a read-only cache dir: measured again next time
    return rates


def cluster_of_ranks(comm: Comm, rates: dict[str, float], speed: float = 1.0) -> Cluster:
    """The job's ranks as a cluster: hosts with equally many ranks, links as measured."""
    hosts = comm.allgather_obj(socket.gethostname())
    counts = {h: hosts.count(h) for h in hosts}
    if len(set(counts.values())) != 1 or hosts != sorted(hosts, key=hosts.index):
        raise PlanError(f"the planner needs the same number of ranks on every host, in host order; ranks per host: "
                        f"{counts}")
    per = next(iter(counts.values()))
    intra = rates.get("shm", rates["copy"])
    return Cluster(len(counts), per, intra, rates.get("network", intra), speed)
