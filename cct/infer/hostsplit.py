"""GPU + host RAM (ZNNi section VII-B): a convolution run on a device in sub-layers, its activations in host RAM.

When a layer's input and output activations and workspace do not fit the device's memory, ZNNi keeps them in
host RAM and splits the layer into sub-layers over ``(S_i, f_i, f'_i)``: ``S_i`` samples (fragments of the
batch), ``f_i`` input maps and ``f'_i`` output maps. Each sub-layer uploads its input slice and weight slice,
convolves on the device and adds into an output slice kept on the device across the ``f_i`` blocks (the sum
over input maps; the bias is added once), which is then downloaded into the host output.

:func:`choose_split` picks the blocks of one layer (divisors of the batch and channel counts, so every
sub-layer has one shape) that fit the device budget with the fewest bytes moved between host and device;
:func:`choose_splits` picks them for every layer so that what the layers hold on the device together fits:
the layers run one after another and share one device buffer for their slices and one type 1 lowering for its
work buffers (:class:`SplitMemory`: the largest layer's of each), and each keeps its biases there.
:class:`SplitConvolution` runs a layer that way, through the :class:`cct.device.driver.Device` only (on the
CPU a :class:`~cct.device.driver.HostDevice` plays the device: same code, same sub-layers).
"""
from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..blob import Blob
from ..device.driver import Device
from ..errors import CctError, MemoryBudgetError
from ..layers.base import create_layer
from ..lowering.cost_model import workspace_bytes
from ..lowering.geometry import ConvGeometry
from ..lowering.partition import BatchedLowering
from ..lowering.type1 import Type1Lowering
from ..membudget import human


