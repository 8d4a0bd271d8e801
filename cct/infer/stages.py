"""The two-stage CPU pipeline (ZNNi section VII's producer/consumer, the CPU-only stand-in for CPU-GPU).

:class:`TwoStagePipeline` splits a :class:`~cct.infer.dense.PatchRunner`'s layers after the ``theta``-th
spatial op (convolution or pooling): a producer thread runs the first stage (input window, first ``theta``
ops and the element-wise layers after them) of every run of every patch, a consumer (the calling thread)
runs the rest. They meet through a queue of at most one item: the producer copies the boundary blobs
(the first stage's blobs that the second stage reads) into one hand-off buffer and waits until the
consumer has taken the previous one, so at most one finished first stage waits while the consumer
computes. The second stage reads private copies of the boundary blobs, so the producer may overwrite
the net's own blobs with the next run at once. Every buffer is allocated at construction.

The BLAS threads are split between the stages: :meth:`TwoStagePipeline.results` runs under
:func:`cct.blas.threads.blas_threads` with ``threads_per_stage`` (OpenBLAS's limit is process-wide, so
both stages use the same count: half the BLAS threads each).

The CPU-GPU pipeline (ZNNi VII-C) is the same pipeline with ``second``: a runner of a copy of the net on a
device (built for the same patch and theta), whose layers after the split run the second stage. The hand-off
is then uploaded into that copy's boundary blobs by the device driver, the second stage runs there and the
output tile is the device's; the first stage keeps all the host's BLAS threads.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from ..blas.threads import blas_threads, get_num_threads
from ..blob import Blob
from ..device.driver import Device
from ..errors import CctError
from .dense import PatchRunner
from .fragments import FragmentPooling


class TwoStagePipeline:
    """Runs ``runner``'s patches as two stages on two threads (see the module docstring).

    ``theta``: the number of spatial ops (convolutions and poolings, in net order) in the first stage,
    ``1 <= theta < len(geom.ops)``; ``threads_per_stage``: BLAS threads of each stage (default half
    the current count, at least 1); ``second``: the CPU-GPU pipeline's runner on a device (module docstring).
    """

    def __init__(self, runner: PatchRunner, theta: int, threads_per_stage: int | None = None,
                 second: PatchRunner | None = None) -> None:
        ops = runner.geom.ops
        if not 1 <= theta < len(ops):
            raise CctError(f"pipeline theta {theta}: the net has {len(ops)} convolution/pooling layers, so theta "
                           f"must be 1..{len(ops) - 1}")
        if runner.reuse and runner.theta != theta:
            raise CctError(f"pipeline theta {theta}: the patch runner's activation buffers were planned for theta "
                           f"{runner.theta} (build it with theta={theta}: the stages run at the same time)")
        self.runner, self.theta, self.second_runner = runner, int(theta), second
        if second is not None and (second.theta != theta or second.patch_shape != runner.patch_shape
                                   or second.shifts != runner.shifts):
            raise CctError("the CPU-GPU pipeline's device runner must be built for the same patch, fragments and theta")
        self.device: Device | None = second.device if second is not None else None
        on_gpu = self.device is not None and self.device.is_gpu
        self.threads_per_stage = threads_per_stage or max(1, get_num_threads() // (1 if on_gpu else 2))
        last_first = ops[theta - 1].layer
        next_op = ops[theta].layer
        # first stage: up to the theta-th op and the layers after it that come before the next op
        split = next((k for k, st in enumerate(runner.steps) if st[0] >= next_op), len(runner.steps))
        split = max(split, next(k for k, st in enumerate(runner.steps) if st[0] == last_first) + 1)
        first, rest = runner.steps[:split], runner.steps[split:]
        produced = {id(runner.net.blobs[runner.geom.input_blob])}
        for _i, _r, _b, top in first:
            produced.update(id(t) for t in top)
        boundary: dict[int, Blob] = {}
        for _i, _r, bottom, _t in rest:
            for b in bottom:
                if id(b) in produced and id(b) not in boundary:
                    boundary[id(b)] = b
        self.boundary = list(boundary.values())
        self.handoff = [np.empty(b.shape, dtype=b.dtype) for b in self.boundary]
        self.first = first
        if second is not None:  # the second stage: the device copy's layers, reading its own boundary blobs
            names = {id(b): name for name, b in runner.net.blobs.items()}
            self.private = {id(b): second.net.blobs[names[id(b)]] for b in self.boundary}
            self.second = second.steps[split:]
            self.top = second.net.blobs[second.blob]
            return
        self.private = {id(b): Blob(b.shape, dtype=b.dtype, device=b.device, name=b.name) for b in self.boundary}
        self.second = []
        for i, r, bottom, top in rest:
            mb = [self.private.get(id(b), b) for b in bottom]
            mt = [self.private.get(id(t), t) for t in top]
            if any(x is not y for x, y in zip(mb + mt, bottom + top)):  # re-bind views (Split, Reshape) to copies
                if isinstance(r, FragmentPooling):
                    r.reshape(mb[0], mt[0])
                else:
                    r.reshape(mb, mt)
            self.second.append((i, r, mb, mt))
        top = runner.net.blobs[runner.blob]
        self.top = self.private.get(id(top), top)

    def describe(self) -> str:
        """Where the stages split and how many BLAS threads each gets."""
        ops = self.runner.geom.ops
        where = f" on {self.device.name}" if self.device is not None else ""
        return (f"two-stage pipeline: stage 1 = {', '.join(op.name for op in ops[:self.theta])}; stage 2{where} = "
                f"{', '.join(op.name for op in ops[self.theta:])}; {self.threads_per_stage} BLAS thread(s) each; "
                f"hand-off {sum(h.nbytes for h in self.handoff)} bytes")

    def results(self, items: Iterable, read: Callable[[object], np.ndarray]) -> Iterator[tuple[object, np.ndarray]]:
        """``(item, dense output)`` for each of ``items`` in order; ``read(item)`` gives its input patch
        ``(C_in, *patch_shape)`` (called on the producer thread). The output array is reused: copy it or
        write it out before asking for the next."""
        runner = self.runner
        full: queue.Queue = queue.Queue(maxsize=1)
        free: queue.Queue = queue.Queue(maxsize=1)
        free.put(True)
        stop = threading.Event()
        failure: list[BaseException] = []
        done = object()

        def produce() -> None:
            try:
                with blas_threads(self.threads_per_stage):  # MKL's limit is per thread: set it here too
                    produce_all()
            except BaseException as e:  # handed to the consumer, which re-raises it
                failure.append(e)
            full.put(done)

        def produce_all() -> None:
            for item in items:
                patch = read(item)
                runner.check_patch(patch)
                for k, shift in enumerate(runner.shifts):
                    runner.load(patch, shift)
                    runner.forward(self.first)
                    while not stop.is_set():
                        try:
                            free.get(timeout=0.1)
                            break
                        except queue.Empty:
                            continue
                    if stop.is_set():
                        return
                    for h, b in zip(self.handoff, self.boundary):
                        np.copyto(h, b.data)
                    full.put((item, k))

        out = (self.second_runner or runner).new_output()
        if self.device is not None:
            self.device.use()
        with blas_threads(self.threads_per_stage):
            worker = threading.Thread(target=produce, name="cct-infer-stage1", daemon=True)
            worker.start()
            try:
                while True:
                    got = full.get()
                    if got is done:
                        break
                    item, k = got
                    for h, b in zip(self.handoff, self.boundary):
                        if self.device is not None:
                            self.device.upload(h, out=self.private[id(b)].data)
                        else:
                            np.copyto(self.private[id(b)].data, h)
                    free.put(True)
                    runner.forward(self.second)
                    runner.place(self.top.data, runner.shifts[k], out)  # same shifts and fragments on the device
                    if k == len(runner.shifts) - 1:
                        yield item, out
            finally:
                stop.set()
                while worker.is_alive():
                    try:
                        full.get(timeout=0.1)
                    except queue.Empty:
                        pass
                worker.join()
        if failure:
            raise failure[0]
