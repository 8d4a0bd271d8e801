"""The Net executor that splits each batch-separable layer across devices (CcT's data parallelism).

Installed as ``net.executor`` (see :func:`cct.scheduler.attach`), it receives every layer's
forward/backward from :class:`cct.Net`:

* forward of a "split" layer: each device gets a contiguous slice ``[s0, s1)`` of the batch
  (images per device from the :class:`~cct.scheduler.split.ShareTable`) and runs a *shadow*
  instance of the layer (same LayerParameter; its param blobs share the master's data arrays on
  CPU devices, are copies uploaded each forward on GPUs) on slice blobs whose arrays are views
  ``blob.data[s0:s1]`` / ``blob.diff[s0:s1]`` of the net's blobs (GPU: device buffers copied
  in and out). The slices run at the same time on the devices' worker threads. "serial" layers
  (those drawing from the global RNG) run their slices one device after the other, in device
  order, so the random stream is exactly the single-device one. "host" layers run whole on the
  calling thread.
* backward of a split layer: the shadows backpropagate their slices in parallel, each
  accumulating its parameter gradient into its own buffer (zeroed first). As soon as all
  devices are done, one job on the host aggregation thread adds the partial gradients into the
  master param diffs (in device order) while the caller continues with the backward of the
  layers below: aggregation overlaps backward (Le et al., "Involving CPUs into Multi-GPU Deep
  Learning"). :meth:`finish_backward` (called by ``Net.backward``) waits for what is pending.
  The first device on host memory skips its buffer and accumulates straight into the master
  diffs, as a single device would, so only the other devices' partials are aggregated.
* InnerProduct layers with more outputs than images (``model_parallel="auto"``) are split by
  output channels instead: each device computes its rows of the output, of the weight and bias
  gradients (views of the master's: nothing to aggregate) and a partial bottom gradient, summed
  on the calling thread.

The master layer still runs ``reshape`` (called by the net) so top shapes are set before the split.
"""
from __future__ import annotations

import concurrent.futures as cf
import copy
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..blob import Blob
from ..errors import CctError
from ..layers import create_layer
from ..layers.base import Layer
from ..proto import caffe_pb2
from .devices import Device, ThreadBudget
from .split import ShareTable, layer_mode

log = logging.getLogger("cct")


class _Arrays:
    """Duck-typed source for ``Blob.share_data`` / ``share_diff`` (a slice of a blob)."""

    __slots__ = ("data", "diff", "shape")

    def __init__(self, data: Any, diff: Any):
        self.data = data
        self.diff = diff
        self.shape = tuple(data.shape)


@dataclass
class ExecutorStats:
    """Timings accumulated since the last :meth:`DataParallelExecutor.reset_stats` (seconds)."""

    forward_s: float = 0.0          # time inside executor.forward (all layers)
    backward_s: float = 0.0         # time inside executor.backward (all layers)
    aggregation_s: float = 0.0      # time the aggregation thread spent summing gradients
    aggregation_wait_s: float = 0.0  # time finish_backward waited for it (the part not hidden)
    aggregations: int = 0
    iterations: int = 0             # finish_backward calls
    layer_forward_s: dict = field(default_factory=dict)
    layer_backward_s: dict = field(default_factory=dict)
    images: dict = field(default_factory=dict)  # device name -> images processed in split layers (forward)

    @property
    def aggregation_hidden_s(self) -> float:
        """Aggregation time that overlapped backward."""
        return max(0.0, self.aggregation_s - self.aggregation_wait_s)

    def as_dict(self) -> dict:
        return {"forward_s": self.forward_s, "backward_s": self.backward_s, "aggregation_s": self.aggregation_s,
                "aggregation_wait_s": self.aggregation_wait_s, "aggregation_hidden_s": self.aggregation_hidden_s,
                "aggregations": self.aggregations, "iterations": self.iterations, "images": dict(self.images)}