@dataclass(frozen=True)
class SplitPlan:
    """One convolution's sub-layers: block sizes of the batch, input and output maps; predicted device bytes
    (peak of one sub-layer) and bytes moved between host and device per forward pass."""

    layer: str
    batch: int
    channels_in: int
    channels_out: int
    samples: int
    maps_in: int
    maps_out: int
    device_bytes: int
    transfer_bytes: int
    workspace_bytes: int = 0  # of the device bytes: type 1's work buffers (the rest: the slices)

    @property
    def sub_layers(self) -> int:
        """The number of sub-layers one forward pass runs."""
        return (self.batch // self.samples) * (self.channels_in // self.maps_in) * \
            (self.channels_out // self.maps_out)

    @property
    def split(self) -> bool:
        """Whether the layer runs as more than one sub-layer."""
        return self.sub_layers > 1

    def describe(self) -> str:
        """One line of the printed plan."""
        how = (f"split into {self.sub_layers} sub-layers (S={self.samples}/{self.batch}, f={self.maps_in}/"
               f"{self.channels_in}, f'={self.maps_out}/{self.channels_out})" if self.split else "one sub-layer")
        return (f"{self.layer}: on the device, {how}; device {human(self.device_bytes)}, "
                f"{human(self.transfer_bytes)} moved per pass")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def sub_geometry(cg: ConvGeometry, maps_in: int, maps_out: int) -> ConvGeometry:
    """The geometry of a sub-layer of ``cg`` over ``maps_in`` input and ``maps_out`` output maps (no bias: the
    bias is added once to the summed output)."""
    return dataclasses.replace(cg, channels_in=maps_in, channels_out=maps_out, bias_term=False)


def split_costs(cg: ConvGeometry, batch: int, samples: int, maps_in: int, maps_out: int,
                itemsize: int) -> tuple[int, int]:
    """``(device bytes, transfer bytes)`` of the blocks ``(samples, maps_in, maps_out)`` of ``cg`` on ``batch``:
    the device holds the input slice, the weight slice, the sub-layer's output (and the running sum when the
    input maps are split) and type 1's workspace; per pass every input slice is uploaded once per output block,
    every weight slice once per sample block, and every output slice downloaded once."""
    device = sum(split_bytes(cg, samples, maps_in, maps_out, itemsize))
    return device, transfer_bytes(cg, batch, samples, maps_out, itemsize)


def split_bytes(cg: ConvGeometry, samples: int, maps_in: int, maps_out: int, itemsize: int) -> tuple[int, int]:
    """``(slices, workspace)``: device bytes of a sub-layer's slices (input, weights, output, running sum) and
    of type 1's work buffers."""
    nin = cg.channels_in // maps_in
    weights = maps_out * (maps_in // cg.group) * cg.kernel_size  # grouped: maps_in is every input map
    out = samples * maps_out * cg.out_size
    slices = itemsize * (samples * maps_in * cg.in_size + weights + out * (2 if nin > 1 else 1))
    return slices, workspace_bytes("type1", sub_geometry(cg, maps_in, maps_out), samples, itemsize)


def transfer_bytes(cg: ConvGeometry, batch: int, samples: int, maps_out: int, itemsize: int) -> int:
    """Bytes moved between host and device by one pass (see :func:`split_costs`)."""
    return itemsize * (batch * cg.channels_in * cg.in_size * (cg.channels_out // maps_out)
                       + cg.channels_out * (cg.channels_in // max(cg.group, 1)) * cg.kernel_size
                       * (batch // samples) + batch * cg.channels_out * cg.out_size)


def choose_split(name: str, cg: ConvGeometry, batch: int, budget: int | None, itemsize: int) -> SplitPlan:
    """The blocks of ``cg`` on ``batch`` that fit ``budget`` device bytes with the fewest bytes moved (then
    the fewest sub-layers); one sub-layer when ``budget`` is None or it fits. A grouped convolution is split
    over samples only. Raises :class:`MemoryBudgetError` when not even one sample and one map fits."""
    grouped = cg.group > 1
    best = None
    for s in _divisors(batch):
        for fi in ([cg.channels_in] if grouped else _divisors(cg.channels_in)):
            for fo in ([cg.channels_out] if grouped else _divisors(cg.channels_out)):
                dev, moved = split_costs(cg, batch, s, fi, fo, itemsize)
                if budget is not None and dev > budget:
                    continue
                count = (batch // s) * (cg.channels_in // fi) * (cg.channels_out // fo)
                key = (moved, count, -dev)
                if best is None or key < best[0]:
                    ws = split_bytes(cg, s, fi, fo, itemsize)[1]
                    best = (key, SplitPlan(name, batch, cg.channels_in, cg.channels_out, s, fi, fo, dev, moved, ws))
    if best is None:
        smallest = split_costs(cg, batch, 1, 1 if not grouped else cg.channels_in,
                               1 if not grouped else cg.channels_out, itemsize)[0]
        raise MemoryBudgetError(f"layer '{name}': even its smallest sub-layer needs {human(smallest)} of device "
                                f"memory; the device budget is {human(budget)}")
    return best[1]


def shared_peak(plans: Sequence[SplitPlan], bias_bytes: int) -> int:
    """Device bytes of layers that share a :class:`SplitMemory`: the largest slices, the largest workspace and
    every layer's biases."""
    slices = max((p.device_bytes - p.workspace_bytes for p in plans), default=0)
    return slices + max((p.workspace_bytes for p in plans), default=0) + bias_bytes


def choose_splits(layers: Sequence[tuple[str, ConvGeometry, int]], budget: int | None,
                  itemsize: int) -> tuple[list[SplitPlan], int]:
    """``(plans, device peak)``: :func:`choose_split` for each ``(name, geometry, batch)`` so that the layers
    together (:func:`shared_peak`) fit ``budget``: each layer's share shrinks by the excess until they do."""
    bias = sum(itemsize * cg.channels_out for _n, cg, _b in layers if cg.bias_term)
    each = None if budget is None else budget - bias
    for _ in range(32):
        if each is not None and each <= 0:
            break
        plans = [choose_split(name, cg, batch, each, itemsize) for name, cg, batch in layers]
        peak = shared_peak(plans, bias)
        if budget is None or peak <= budget:
            return plans, peak
        each -= peak - budget
    raise MemoryBudgetError(f"the convolutions' sub-layers do not fit the device budget of {human(budget or 0)} "
                            f"together (their biases alone take {human(bias)})")


class SplitMemory:
    """The device memory the split convolutions of one patch runner share (they run one after another): one
    flat buffer as large as the largest layer's slices, and one type 1 lowering whose work buffers grow to
    the largest layer's."""

    def __init__(self, device: Device, elements: int, dtype) -> None:
        self.device = device
        self.flat = device.empty(max(1, int(elements)), dtype)
        self.lowering = Type1Lowering()

    def views(self, shapes: Sequence[tuple[int, ...]]) -> list:
        """Consecutive views of the flat buffer of ``shapes``, from its start."""
        out, at = [], 0
        for shape in shapes:
            n = math.prod(shape)
            out.append(self.flat[at:at + n].reshape(shape))
            at += n
        return out


def slice_shapes(plan: SplitPlan, bottom_shape: Sequence[int], top_shape: Sequence[int],
                 weight_shape: Sequence[int], group: int) -> list[tuple[int, ...]]:
    """Shapes of a sub-layer's input, weight, output (and running-sum, when the input maps are split) slices."""
    out = (plan.samples, plan.maps_out) + tuple(top_shape[2:])
    shapes = [(plan.samples, plan.maps_in) + tuple(bottom_shape[2:]),
              (plan.maps_out, plan.maps_in // group) + tuple(weight_shape[2:]), out]
    return shapes + ([out] if plan.channels_in // plan.maps_in > 1 else [])


class SplitConvolution:
    """Runs the host convolution layer ``layer`` (its bottom and top in host RAM) on ``device`` in the
    sub-layers of ``plan`` (see the module docstring), its slices in ``memory``'s buffer. The sub-layer and the
    bias on the device are made here; :meth:`forward` only copies and computes."""

    def __init__(self, layer, plan: SplitPlan, memory: SplitMemory, bottom: Blob, top: Blob) -> None:
        device = memory.device
        self.layer, self.plan, self.device = layer, plan, device
        lp = copy.deepcopy(layer.param)
        cp = lp.convolution_param
        cp.num_output = plan.maps_out
        cp.bias_term = False
        cp.weight_filler.Clear()
        cp.weight_filler.type = "constant"
        del lp.blobs[:]
        del lp.param[:]
        lp.name = f"{lp.name}/sub"
        spatial_in = tuple(bottom.shape[2:])
        dtype = bottom.dtype
        views = memory.views(slice_shapes(plan, bottom.shape, top.shape, layer.blobs[0].shape, cp.group or 1))
        self.sub_bottom = Blob((), dtype=dtype, device=device, name=f"{lp.name}/in")
        self.sub_top = Blob((), dtype=dtype, device=device, name=f"{lp.name}/out")
        self.sub_bottom.bind_data(views[0])
        self.sub_top.bind_data(views[2])
        self.sub = create_layer(lp)
        self.sub.checks = layer.checks
        self.sub.random_source = layer.random_source
        self.sub.setup([self.sub_bottom], [self.sub_top])
        self.weights = self.sub.blobs[0]
        self.weights.bind_data(views[1])
        # type 1 over the whole sub-batch (what a device layer runs by default, and what the plan priced), its
        # work buffers shared with the other split layers
        self.sub.lowering = BatchedLowering(memory.lowering, batch_partition=plan.samples, partitions=1)
        self.sub.reshape([self.sub_bottom], [self.sub_top])
        if self.sub_top.data is not views[2]:  # pragma: no cover (shapes come from the same plan)
            raise CctError(f"internal: layer '{lp.name}' left its device slice")
        self.acc = views[3] if len(views) > 3 else None
        self.bias = None
        if len(layer.blobs) > 1:
            b = layer.blobs[1].data.reshape((1, -1) + (1,) * len(spatial_in))
            self.bias = device.upload(b)  # all output maps' biases: a few bytes, uploaded once

    def bias_bytes(self) -> int:
        """Bytes of the bias this layer keeps on the device (its slices are the shared buffer's)."""
        return int(self.bias.nbytes) if self.bias is not None else 0

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        """``top[0] = conv(bottom[0])`` by sub-layers: upload, convolve, sum over input blocks, download."""
        p, dev = self.plan, self.device
        x, y = bottom[0].data, top[0].data
        w = self.layer.blobs[0].data
        for s0 in range(0, p.batch, p.samples):
            rows = slice(s0, s0 + p.samples)
            for o0 in range(0, p.channels_out, p.maps_out):
                outs = slice(o0, o0 + p.maps_out)
                for k, i0 in enumerate(range(0, p.channels_in, p.maps_in)):
                    ins = slice(i0, i0 + p.maps_in)
                    dev.upload(x[rows, ins], out=self.sub_bottom.data)
                    dev.upload(w[outs, ins], out=self.weights.data)
                    self.sub.forward([self.sub_bottom], [self.sub_top])
                    if self.acc is not None:
                        if k == 0:
                            self.acc[...] = self.sub_top.data
                        else:
                            self.acc += self.sub_top.data
                total = self.acc if self.acc is not None else self.sub_top.data
                if self.bias is not None:
                    total += self.bias[:, outs]
                dev.download(total, out=y[rows, outs])
