"""Distributed training over MPI (``mpiexec -n N cct train``).

* :mod:`cct.distributed.comm`: the communication layer (:class:`Comm`, :func:`world`,
  :func:`from_mpi4py`): collectives, point-to-point arrays and objects, sub-communicators.
* :mod:`cct.distributed.threadcomm`: the same API over threads of one process (:class:`ThreadComm`,
  :func:`run_workers`): the in-process devices' workers.
* :mod:`cct.distributed.launch`: is this process a rank of an MPI job (:func:`under_mpi`)?
* :mod:`cct.distributed.gradsync`: bucketed gradient all-reduce overlapping the backward pass.
* :mod:`cct.distributed.parallel`: Caffe's multi-solver data parallelism (what a solver under
  mpiexec uses; ``get_solver(path, comm=...)`` passes a communicator explicitly).

Without ``mpiexec`` nothing here imports mpi4py.
"""
from .comm import ANY_SOURCE, ANY_TAG, Comm, LocalComm, MPIComm, Request, abort_on_error, from_mpi4py, world
from .errors import DistributedError
from .launch import launcher_rank_size, under_mpi
from .threadcomm import ThreadComm, run_workers, thread_group

__all__ = [
    "ANY_SOURCE", "ANY_TAG", "Comm", "DistributedError", "LocalComm", "MPIComm", "Request", "abort_on_error",
    "from_mpi4py", "launcher_rank_size", "under_mpi", "world", "ThreadComm", "run_workers", "thread_group",
]