class DataParallelExecutor:
    """Runs a Net's layers split by batch over ``devices`` (see module docstring)."""

    def __init__(self, net: Any, devices: Sequence[Device], shares: ShareTable,
                 budget: ThreadBudget | None = None, overlap: bool = True, strict: bool = True,
                 model_parallel: str = "auto"):
        if not devices:
            raise CctError("the executor needs at least one device")
        if len(shares.default) != len(devices):
            raise CctError(f"{len(shares.default)} share(s) for {len(devices)} device(s)")
        for name in shares.layers:
            if strict and not net.has_layer(name):
                raise CctError(f"per-layer shares name layer '{name}', which net '{net.name}' does not have "
                               f"(layers: {', '.join(net.layer_names)})")
        self.net = net
        self.devices = list(devices)
        self.shares = shares
        self.budget = budget
        self.overlap = overlap
        self.stats = ExecutorStats()
        self._shadows: dict[tuple[int, int], Layer] = {}
        self._bound: dict[tuple[int, int], list[Any]] = {}      # master param arrays each shadow is bound to
        self._staging: dict[tuple[int, int], list[np.ndarray]] = {}  # host copies of GPU param diffs
        self._views: list[dict[int, Blob]] = [{} for _ in self.devices]
        self._ranges: dict[int, list[tuple[int, int, int]]] = {}  # layer -> [(device, s0, s1)] of last forward
        self._modes: dict[int, str] = {}
        self._agg = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="cct-agg")
        self._pending: dict[int, tuple[cf.Future, frozenset[int]]] = {}
        self._own_diffs: dict[tuple[int, int], list[np.ndarray]] = {}
        self._model: dict[int, list[tuple[int, int, int]]] = {}  # layer -> [(device, o0, o1)] (model parallel)
        self._mp_shadows: dict[tuple[int, int], tuple[tuple[int, int], Layer, Blob, Blob, np.ndarray | None]] = {}
        if model_parallel not in ("auto", "always", "never"):
            raise CctError(f"model_parallel must be auto, always or never, got {model_parallel!r}")
        self.model_parallel = model_parallel
        self._agg_lock = threading.Lock()
        self.owned_config: Any = None  # set by attach() when it built the devices itself

    # -- public --------------------------------------------------------------------------
    def mode(self, layer_index: int) -> str | None:
        """The mode ("split", "serial", "model", "host") the layer ran in at its last forward."""
        return self._modes.get(layer_index)

    def model_ranges(self, layer_index: int) -> list[tuple[int, int, int]]:
        """``[(device index, first output, end)]`` of the layer's last model-parallel forward."""
        return list(self._model.get(layer_index, []))

    def ranges(self, layer_index: int) -> list[tuple[int, int, int]]:
        """``[(device index, start, stop)]`` of the layer's last split forward ([] if it ran on the host)."""
        return list(self._ranges.get(layer_index, []))

    def reset_stats(self) -> None:
        self.stats = ExecutorStats()

    def close(self) -> None:
        """Wait for pending aggregation and stop the aggregation thread."""
        self.finish_backward()
        self._agg.shutdown(wait=True)

    # -- forward -------------------------------------------------------------------------
    def forward(self, i: int, layer: Layer, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        t0 = time.perf_counter()
        mode = layer_mode(layer, bottom, top)
        if mode == "split" and self._use_model_parallel(layer, top):
            mode = "model"
        self._modes[i] = mode
        self._model.pop(i, None)
        if mode == "host":
            self._ranges.pop(i, None)
            layer.forward(bottom, top)
        elif mode == "model":
            self._ranges.pop(i, None)
            counts = self.shares.counts(layer.name, layer.num_output)
            ranges, o0 = [], 0
            for d, c in enumerate(counts):
                if c > 0:
                    ranges.append((d, o0, o0 + c))
                o0 += c
            self._model[i] = ranges
            self._run([(self.devices[d], (self._forward_model, i, layer, d, a, b, bottom, top))
                       for d, a, b in ranges], serial=False)
        else:
            self._wait_layer(i)  # its shadows' diff buffers may still be read by an aggregation
            n = bottom[0].shape[0]
            counts = self.shares.counts(layer.name, n)
            ranges, s0 = [], 0
            for d, c in enumerate(counts):
                if c > 0:
                    ranges.append((d, s0, s0 + c))
                s0 += c
            self._ranges[i] = ranges
            for d, a, b in ranges:
                name = self.devices[d].name
                self.stats.images[name] = self.stats.images.get(name, 0) + (b - a)
            jobs = [(self.devices[d], (self._forward_slice, i, layer, d, a, b, bottom, top)) for d, a, b in ranges]
            self._run(jobs, serial=(mode == "serial"))
        dt = time.perf_counter() - t0
        self.stats.forward_s += dt
        self.stats.layer_forward_s[layer.name] = self.stats.layer_forward_s.get(layer.name, 0.0) + dt

    def _forward_slice(self, i: int, layer: Layer, d: int, s0: int, s1: int, bottom: Sequence[Blob],
                       top: Sequence[Blob]) -> None:
        dev = self.devices[d]
        sb = [self._view(d, b, s0, s1, upload_data=True) for b in bottom]
        st = [self._view(d, t, s0, s1) for t in top]
        shadow = self._shadow(i, layer, d, sb, st)
        self._sync_params(i, layer, d, shadow)
        shapes = [t.shape for t in st]
        shadow.reshape(sb, st)
        _pin_lowering(layer, shadow)
        if [t.shape for t in st] != shapes:
            raise CctError(f"layer '{layer.name}': a batch slice reshaped its tops to {[t.shape for t in st]} "
                           f"instead of {shapes}; the layer is not batch-separable")
        shadow.forward(sb, st)
        if dev.memory.is_gpu:
            for t, v in zip(top, st):
                dev.memory.download(v.data, out=t.data[s0:s1])
            dev.memory.synchronize()

    # -- backward ------------------------------------------------------------------------
    def backward(self, i: int, layer: Layer, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        t0 = time.perf_counter()
        ranges = self._ranges.get(i)
        wanted = [j for j, p in enumerate(layer.param_propagate_down[: len(layer.blobs)]) if p]
        keys = self._param_keys(layer, wanted)
        # Param diffs this layer writes must not be in a pending aggregation (shared params,
        # a second backward without forward).
        self._wait_keys(keys)
        if i in self._model:
            self._backward_model(i, layer, top, propagate_down, bottom)
        elif ranges is None:
            layer.backward(top, propagate_down, bottom)
        else:
            primary = next((d for d, _, _ in ranges if not self.devices[d].memory.is_gpu), None)
            jobs = [(self.devices[d], (self._backward_slice, i, layer, d, a, b, top, list(propagate_down), bottom,
                                       d == primary)) for d, a, b in ranges]
            parts = [p for (d, _, _), p in zip(ranges, self._run(jobs, serial=False)) if d != primary]
            if wanted and parts:
                job = (self._aggregate, layer, wanted, parts)
                if self.overlap:
                    self._pending[i] = (self._agg.submit(*job), keys)
                else:
                    job[0](*job[1:])
        dt = time.perf_counter() - t0
        self.stats.backward_s += dt
        self.stats.layer_backward_s[layer.name] = self.stats.layer_backward_s.get(layer.name, 0.0) + dt

    def _backward_slice(self, i: int, layer: Layer, d: int, s0: int, s1: int, top: Sequence[Blob],
                        propagate_down: list[bool], bottom: Sequence[Blob], primary: bool) -> list[Any]:
        """Backward of one slice. The primary device (the first on host memory) accumulates straight
        into the master param diffs, as a single device would; the others into their own zeroed
        buffers, returned for aggregation."""
        dev = self.devices[d]
        shadow = self._shadows.get((i, d))
        if shadow is None:
            raise CctError(f"layer '{layer.name}': backward on {dev.name} before its forward")
        st = [self._view(d, t, s0, s1, upload_data=True, upload_diff=True) for t in top]
        sb = [self._view(d, b, s0, s1, upload_data=True) for b in bottom]
        shadow.param_propagate_down = list(layer.param_propagate_down)
        if not dev.memory.is_gpu:
            own = self._own_diffs.get((i, d))
            for j, (mb, pb) in enumerate(zip(layer.blobs, shadow.blobs)):
                if primary:
                    pb.share_diff(mb)
                else:
                    if own is None:
                        own = self._own_diffs[(i, d)] = [np.zeros(m.shape, dtype=m.dtype) for m in layer.blobs]
                    pb.share_diff(_Arrays(pb.data, own[j]))
                    if shadow.param_propagate_down[j]:
                        own[j][...] = 0
        else:
            for j, pb in enumerate(shadow.blobs):
                if shadow.param_propagate_down[j]:
                    pb.diff[...] = 0
        shadow.backward(st, propagate_down, sb)
        if not dev.memory.is_gpu:
            return [pb.diff for pb in shadow.blobs]
        for b, v, pd in zip(bottom, sb, propagate_down):
            if pd:
                dev.memory.download(v.diff, out=b.diff[s0:s1])
        staging = self._staging.setdefault((i, d), [np.empty(pb.shape, dtype=pb.dtype) for pb in shadow.blobs])
        for j, pb in enumerate(shadow.blobs):
            if shadow.param_propagate_down[j]:
                dev.memory.download(pb.diff, out=staging[j])
        dev.memory.synchronize()
        return staging

    def _aggregate(self, layer: Layer, wanted: list[int], parts: list[list[Any]]) -> None:
        """master.diff += the other devices' partial gradients, in device order (aggregation thread)."""
        t0 = time.perf_counter()
        for j in wanted:
            acc = layer.blobs[j].diff
            for p in parts:
                acc += p[j].reshape(acc.shape)
        with self._agg_lock:
            self.stats.aggregation_s += time.perf_counter() - t0
            self.stats.aggregations += 1

    @staticmethod
    def _param_keys(layer: Layer, wanted: list[int]) -> frozenset[int]:
        """Identities of the memory behind the param diffs (shared params have the owner's)."""
        keys = set()
        for j in wanted:
            a = layer.blobs[j].diff
            while getattr(a, "base", None) is not None:
                a = a.base
            keys.add(id(a))
        return frozenset(keys)

    def _wait_keys(self, keys: frozenset[int]) -> None:
        if not keys:
            return
        for i in [i for i, (_, k) in self._pending.items() if k & keys]:
            self._pending.pop(i)[0].result()

    def _wait_layer(self, i: int) -> None:
        entry = self._pending.pop(i, None)
        if entry is not None:
            entry[0].result()

    def drain(self) -> float:
        """Wait for every pending aggregation; returns the seconds waited."""
        t0 = time.perf_counter()
        pending, self._pending = self._pending, {}
        errors = []
        for f, _ in pending.values():
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)
        if errors:
            raise errors[0]
        return time.perf_counter() - t0

    def finish_backward(self) -> None:
        """Called by ``Net.backward``: wait until all partial gradients are in the master diffs."""
        waited = self.drain()
        self.stats.aggregation_wait_s += waited
        self.stats.iterations += 1

    # -- model parallelism (InnerProduct by output channels) --------------------------------
    def _use_model_parallel(self, layer: Layer, top: Sequence[Blob]) -> bool:
        """InnerProduct split by output channels instead of by batch?

        Splitting by batch makes every device compute (and the host add up) a full-size weight
        gradient: memory-bound work proportional to the weights. Splitting the outputs gives
        each device its rows of the weights and of their gradient (no aggregation) and costs a
        sum of the bottom gradient (batch x inputs). ``auto`` picks it when the outputs
        outnumber the batch (CaffeNet's fc layers at any usual batch), on host-memory devices.
        """
        if layer.type != "InnerProduct" or self.model_parallel == "never" or len(self.devices) < 2:
            return False
        if any(d.memory.is_gpu for d in self.devices) or len(top[0].shape) != 2:
            return False
        if self.model_parallel == "always":
            return True
        return layer.num_output >= max(2 * len(self.devices), layer.M)

    def _forward_model(self, i: int, layer: Layer, d: int, o0: int, o1: int, bottom: Sequence[Blob],
                       top: Sequence[Blob]) -> None:
        key = (i, d)
        entry = self._mp_shadows.get(key)
        b, t = bottom[0], top[0]
        if entry is None or entry[0] != (o0, o1):
            lp = caffe_pb2.LayerParameter()
            lp.CopyFrom(layer.param)
            del lp.blobs[:]
            lp.inner_product_param.num_output = o1 - o0
            shadow = create_layer(lp)
            shadow.phase = layer.phase
            shadow.blobs = [Blob((), dtype=mb.dtype, name=mb.name) for mb in layer.blobs]
            sb, st = Blob((), dtype=b.dtype, name=b.name), Blob((), dtype=t.dtype, name=t.name)
            entry = ((o0, o1), shadow, sb, st, None)
            self._bind_model(layer, entry, b, t)
            shadow.setup([sb], [st])
            self._mp_shadows[key] = entry
        else:
            self._bind_model(layer, entry, b, t)
        _, shadow, sb, st, _ = entry
        shadow.reshape([sb], [st])
        shadow.forward([sb], [st])

    def _bind_model(self, layer: Layer, entry: tuple, b: Blob, t: Blob) -> None:
        """Point a model-parallel shadow at rows [o0, o1) of the weights/bias/top (views)."""
        (o0, o1), shadow, sb, st, _ = entry
        wsel = (slice(None), slice(o0, o1)) if layer.transpose else (slice(o0, o1),)
        for j, (mb, pb) in enumerate(zip(layer.blobs, shadow.blobs)):
            sel = wsel if j == 0 else (slice(o0, o1),)
            src = _Arrays(mb.data[sel], mb.diff[sel])
            pb.share_data(src)
            pb.share_diff(src)
        sb.share_data(b)
        tsrc = _Arrays(t.data[..., o0:o1], t.diff[..., o0:o1])
        st.share_data(tsrc)
        st.share_diff(tsrc)

    def _backward_model(self, i: int, layer: Layer, top: Sequence[Blob], propagate_down: Sequence[bool],
                        bottom: Sequence[Blob]) -> None:
        ranges = self._model[i]
        need_dx = bool(propagate_down[0])
        primary = ranges[0][0]

        def job(d: int, o0: int, o1: int) -> Any:
            (_, _), shadow, sb, st, own = self._mp_shadows[(i, d)]
            self._bind_model(layer, self._mp_shadows[(i, d)], bottom[0], top[0])
            shadow.param_propagate_down = list(layer.param_propagate_down)
            if need_dx:
                if d == primary:
                    sb.share_diff(bottom[0])
                else:
                    if own is None or own.shape != bottom[0].shape:
                        own = np.empty(bottom[0].shape, dtype=bottom[0].dtype)
                        e = self._mp_shadows[(i, d)]
                        self._mp_shadows[(i, d)] = (e[0], e[1], e[2], e[3], own)
                    sb.share_diff(_Arrays(own, own))
            shadow.backward([st], [need_dx], [sb])
            return own

        parts = self._run([(self.devices[d], (job, d, a, b)) for d, a, b in ranges], serial=False)
        if need_dx:
            acc = bottom[0].diff
            for (d, _, _), part in zip(ranges, parts):
                if d != primary:
                    acc += part

    # -- helpers -------------------------------------------------------------------------
    def _run(self, jobs: list[tuple[Device, tuple]], serial: bool) -> list[Any]:
        """Run each ``(device, (fn, *args))``; parallel unless ``serial``; re-raise the first error."""
        if serial:
            return [dev.run(*job) for dev, job in jobs]
        if len(jobs) == 1:  # still on the device's thread: its BLAS settings apply there
            dev, job = jobs[0]
            return [dev.run(*job)]
        futs = [dev.submit(*job) for dev, job in jobs]
        cf.wait(futs)
        return [f.result() for f in futs]

    def _view(self, d: int, master: Blob, s0: int, s1: int, upload_data: bool = False,
              upload_diff: bool = False) -> Blob:
        """The device-``d`` blob for rows ``[s0, s1)`` of ``master`` (one object per master blob)."""
        dev = self.devices[d]
        cache = self._views[d]
        v = cache.get(id(master))
        if v is None:
            v = Blob((), dtype=master.dtype, device=dev.memory, name=master.name)
            cache[id(master)] = v
        if not dev.memory.is_gpu:
            src = _Arrays(master.data[s0:s1], master.diff[s0:s1])
            v.share_data(src)
            v.share_diff(src)
        else:
            v.reshape((s1 - s0,) + tuple(master.shape[1:]))
            if upload_data:
                dev.memory.upload(master.data[s0:s1], out=v.data)
            if upload_diff:
                dev.memory.upload(master.diff[s0:s1], out=v.diff)
        return v

    def _shadow(self, i: int, layer: Layer, d: int, sb: list[Blob], st: list[Blob]) -> Layer:
        key = (i, d)
        shadow = self._shadows.get(key)
        if shadow is None:
            lp = caffe_pb2.LayerParameter()
            lp.CopyFrom(layer.param)
            del lp.blobs[:]
            shadow = create_layer(lp)
            shadow.phase = layer.phase
            shadow.random = layer.random  # serial slices draw on from the master's stream, in order
            dev = self.devices[d]
            # Param blobs given up front: setup validates them and draws nothing from the RNG.
            shadow.blobs = [Blob(mb.shape, dtype=mb.dtype, device=dev.memory, name=mb.name) for mb in layer.blobs]
            self._bound[key] = [None] * len(layer.blobs)
            self._sync_params(i, layer, d, shadow)
            shadow.setup(sb, st)
            self._shadows[key] = shadow
        return shadow

    def _sync_params(self, i: int, layer: Layer, d: int, shadow: Layer) -> None:
        """CPU: bind the shadow's param data to the master arrays; GPU: upload them."""
        dev = self.devices[d]
        bound = self._bound[(i, d)]
        for j, (mb, pb) in enumerate(zip(layer.blobs, shadow.blobs)):
            if not dev.memory.is_gpu:
                if bound[j] is not mb.data:
                    pb.share_data(mb)  # a view: master updates are seen without copies (own diff)
                    bound[j] = mb.data
            else:
                if pb.shape != mb.shape:
                    pb.reshape(mb.shape)
                dev.memory.upload(mb.data, out=pb.data)


def _pin_lowering(layer: Layer, shadow: Layer) -> None:
    """Conv shadows: the master's lowering when the user set it by hand (else the engine plans one
    for the slice's batch size), and never more than one batch partition: the scheduler is the
    partitioner here, and a partitioned lowering would change OpenBLAS's process-wide thread
    count from several device threads at once."""
    if not isinstance(getattr(type(shadow), "lowering", None), property):
        return
    if getattr(layer, "lowering_set_by_user", False):
        src = layer.lowering
        if getattr(shadow, "_cct_lowering_src", None) is not src:
            shadow.lowering = copy.copy(src)
            shadow._cct_lowering_src = src
    lowering = shadow.lowering
    if getattr(lowering, "partitions", 1) != 1:
        lowering.partitions = 1
        shadow.prepare_lowering()
