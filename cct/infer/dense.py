"""Dense output of a net on one input patch: max-pooling fragments, shifted runs, or the net's strided output.

:class:`PatchRunner` runs a built :class:`cct.Net` layer by layer on a fixed input patch. Each pooling
layer runs either as max-pooling fragments (``mpf[i]``; :mod:`cct.infer.fragments`) or as the net's
own strided pooling. Output position ``x`` of the dense output then has one digit per pooling layer
(``x = d_1 + p_1 (d_2 + p_2 (... + p_L g))``): an MPF layer supplies its digit through its fragment
offset, a plain one through a shift of the input. So the runner makes ``prod`` (windows of the plain
pooling layers) runs, each on the input shifted by those digits, and writes each fragment of each run
to its strided place in the output. With every pooling layer as MPF that is one run (ZNNi); with none
it is ``prod(p)`` runs of the plain net (patch inference without MPF). ``method="strided"`` makes one
run of the plain net and returns its own strided output (every ``stride``-th window position).

Shapes are fixed at construction (the convolutions plan their lowering then, for the batch sizes the
fragments create); :meth:`PatchRunner.run` only computes. The activations (every blob's data and the MPF
layers' stride-1 buffers) live in one pool allocated at construction, a slot reused once the last layer
reading it has run (:mod:`cct.infer.buffers`), and the direct and FFT convolutions share one set of buffers
(:class:`cct.lowering.direct_layout.SharedScratch`); ``reuse=False`` gives every blob and layer its own.

On a net built on a GPU every buffer, the patch and the output live in device memory (the array module
``xp`` of the net's blobs). ``splits`` (GPU + host RAM, :mod:`cct.infer.hostsplit`) runs the named
convolutions of a host net on ``device`` in sub-layers instead.
"""
from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import numpy as np

from ..config import runs_in_own_config
from ..device.driver import Device
from ..errors import CctError, LayerError
from ..lowering.direct_layout import SharedScratch
from ..lowering.partition import BatchedLowering, PartitionWorkers
from ..lowering.type1 import Type1Lowering
from .buffers import SlotPlan, plan_slots, stage_key, storage_roots
from .fragments import FragmentPooling
from .geometry import NetGeometry
from .hostsplit import SplitConvolution, SplitMemory, SplitPlan, slice_shapes

METHODS = ("mpf", "shift", "strided")


