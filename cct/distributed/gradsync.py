"""Gradient all-reduce that overlaps the backward pass (buckets, as PyTorch DDP).

The train net's learnable parameters are grouped, in the order backward finishes them, into
buckets of about ``bucket_bytes``. A bucket's gradients are final once the lowest layer using any
of its parameters has run its backward (shared weights: the last user in backward order); the
net's backward hook (:attr:`cct.net.Net.backward_hooks`) then copies them into the bucket's flat
buffer and starts a non-blocking all-reduce (sum), while backward goes on with the layers below.
:meth:`GradientSync.finish`, called before the update, waits for the buckets and writes
``sum / N`` back into the diffs (Caffe's multi-solver rule: sum over solvers, then scale by
``1 / solver_count``).

Only the last of ``iter_size`` passes is reduced (:meth:`arm` before it): the earlier passes
accumulate locally, and the sum of the accumulated diffs is what a single process accumulates.
With an executor attached to the net (``--devices``, a split) the per-layer diffs are final only when the
whole backward has finished, so every bucket starts then, unless the executor says they are final per
layer (``layer_diffs_final``: the per-layer executor with overlap).

MPI progresses a non-blocking collective only inside MPI calls, so each hook also polls the
requests in flight (``MPI_Test``): that is what moves the data while backward computes.
"""
from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np

from ..device.driver import device_of, to_host
from .comm import Comm, Request


@dataclass
class _Bucket:
    params: list[int]               # learnable param ids, in backward order
    trigger: int                    # the layer whose backward completes the bucket
    send: np.ndarray
    recv: np.ndarray
    offsets: list[int] = field(default_factory=list)
    request: Request | None = None


@dataclass
class SyncStats:
    """Counters of the gradient all-reduce (seconds are wall-clock, summed over iterations)."""

    iterations: int = 0
    bytes: int = 0                 # bytes reduced per iteration (all buckets)
    buckets: int = 0
    wait_s: float = 0.0            # time finish() waited for reductions: what was not hidden
    launch_s: float = 0.0          # time spent packing buffers and starting reductions in hooks
    unpack_s: float = 0.0          # time spent writing sum/N back into the diffs

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class GradientSync:
    """Bucketed all-reduce of a net's learnable-parameter diffs over ``comm`` (see module docstring).

    ``overlap=False`` starts every bucket only in :meth:`finish` (blocking after backward: the
    baseline the overlap is measured against). ``exclude``: learnable-parameter indices left out (their
    gradients stay local: a parameter slice owned by this rank alone). ``layer_diffs_final``: the net's
    executor leaves each layer's diffs final when its backward returns (the buckets start from the hooks
    as without an executor).
    """

    def __init__(self, net, comm: Comm, bucket_bytes: int = 1 << 20, overlap: bool = True,
                 exclude: Collection[int] = (), layer_diffs_final: bool = False):
        self.net = net
        self.comm = comm
        self.overlap = bool(overlap)
        self.layer_diffs_final = bool(layer_diffs_final)
        self.scale_by = 1.0 / comm.size
        #: None: sum, then scale by 1/N (Caffe); a number: this rank's diffs are multiplied by it
        #: before the sum (unequal batch shares: share / global batch), and the sum is the result
        self.weight: float | None = None
        self.stats = SyncStats()
        params = net.learnable_params
        ready = [len(net.layers)] * len(params)
        for nid, (lid, _pid) in enumerate(net.param_layer_indices):
            lp = net.learnable_param_ids[nid]
            ready[lp] = min(ready[lp], lid)
        skip = set(exclude)
        order = sorted((k for k in range(len(params)) if k not in skip), key=lambda k: (-ready[k], k))
        self.buckets: list[_Bucket] = []
        group: list[int] = []
        size = 0
        for k in order:
            dt = np.dtype(params[k].dtype)
            if group and (size >= bucket_bytes or dt != np.dtype(params[group[0]].dtype)):
                self._add_bucket(group, ready)
                group, size = [], 0
            group.append(k)
            size += params[k].count * dt.itemsize
        if group:
            self._add_bucket(group, ready)
        self._by_trigger: dict[int, list[_Bucket]] = {}
        for b in self.buckets:
            self._by_trigger.setdefault(b.trigger, []).append(b)
        self.stats.buckets = len(self.buckets)
        self.stats.bytes = sum(b.send.nbytes for b in self.buckets)
        self.armed = False

    def _add_bucket(self, group: list[int], ready: list[int]) -> None:
        params = self.net.learnable_params
        offsets, total = [], 0
        for k in group:
            offsets.append(total)
            total += params[k].count
        dt = np.dtype(params[group[0]].dtype)
        self.buckets.append(_Bucket(list(group), min(ready[k] for k in group), np.empty(total, dt),
                                    np.empty(total, dt), offsets))

    # -- driven by the solver and the net's backward hook ------------------------------------
    def arm(self) -> None:
        """The next backward is the iteration's last pass: reduce its gradients."""
        self.armed = True
        for b in self.buckets:
            b.request = None

    def hook(self, layer_index: int | None) -> None:
        """Net backward hook: start the buckets this layer completes (None: backward finished)."""
        if not self.armed or not self.overlap:
            return
        if layer_index is None:
            for b in self.buckets:
                if b.request is None:
                    self._launch(b)
            return
        if self.net.executor is not None and not self.layer_diffs_final:
            return  # diffs are final only after the executor's finish_backward
        for b in self._by_trigger.get(layer_index, ()):
            self._launch(b)
        for b in self.buckets:  # drive MPI progress of the reductions in flight
            if b.request is not None:
                b.request.test()

    def _launch(self, b: _Bucket) -> None:
        t = time.perf_counter()
        params = self.net.learnable_params
        for k, off in zip(b.params, b.offsets):
            d = params[k].diff
            b.send[off:off + d.size] = to_host(d).reshape(-1)
            if self.weight is not None:
                b.send[off:off + d.size] *= b.send.dtype.type(self.weight)
        b.request = self.comm.iallreduce(b.send, out=b.recv)
        self.stats.launch_s += time.perf_counter() - t

    def finish(self) -> None:
        """Wait for every bucket and write ``sum / N`` into the diffs (before the update)."""
        for b in self.buckets:
            if b.request is None:
                self._launch(b)
        t = time.perf_counter()
        for b in self.buckets:
            b.request.wait()
        t1 = time.perf_counter()
        self.stats.wait_s += t1 - t
        params = self.net.learnable_params
        for b in self.buckets:
            for k, off in zip(b.params, b.offsets):
                d = params[k].diff
                scale = d.dtype.type(self.scale_by if self.weight is None else 1)
                src = b.recv[off:off + d.size].reshape(d.shape)
                device = device_of(d)
                if device.is_gpu:
                    device.upload(src, out=d)
                    d *= scale
                else:
                    np.multiply(src, scale, out=d)
            b.request = None
        self.stats.unpack_s += time.perf_counter() - t1
        self.stats.iterations += 1
        self.armed = False