def _prod(values: Sequence[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


class PatchRunner:
    """Runs ``net`` on input patches of one shape and returns their dense (or strided) output.

    ``grid``: output voxels per fragment and axis (the patch shape follows from it and ``mpf``);
    ``mpf``: per pooling layer, fragments (True) or plain strided pooling (False); ``method``: ``"mpf"``
    or ``"shift"`` (dense output; ``"shift"`` forces every ``mpf`` False) or ``"strided"``.
    ``blob``: the output blob (default the net's last output); ``reuse``: activation buffers reused across
    layers (default); ``theta``: the two-stage pipeline's split (:mod:`cct.infer.stages`; 0: one stage), whose
    stages then get separate buffers since they run at the same time. ``splits``: convolutions (by layer
    name) run on ``device`` in sub-layers with their activations in host RAM (:mod:`cct.infer.hostsplit`).
    ``strategies``: the lowering of each named convolution (the plan's: the layers are planned and run under
    the net's config with these as its lowering overrides).
    """

    def __init__(self, net, geom: NetGeometry, grid: Sequence[int], mpf: Sequence[bool] | None = None,
                 method: str = "mpf", blob: str | None = None, reuse: bool = True, theta: int = 0,
                 splits: Sequence[SplitPlan] = (), device: Device | None = None,
                 strategies: Mapping[str, str] | None = None) -> None:
        if method not in METHODS:
            raise CctError(f"unknown dense-inference method '{method}' (use {', '.join(METHODS)})")
        npool = len(geom.pools)
        if method != "mpf":
            mpf = (False,) * npool
        elif mpf is None:
            mpf = (True,) * npool
        if len(mpf) != npool:
            raise CctError(f"mpf has {len(mpf)} entries for {npool} pooling layers")
        self.net, self.geom, self.method = net, geom, method
        overrides = {**net.config.engine.overrides, **(strategies or {})}
        self.config = net.config.replace(engine={"overrides": overrides}) if strategies else net.config
        self.reuse, self.theta = bool(reuse), int(theta)
        if self.theta and not 1 <= self.theta < len(geom.ops):
            raise CctError(f"pipeline theta {theta}: the net has {len(geom.ops)} convolution/pooling layers, so theta "
                           f"must be 1..{len(geom.ops) - 1}")
        self.mpf = tuple(bool(m) for m in mpf)
        self.splits = {sp.layer: sp for sp in splits}
        if self.splits and (device is None or net.device.is_gpu):
            raise CctError("sub-layers on a device (GPU + host RAM) need a host net and the device to run them on")
        self.device = device if device is not None else net.device
        self.grid = tuple(int(g) for g in grid)
        self.blob = blob or geom.output_blob
        if not net.has_blob(self.blob):
            raise CctError(f"the net has no blob '{self.blob}' (outputs: {', '.join(net.output_blob_names)})")
        nd = geom.num_spatial
        self.stride = geom.stride
        self.fov = geom.field_of_view
        self.run_shape = geom.input_size(self.grid, self.mpf)
        self.shifts, self.frag_starts = self._digits()
        if method == "strided":
            self.out_step = self.stride  # input voxels between two output voxels
            self.out_shape = self.grid
            self.patch_shape = self.run_shape
        else:
            self.out_step = (1,) * nd
            self.out_shape = tuple(g * s for g, s in zip(self.grid, self.stride))
            self.patch_shape = tuple(o + f - 1 for o, f in zip(self.out_shape, self.fov))
        if method == "strided":
            self.shifts = [(0,) * nd]
        last = [max(s[a] for s in self.shifts) + self.run_shape[a] for a in range(nd)]
        if any(x > n for x, n in zip(last, self.patch_shape)):  # pragma: no cover (geometry invariant)
            raise CctError(f"internal: shifted runs {last} exceed the patch {list(self.patch_shape)}")
        self._setup()

    # -- setup ------------------------------------------------------------------------
    def _digits(self) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        """Input shifts (digits of the plain pooling layers) and each output fragment's offset (MPF digits)."""
        nd = self.geom.num_spatial
        radix = [1] * nd
        shifts = [(0,) * nd]
        starts = [(0,) * nd]
        for op, frag in zip(self.geom.pools, self.mpf):
            offsets = itertools.product(*(range(p) for p in op.size))
            digits = [tuple(o * r for o, r in zip(off, radix)) for off in offsets]
            if frag:  # offset outermost in the batch, as FragmentPooling folds it
                starts = [tuple(a + b for a, b in zip(d, s)) for d in digits for s in starts]
            else:
                shifts = [tuple(a + b for a, b in zip(d, s)) for d in digits for s in shifts]
            radix = [r * p for r, p in zip(radix, op.size)]
        return shifts, starts

    def _bind_pool(self) -> dict:
        """Allocate the activation pool and bind every storage's blob to its slot (before any layer reshapes,
        so no blob allocates an array of its own); the views by storage key."""
        net, geom = self.net, self.geom
        split = geom.ops[self.theta].layer if self.theta else None
        self.slots, _steps, shape_of = plan_slots(net, geom, self.run_shape, self.mpf, self.blob, split)
        inp = net.blobs[geom.input_blob]
        self.pool = [inp.xp.zeros(n, dtype=net.dtype) for n in self.slots.sizes]
        views = {}
        for key, slot in self.slots.slot_of.items():
            shape = shape_of[key]
            count = 1
            for d in shape:
                count *= d
            views[key] = self.pool[slot][:count].reshape(shape)
        for name, root in storage_roots(net).items():
            if root == name and name in views:
                net.blobs[name].bind_data(views[name])
        return views

    @runs_in_own_config
    def _setup(self) -> None:
        net, geom = self.net, self.geom
        inp = net.blobs[geom.input_blob]
        shape = tuple(inp.shape)
        self.slots = SlotPlan()
        self.pool: list = []
        self.scratch: SharedScratch | None = None  # the direct and FFT convolutions' shared buffers (with reuse)
        self.split_memory: SplitMemory | None = None  # GPU + host RAM: the split convolutions' device buffer
        views = self._bind_pool() if self.reuse else {}
        inp.reshape((1, shape[1]) + self.run_shape)
        pools = {op.layer: (op, i) for i, op in enumerate(geom.pools)}
        self.steps: list[tuple[int, object, list, list]] = []
        offload: list[tuple[int, SplitPlan]] = []
        for i, layer in enumerate(net.layers):
            lp = net.param.layer[i]
            if lp.type == "Input":
                continue
            bottom, top = net.bottom_vecs[i], net.top_vecs[i]
            runner: object = layer
            if i in pools and self.mpf[pools[i][1]]:
                runner = FragmentPooling(lp, pools[i][0].size, bottom[0])
                if views:
                    runner.stages = [views[stage_key(i, a)] for a in range(geom.num_spatial)]
            split = self.splits.get(lp.name)
            try:
                if isinstance(runner, FragmentPooling):
                    runner.reshape(bottom[0], top[0])
                else:
                    layer.reshape(bottom, top)
            except LayerError:
                raise
            except (CctError, ValueError) as e:
                raise LayerError(lp.name, lp.type, f"patch {list(self.run_shape)}: {e}") from e
            if split is not None:
                if (split.batch, split.channels_in) != tuple(bottom[0].shape[:2]):
                    raise LayerError(lp.name, lp.type, f"sub-layer plan for a batch of {split.batch} x "
                                     f"{split.channels_in} maps; the layer's input is {list(bottom[0].shape)}")
                offload.append((len(self.steps), split))
            self.steps.append((i, runner, bottom, top))
        if offload:
            self._offload(offload)
        if self.reuse:
            self._share_conv_scratch()
            if net.device.is_gpu:
                self._share_device_work()
        for name, view in views.items():
            if isinstance(name, str) and net.blobs[name].data is not view:  # pragma: no cover (a layer reallocated)
                raise CctError(f"internal: blob '{name}' left its activation buffer during setup")
        out = net.blobs[self.blob]
        nfrag = len(self.frag_starts)
        if out.shape[0] != nfrag or tuple(out.shape[2:]) != self.grid:
            raise CctError(f"blob '{self.blob}' has shape {list(out.shape)}; expected {nfrag} fragments of "
                           f"{list(self.grid)} voxels (is it after the last convolution?)")
        self.channels = int(out.shape[1])

    def _offload(self, offload: Sequence[tuple[int, SplitPlan]]) -> None:
        """Run the convolutions of ``offload`` (step, plan) on the device in sub-layers; they run one after
        another, so their slices share one device buffer, the largest layer's (:class:`SplitMemory`)."""
        def shapes(k: int, sp: SplitPlan) -> list[tuple[int, ...]]:
            _i, layer, bottom, top = self.steps[k]
            group = layer.param.convolution_param.group or 1
            return slice_shapes(sp, bottom[0].shape, top[0].shape, layer.blobs[0].shape, group)

        elements = max(sum(_prod(s) for s in shapes(k, sp)) for k, sp in offload)
        self.split_memory = SplitMemory(self.device, elements, self.net.dtype)
        for k, sp in offload:
            i, layer, bottom, top = self.steps[k]
            self.steps[k] = (i, SplitConvolution(layer, sp, self.split_memory, bottom[0], top[0]), bottom, top)

    def _share_device_work(self) -> None:
        """On a GPU: one type 1 lowering for the convolutions that run it (what a device layer runs by default),
        so its cached work buffers are the largest layer's rather than one set per layer (the planner's
        ``"gpu"`` peak counts the largest); the layers run one after another."""
        shared = Type1Lowering()
        for _i, runner, _b, _t in self.steps:
            low = getattr(runner, "lowering", None)
            if isinstance(low, BatchedLowering) and isinstance(low.inner, Type1Lowering):
                runner.lowering = BatchedLowering(shared, batch_partition=low.batch_partition, partitions=1,
                                                  plan_report=low.plan_report)

    def _share_conv_scratch(self) -> None:
        """One set of convolution buffers (the direct kernels' padded input and blocked output, FFT's transform
        buffers) and of partition threads for all the layers instead of one per layer: they run one after another
        (a pipeline's stages run on two threads, whose buffers differ)."""
        shared = self.scratch = SharedScratch()
        workers = PartitionWorkers()  # and one set of partition threads: the buffers are kept per thread
        for _i, runner, _b, _t in self.steps:
            lowering = getattr(runner, "lowering", None)
            inner = getattr(lowering, "inner", lowering)
            if hasattr(inner, "share_scratch"):
                inner.share_scratch(shared)
            if isinstance(lowering, BatchedLowering):
                lowering.share_workers(workers)

    # -- running ------------------------------------------------------------------------
    def check_patch(self, patch: np.ndarray) -> None:
        """Refuse a patch whose shape is not ``(C_in, *patch_shape)``."""
        inp = self.net.blobs[self.geom.input_blob]
        if tuple(patch.shape[1:]) != self.patch_shape or patch.shape[0] != inp.shape[1]:
            raise CctError(f"patch of shape {list(patch.shape)}; expected {[inp.shape[1], *self.patch_shape]}")

    def new_output(self):
        """An (uninitialised) dense output array of one patch, in the net's memory (a GPU's for a GPU net)."""
        return self.net.blobs[self.geom.input_blob].xp.empty((self.channels,) + self.out_shape, dtype=self.net.dtype)

    def split_runners(self) -> list[SplitConvolution]:
        """The convolutions that run on the device in sub-layers (GPU + host RAM)."""
        return [r for _i, r, _b, _t in self.steps if isinstance(r, SplitConvolution)]

    def load(self, patch: np.ndarray, shift: Sequence[int]) -> None:
        """Copy the window of ``patch`` at ``shift`` (one run's input) into the net's input blob."""
        window = tuple(slice(s, s + n) for s, n in zip(shift, self.run_shape))
        self.net.blobs[self.geom.input_blob].data[0] = patch[(slice(None),) + window]

    @runs_in_own_config
    def forward(self, steps: Sequence[tuple[int, object, list, list]]) -> None:
        """Run ``steps`` (layer index, layer or fragment pooling, bottoms, tops) in order (on any thread)."""
        for _i, runner, bottom, top in steps:
            if isinstance(runner, FragmentPooling):
                runner.forward(bottom[0], top[0])
            else:
                runner.forward(bottom, top)

    def place(self, result: np.ndarray, shift: Sequence[int], out: np.ndarray) -> None:
        """Write one run's output ``result`` (fragments in the batch) to its strided places in ``out``."""
        if self.method == "strided":
            out[...] = result[0]
            return
        for b, start in enumerate(self.frag_starts):
            place = tuple(slice(s + st, s + st + g * p, p)
                          for s, st, g, p in zip(shift, start, self.grid, self.stride))
            out[(slice(None),) + place] = result[b]

    def run(self, patch: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Dense output ``(C_out, *out_shape)`` of one input patch ``(C_in, *patch_shape)``."""
        self.check_patch(patch)
        if out is None:
            out = self.new_output()
        top = self.net.blobs[self.blob]
        for shift in self.shifts:
            self.load(patch, shift)
            self.forward(self.steps)
            self.place(top.data, shift, out)
        return out
