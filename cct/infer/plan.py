"""Choosing the input patch and max-pooling fragments under the memory budget (ZNNi, section VI-A).

For every choice of MPF or plain pooling per pooling layer and every patch size (the grid of output voxels per
fragment, the same on every axis, capped by the volume), the planner walks the net without allocating
anything: each blob's shape (batch = fragments so far), each convolution's fastest lowering by cct's optimizer
and cost model (:func:`cct.lowering.optimizer.predictions` of the forward pass, chunk-aware, priced at the
batch the fragments create; FFT without its weights' transform, made once for the fixed weights; the fastest
whose buffers fit the budget beside the activations and the layers before it, else the leanest), its predicted
seconds and workspace; the layers then run the plan's lowerings (:meth:`InferencePlan.strategies`). It keeps
the candidate with the most predicted output voxels per second whose predicted peak memory fits the budget.

Predicted peak bytes = the activation pool: every blob's data and the per-axis stride-1 pooling buffers of each
MPF layer in slots reused once their last reader has run, the same slot plan the runner allocates
(:func:`cct.infer.buffers.plan_slots`; a forward-only net never allocates a diff: :class:`cct.Blob` does on
first use), the buffers the direct and FFT convolutions take from the layers' shared scratch (one buffer per
role and thread, as large as the largest request, :func:`scratch_buffers`; a layer that splits its batch over
``p`` threads holds ``p`` sets, each sized for its chunk, :func:`partition_chunks`), what each layer keeps (FFT:
its weights' spectrum, :func:`conv_memory`) plus the largest transient (a lowered GEMM's workspace or a
per-voxel layer's temporaries, :func:`elementwise_temporaries`), the index array MAX pooling keeps, the input
patch and the output tile. Predicted time = the convolutions' forward passes times the number of shifted runs
(plain pooling layers need one run per offset), plus one streaming pass over each blob.

``target`` (ZNNi section VII): ``"host"`` (the above); ``"gpu"``: the net lives on a GPU, every convolution
runs type 1 over its whole batch there (what a device layer runs by default) and the peak is of device bytes
(activations, type 1's workspace, the uploaded patch and the output tile) against the device's budget;
``"gpu+host"``: the activations stay in host RAM (the peak and ``budget`` are the host's) and every
convolution runs on the device in the sub-layers :func:`cct.infer.hostsplit.choose_split` picks under
``device_budget`` (``InferencePlan.splits``; ``device_peak_bytes`` the largest sub-layer); ``"cpu-gpu"``: the
CPU-GPU pipeline (:func:`with_pipeline` with ``device_speedup``: the first theta layers on all the host's threads,
the rest on the device, priced as the host's seconds over ``device_speedup``). On a device the seconds are
still the host cost model's (no model of a GPU is calibrated), a relative measure only.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import CctError, MemoryBudgetError
from ..lowering import direct_layout as dl
from ..lowering.calibrate import load_machine
from ..lowering.chunking import split
from ..lowering.cost_model import Machine, price, workspace_bytes
from ..lowering.cost_model import strategy as priced_strategy
from ..lowering.engine import lowering_budget, override_for
from ..lowering.geometry import ConvGeometry
from ..lowering.optimizer import machine_for_threads, plan_convolution, predictions, priced_chunk
from ..lowering.partition import memory_budget
from ..membudget import human
from ..proto import caffe_pb2
from .buffers import blob_shapes, op_batches, plan_slots
from .geometry import NetGeometry
from .hostsplit import SplitPlan, choose_splits

TARGETS = ("host", "gpu", "gpu+host")  # where predict() puts the convolutions (cpu-gpu: with_pipeline's)
PCIE_BYTES_PER_SECOND = 12e9  # host <-> device copies of the gpu+host sub-layers (PCIe 3 x16, as ZNNi's)


@dataclass
class LayerPlan:
    """One convolution of a candidate: input shape, batch, chosen strategy, seconds and workspace."""

    name: str
    shape: tuple[int, ...]
    strategy: str
    seconds: float
    workspace: int


@dataclass
class InferencePlan:
    """A patch shape and MPF choice with its predictions (what :func:`choose_plan` returns)."""

    grid: tuple[int, ...]
    mpf: tuple[bool, ...]
    method: str
    patch: tuple[int, ...]
    tile: tuple[int, ...]
    runs: int
    fragments: int
    seconds: float
    peak_bytes: int
    budget: int | None
    layers: list[LayerPlan] = field(default_factory=list)
    chosen_by: str = "planner"
    theta: int = 0  # two-stage pipeline: spatial ops in the first stage (0: one stage)
    one_stage_seconds: float = 0.0  # the one-stage prediction when ``theta`` is set
    stage_seconds: tuple[float, float] = (0.0, 0.0)  # per run, each stage on half the BLAS threads
    notes: list[str] = field(default_factory=list)  # e.g. InnerProduct layers run as convolutions
    shared_scratch: int = 0  # the direct and FFT convolutions' buffers, one set shared by the layers (per thread)
    scratch_roles: list[dict[str, int]] = field(default_factory=list)  # per partition thread: bytes per role
    target: str = "host"  # where the convolutions run: host, gpu, gpu+host (module docstring)
    device_budget: int | None = None  # gpu+host: the device's budget the sub-layers fit
    device_peak_bytes: int = 0  # gpu+host: the largest sub-layer's device bytes
    device_speedup: float = 1.0  # cpu-gpu: the device's speed over the host's the second stage is priced at
    splits: list[SplitPlan] = field(default_factory=list)  # gpu+host: each convolution's sub-layers

    def strategies(self) -> dict[str, str]:
        """The host lowering of each convolution by layer name (what the patch runner makes the layers run), or
        nothing when the convolutions run on a device (``gpu``, ``gpu+host``: the device's own lowering)."""
        return {lp.name: lp.strategy for lp in self.layers} if self.target in ("host", "cpu-gpu") else {}

    @property
    def voxels_per_second(self) -> float:
        """Predicted output voxels per second."""
        vox = 1
        for t in self.tile:
            vox *= t
        return vox / self.seconds if self.seconds > 0 else float("inf")

    def describe(self) -> str:
        """The printed plan: patch, fragments, per-layer strategy, predicted voxels/s and peak bytes."""
        flags = ",".join("MPF" if m else "pool" for m in self.mpf) or "-"
        where = {"host": "", "gpu": ", on the GPU (device memory)",
                 "cpu-gpu": ", CPU-GPU pipeline (first stage on the host, second on the device)",
                 "gpu+host": ", GPU + host RAM (activations in host RAM, convolutions on the device)"}[self.target]
        lines = [f"dense inference plan ({self.chosen_by}{where}): method {self.method}, input patch "
                 f"{'x'.join(map(str, self.patch))} -> output tile {'x'.join(map(str, self.tile))}, pooling layers "
                 f"[{flags}], {self.fragments} fragments per run, {self.runs} run(s) per patch",
                 f"  predicted {self.voxels_per_second:,.0f} output voxels/s, peak {human(self.peak_bytes)} "
                 f"(budget {human(self.budget) if self.budget else 'none'})"]
        if self.target != "host":
            lines.append("  (seconds from the host cost model: no GPU model is calibrated)")
        if self.target == "gpu+host":
            lines.append(f"  device: peak {human(self.device_peak_bytes)} (the layers share one buffer: the largest "
                         f"slices and workspace, and the biases; device budget "
                         f"{human(self.device_budget) if self.device_budget else 'none'}); "
                         f"{sum(sp.split for sp in self.splits)} of {len(self.splits)} convolutions split")
            lines.extend(f"  {sp.describe()}" for sp in self.splits)
        lines.extend(f"  {note}" for note in self.notes)
        if self.theta and self.target == "cpu-gpu":
            lines.append(f"  CPU-GPU pipeline: first {self.theta} convolution/pooling layers on the host, the rest on "
                         f"the device (queue of one; device priced at {self.device_speedup:.3g}x the host); predicted "
                         f"{self.stage_seconds[0] * 1e3:.2f} + {self.stage_seconds[1] * 1e3:.2f} ms per run against "
                         f"{self.one_stage_seconds * 1e3:.2f} ms per patch on the host alone; device stage "
                         f"{human(self.device_peak_bytes)}"
                         + (f" (device budget {human(self.device_budget)})" if self.device_budget else ""))
        elif self.theta:
            lines.append(f"  two-stage pipeline: first {self.theta} convolution/pooling layers on one worker, the rest "
                         f"on another (queue of one); predicted {self.stage_seconds[0] * 1e3:.2f} + "
                         f"{self.stage_seconds[1] * 1e3:.2f} ms per run against {self.one_stage_seconds * 1e3:.2f} ms "
                         f"per patch in one stage")
        for lp in self.layers:
            lines.append(f"  {lp.name}: input {list(lp.shape)}, {lp.strategy}, {lp.seconds * 1e3:.2f} ms, "
                         f"workspace {human(lp.workspace)}")
        return "\n".join(lines)


def conv_memory(name: str, cg: ConvGeometry, batch: int, itemsize: int) -> tuple[int, int]:
    """``(kept, transient)`` bytes of a convolution's forward pass on one ``batch`` by strategy ``name`` outside the
    buffers the layers share by role (:func:`scratch_buffers`): FFT keeps its weights' spectrum per layer; the
    lowered GEMMs' workspace (:func:`cct.lowering.cost_model.workspace_bytes`) is transient."""
    if name == "fft":
        return priced_strategy("fft").kernel_bytes(cg, itemsize), 0
    if scratch_buffers(name, cg, batch, itemsize) is not None:
        return 0, 0
    return 0, workspace_bytes(name, cg, batch, itemsize)


def scratch_buffers(name: str, cg: ConvGeometry, batch: int, itemsize: int) -> dict[str, int] | None:
    """Bytes per role of the buffers a convolution by ``name`` takes from the layers' shared scratch
    (:class:`cct.lowering.direct_layout.SharedScratch`) for one chunk of ``batch`` images, or None when it
    takes none: the direct kernels' padded input and blocked output (and their blocked weights, counted
    alike), FFT's transform buffers (:meth:`cct.lowering.fft.FFTConvolution.forward_buffers`)."""
    if name == "fft":
        return priced_strategy("fft").forward_buffers(cg, batch, itemsize)
    if name == "direct":
        buffers = direct_buffers(cg, batch, itemsize)
        if buffers is not None:
            return dict(zip(("xpad", "y", "weights"), buffers))
    return None


def direct_buffers(cg: ConvGeometry, batch: int, itemsize: int) -> tuple[int, int, int] | None:
    """Bytes of the direct kernels' ``(padded input, blocked output, blocked weights)`` buffers, or None when
    the register-blocked kernels do not run ``cg``."""
    lay = dl.plan_layout(cg, dl.priced_lanes() * 4 // itemsize)  # the kernels' vector width on this CPU
    if lay is None or dl.phase_geometry(cg) is not None:
        return None
    out = batch * cg.channels_out * cg.out_size / lay.efficiency if lay.efficiency < 1 else 0
    return itemsize * batch * cg.channels_in * lay.x_cs, int(itemsize * out), itemsize * _prod(cg.weight_shape)


def layer_growth(net, name: str, cg: ConvGeometry, batch: int, itemsize: int, cache: dict,
                 roles: list[dict[str, int]], work: int) -> tuple[int, list[dict[str, int]], int]:
    """``(bytes the peak grows by, the shared roles after, the layer's own shared bytes)`` when a convolution by
    ``name`` joins layers holding ``roles`` (per partition thread, bytes per role) and a largest transient ``work``:
    what it keeps, its transient beyond ``work`` and the growth of the roles (one buffer per role and thread, as
    large as the largest request; one set per partition thread, each sized for its chunk)."""
    kept, transient = conv_memory(name, cg, batch, itemsize)
    after, own = [dict(r) for r in roles], 0
    if scratch_buffers(name, cg, batch, itemsize) is not None:
        for k, chunk in enumerate(partition_chunks(net, cg, batch, cache, name)):
            if k == len(after):
                after.append({})
            for role, nbytes in scratch_buffers(name, cg, chunk, itemsize).items():
                after[k][role] = max(after[k].get(role, 0), nbytes)
                own += nbytes
    shared = sum(sum(r.values()) for r in after) - sum(sum(r.values()) for r in roles)
    return kept + max(0, transient - work) + shared, after, own


# Per-voxel layers that write their top in one pass (a compiled kernel or a ufunc with ``out=``); the others
# (Sigmoid, ELU, Scale, BatchNorm, ...) compute through numpy temporaries.
_ONE_PASS = frozenset({"ReLU", "TanH", "AbsVal", "Dropout", "Split", "Silence", "Input", "Convolution", "Pooling"})


def partition_chunks(net, cg: ConvGeometry, batch: int, cache: dict, name: str = "direct") -> list[int]:
    """Images per chunk of each batch partition a convolution of ``cg`` on ``batch`` by ``name`` runs: the
    runtime's plan (:func:`cct.lowering.optimizer.plan_convolution` on this machine's whole model with the net's
    engine settings, forward only), one entry per partition thread (each holds its own scratch buffers, sized for
    its chunk)."""
    key = ("partitions", name, cg, batch)
    if batch <= 1:
        return [batch]  # one image: one partition, one chunk
    if key not in cache:
        parts = net.config.engine.partitions
        plan = plan_convolution(cg, batch, load_machine(measure_if_missing=False), budget=lowering_budget(net.config),
                                partitions=parts if isinstance(parts, int) else "model", passes=("fwd",),
                                names=[name])  # the layer runs ``name``: its partitions and chunk, priced alone
        p = max(1, min(plan.partitions, batch))
        cache[key] = [min(plan.b_p or (e - s), e - s) for s, e in split(batch, p)]
    return cache[key]


def elementwise_temporaries(net, shapes: dict[str, tuple[int, ...]], itemsize: int) -> int:
    """The largest transient of the per-voxel layers that compute through temporaries: two arrays of the top's size."""
    out = 0
    for lp, tnames in zip(net.param.layer, net.top_names):
        if lp.type not in _ONE_PASS:
            out = max([out] + [2 * _prod(shapes[t]) * itemsize for t in tnames if t in shapes])
    return out


def _prod(v: Sequence[int]) -> int:
    out = 1
    for x in v:
        out *= int(x)
    return out


def activation_bytes(net, geom: NetGeometry, run_shape: Sequence[int], mpf: Sequence[bool], theta: int = 0,
                     itemsize: int | None = None) -> int:
    """Bytes of the activation pool of one run (``theta``: a two-stage pipeline's split, its stages pooled apart)."""
    split = geom.ops[theta].layer if theta else None
    slots, _steps, _shapes = plan_slots(net, geom, run_shape, mpf, geom.output_blob, split)
    return slots.elements * (itemsize or net.dtype.itemsize)


def predict(net, geom: NetGeometry, grid: Sequence[int], mpf: Sequence[bool], method: str = "mpf",
            machine: Machine | None = None, budget: int | None = None, itemsize: int | None = None,
            cache: dict | None = None, target: str = "host", device_budget: int | None = None) -> InferencePlan:
    """The predictions of one candidate (see the module docstring); ``cache`` keeps the convolution prices
    between candidates of one planning; ``target`` and ``device_budget``: where the convolutions run."""
    if target not in TARGETS:
        raise CctError(f"unknown inference target '{target}' (use {', '.join(TARGETS)})")
    machine = machine if machine is not None else load_machine(measure_if_missing=False)
    cache = {} if cache is None else cache
    cap = lowering_budget(net.config)  # what the layers' chunks may hold, as they run (partition_chunks)
    itemsize = itemsize or net.dtype.itemsize
    mpf = tuple(mpf) if method == "mpf" else (False,) * len(geom.pools)
    run_shape = geom.input_size(tuple(grid), mpf)
    sizes = [run_shape] + geom.layer_sizes(run_shape, mpf)
    batches = op_batches(geom, mpf)
    runs = 1
    for op, m in zip(geom.pools, mpf):
        if not m:
            runs *= _prod(op.size)
    if method == "strided":
        runs = 1
        tile = tuple(grid)
        patch = run_shape
    else:
        tile = tuple(g * s for g, s in zip(grid, geom.stride))
        patch = tuple(t + f - 1 for t, f in zip(tile, geom.field_of_view))
    shapes = blob_shapes(net, geom, run_shape, mpf)
    blob_bytes = sum(_prod(s) for s in shapes.values()) * itemsize
    c_in = net.blobs[geom.input_blob].shape[1]
    c_out = net.blobs[geom.output_blob].shape[1]
    io_bytes = (c_in * _prod(patch) + c_out * _prod(tile)) * 4
    active = activation_bytes(net, geom, run_shape, mpf, itemsize=itemsize)
    limit = budget if budget is not None else memory_budget(None)
    layers, seconds, work, kept = [], 0.0, 0, 0
    roles: list[dict[str, int]] = []  # per partition thread: the largest request of each shared buffer role
    splits: list[SplitPlan] = []
    offload: list[tuple[int, str, ConvGeometry, int]] = []  # gpu+host: (layer plan index, name, geometry, batch)
    pool_i = 0
    for k, op in enumerate(geom.ops):
        lp = net.param.layer[op.layer]
        bottom = net.bottom_vecs[op.layer][0]
        shape = (batches[k], bottom.shape[1]) + tuple(sizes[k])
        if op.kind == "pool":
            is_max = lp.pooling_param.pool == caffe_pb2.PoolingParameter.MAX
            if not mpf[pool_i] and is_max:  # the net's MAX pooling keeps an int32 index per maximum, compares by mask
                count = batches[k + 1] * shape[1] * _prod(sizes[k + 1])
                kept += 4 * count
                work = max(work, count)
            pool_i += 1
            continue
        cg = ConvGeometry.from_param(lp.convolution_param, shape)
        if target != "host":  # type 1 over the whole batch on the device
            name, t = "type1", predictions(cg, shape[0], machine, "fwd", ["type1"], None)["type1"]
            if target == "gpu+host":  # priced with the transfers once the sub-layers are chosen, below
                offload.append((len(layers), lp.name, cg, shape[0]))
                layers.append(LayerPlan(lp.name, shape, "type1 on the device", t, 0))
                continue
            ws = workspace_bytes("type1", cg, shape[0], itemsize)
            layers.append(LayerPlan(lp.name, shape, name, t, ws))
            seconds += t
            work = max(work, ws)
            continue
        forced = "type1" if net.config.engine.mode == "caffe" else override_for(lp.name, net.config.engine)
        key = (cg, shape[0], machine.threads, forced)  # one cache serves the full and the half-thread machine
        if key not in cache:  # the optimizer's chunk-aware forward prices, as a TEST net's layer plans
            preds = predictions(cg, shape[0], machine, "fwd", [forced] if forced else None, cap, ("fwd",))
            if "fft" in preds:  # the weights stay fixed: FFT transforms them once, not in every chunk of every run
                chunks = -(-shape[0] // priced_chunk("fft", cg, shape[0], machine, cap, ("fwd",)))
                preds["fft"] -= chunks * price(priced_strategy("fft").weight_transform_ops(cg), machine)["total"]
            cache[key] = sorted(preds.items(), key=lambda kv: (kv[1], kv[0]))
        # the fastest whose buffers fit beside what the layers before it hold, else the leanest
        room = limit - (active + io_bytes + kept + work + sum(sum(r.values()) for r in roles))
        grows = {n: layer_growth(net, n, cg, shape[0], itemsize, cache, roles, work) for n, _ in cache[key]}
        fits = [(n, sec) for n, sec in cache[key] if grows[n][0] <= room]
        name, t = fits[0] if fits else min(cache[key], key=lambda kv: grows[kv[0]][0])
        kept_ws, transient = conv_memory(name, cg, shape[0], itemsize)
        _grow, roles, own = grows[name]
        layers.append(LayerPlan(lp.name, shape, name, t, kept_ws + transient + own))
        seconds += t
        kept += kept_ws
        work = max(work, transient)
    device_peak = 0
    if offload:
        splits, device_peak = choose_splits([(n, cg, b) for _k, n, cg, b in offload], device_budget, itemsize)
        for (k, _n, _cg, _b), sp in zip(offload, splits):
            lp = layers[k]
            lp.seconds += sp.transfer_bytes / PCIE_BYTES_PER_SECOND
            lp.strategy, lp.workspace = f"type1 on the device, {sp.sub_layers} sub-layer(s)", sp.device_bytes
    seconds += sum(lp.seconds for lp in layers if lp.name in {n for _k, n, _c, _b in offload})
    seconds += machine.streaming_seconds(blob_bytes / 2) if hasattr(machine, "streaming_seconds") else 0.0
    seconds *= runs
    work = max(work, elementwise_temporaries(net, shapes, itemsize))
    shared = sum(sum(r.values()) for r in roles)
    peak = active + kept + shared + work + io_bytes
    return InferencePlan(tuple(grid), mpf, method, patch, tile, runs, batches[-1], seconds, peak, budget, layers,
                         shared_scratch=shared, scratch_roles=roles, target=target, device_budget=device_budget,
                         device_peak_bytes=device_peak, splits=splits)


def parse_pipeline(text: str | int | None) -> str | int:
    """``--pipeline``: ``"auto"``, ``"off"`` or theta (a positive int)."""
    if text is None or text in ("off", 0, "0"):
        return "off"
    if text == "auto":
        return "auto"
    try:
        theta = int(text)
    except (TypeError, ValueError):
        theta = 0
    if theta < 1:
        raise CctError(f"--pipeline {text!r}: expected auto, off or theta (a positive number of layers)")
    return theta


def with_pipeline(net, geom: NetGeometry, plan: InferencePlan, pipeline: str | int,
                  half: InferencePlan, scale: float = 1.0, device_speedup: float | None = None) -> InferencePlan:
    """``plan`` as a two-stage pipeline (ZNNi VII): ``half`` is the same candidate priced on half the BLAS
    threads (its seconds times ``scale``, see :func:`half_machine`); ``pipeline`` is ``"auto"`` (the best
    theta, kept only when predicted faster than one stage) or a theta. A run then takes the slower stage's
    time; the peak adds the hand-off buffer and the second stage's copy of the boundary blob, and the stages'
    activations are pooled apart (they run at the same time). ``"off"``
    returns ``plan`` unchanged. ``device_speedup`` (the CPU-GPU pipeline): the first stage runs on all the host's
    threads (``plan``'s prices), the second on a device priced at the host's seconds over ``device_speedup``."""
    nops = len(geom.ops)
    if pipeline == "off" or plan.method == "strided" and pipeline == "auto":
        return plan
    if isinstance(pipeline, int) and not 1 <= pipeline < nops:
        raise CctError(f"--pipeline {pipeline}: the net has {nops} convolution/pooling layers, so theta must be "
                       f"1..{nops - 1}")
    if nops < 2:
        return plan
    def op_seconds(p: InferencePlan, factor: float) -> list[float]:
        conv = iter(lp.seconds for lp in p.layers)
        secs = [next(conv) if op.kind == "conv" else 0.0 for op in geom.ops]
        rest = max(0.0, p.seconds / max(p.runs, 1) - sum(secs))
        return [(t + rest / nops) * factor for t in secs]

    if device_speedup is None:
        first = second = op_seconds(half, scale)
    else:
        first = op_seconds(plan, 1.0)
        second = [t / device_speedup for t in first]
        plan.target, plan.device_speedup = "cpu-gpu", float(device_speedup)
    thetas = [pipeline] if isinstance(pipeline, int) else range(1, nops)
    if device_speedup is not None:  # the device copy's memory must fit the device's budget
        needs = {th: device_stage_bytes(net, geom, plan, th) for th in thetas}
        fit = [th for th in thetas if plan.device_budget is None or needs[th] <= plan.device_budget]
        if not fit:  # marked unfit (choose_plan skips it, plan_for_patch refuses it)
            plan.device_peak_bytes = min(needs.values())
            return plan
        thetas = fit
    best = min(thetas, key=lambda th: (max(sum(first[:th]), sum(second[th:])), th))
    if device_speedup is not None:
        plan.device_peak_bytes = needs[best]
    stages = (sum(first[:best]), sum(second[best:]))
    seconds = max(stages) * plan.runs
    if pipeline == "auto" and seconds >= plan.seconds and device_speedup is None:
        return plan  # (the CPU-GPU pipeline was asked for by its device: it always runs)
    run_shape = geom.input_size(plan.grid, plan.mpf)
    size = ([run_shape] + geom.layer_sizes(run_shape, plan.mpf))[best]
    batch, pool_i = 1, 0
    for op in geom.ops[:best]:
        if op.kind == "pool":
            batch *= _prod(op.size) if plan.mpf[pool_i] else 1
            pool_i += 1
    channels = net.bottom_vecs[geom.ops[best].layer][0].shape[1]
    handoff = 2 * batch * channels * _prod(size) * net.dtype.itemsize
    plan.one_stage_seconds, plan.seconds, plan.theta, plan.stage_seconds = plan.seconds, seconds, best, stages
    plan.peak_bytes += handoff + activation_bytes(net, geom, run_shape, plan.mpf, best) \
        - activation_bytes(net, geom, run_shape, plan.mpf)  # the stages' activations are pooled apart
    plan.peak_bytes += plan.shared_scratch  # and each stage's thread has its own set of direct buffers
    return plan


def device_stage_bytes(net, geom: NetGeometry, plan: InferencePlan, theta: int) -> int:
    """Device bytes of the CPU-GPU pipeline's second stage at split ``theta``: the device copy's activation pool
    (planned with the split, as the host's), type 1's work buffers of the largest convolution after the split (the
    device layers share one set), the output tile and the net's weights."""
    itemsize = net.dtype.itemsize
    run_shape = geom.input_size(plan.grid, plan.mpf)
    sizes = [run_shape] + geom.layer_sizes(run_shape, plan.mpf)
    batches = op_batches(geom, plan.mpf)
    work = 0
    for k in range(theta, len(geom.ops)):
        op = geom.ops[k]
        if op.kind == "conv":
            shape = (batches[k], net.bottom_vecs[op.layer][0].shape[1]) + tuple(sizes[k])
            cg = ConvGeometry.from_param(net.param.layer[op.layer].convolution_param, shape)
            work = max(work, workspace_bytes("type1", cg, batches[k], itemsize))
    weights = sum(b.data.nbytes for blobs in net.params.values() for b in blobs)
    tile = net.blobs[geom.output_blob].shape[1] * _prod(plan.tile) * itemsize
    return activation_bytes(net, geom, run_shape, plan.mpf, theta, itemsize) + work + tile + weights


def fits_device(plan: InferencePlan) -> bool:
    """Whether a CPU-GPU pipeline plan's device stage fits the device's budget (any other plan: True)."""
    return plan.target != "cpu-gpu" or plan.device_budget is None or plan.device_peak_bytes <= plan.device_budget


def half_machine(machine: Machine) -> tuple[Machine, float]:
    """The machine model of one pipeline stage (half the BLAS threads, at least one) and the factor its
    predictions still need: 1 where a model for that thread count is calibrated; otherwise the full
    machine's model and the thread ratio (its work spread evenly over the threads)."""
    threads = max(1, machine.threads // 2)
    if threads == machine.threads:
        return machine, 1.0
    half = machine_for_threads(threads)
    if half.threads == threads and not getattr(half, "nominal", False):
        return half, 1.0
    return machine, machine.threads / threads


def mpf_choices(npool: int, method: str) -> list[tuple[bool, ...]]:
    """The MPF/plain combinations the planner tries for ``method``: fragments on the last ``k`` pooling
    layers, ``k = npool .. 0``. Fragmenting an early layer multiplies the batch of every later layer, so
    under a tight budget the late layers are the ones worth fragmenting; an early MPF layer after a plain
    one never saves memory over the reverse order of the same count and costs more runs' worth of
    re-reading, so those orders are not priced (it keeps planning to a few hundred layer plans)."""
    if method != "mpf":
        return [(False,) * npool]
    return [(False,) * (npool - k) + (True,) * k for k in range(npool, -1, -1)]


def choose_plan(net, geom: NetGeometry, budget: int | None, limit: Sequence[int], method: str = "mpf",
                machine: Machine | None = None, max_grid: int = 64,
                mpf: Sequence[bool] | None = None, pipeline: str | int = "off", target: str = "host",
                device_budget: int | None = None, device_speedup: float | None = None) -> InferencePlan:
    """The candidate with the most predicted output voxels/s whose predicted peak fits ``budget``.

    ``limit``: the largest useful grid per axis (the volume's output over the stride); ``mpf``: fix the
    MPF choice instead of trying every combination; ``pipeline``: ``"off"``, ``"auto"`` or theta
    (:func:`with_pipeline`: theta and the patch are then chosen together, by the pipelined throughput);
    ``target``, ``device_budget``: where the convolutions run (:func:`predict`; on ``"gpu"`` ``budget`` is the
    device's; ``device_speedup``: the CPU-GPU pipeline, :func:`with_pipeline`). Raises
    :class:`MemoryBudgetError` when even the smallest patch does not fit.
    """
    machine = machine if machine is not None else load_machine(measure_if_missing=False)
    best: InferencePlan | None = None
    smallest: InferencePlan | None = None
    cache: dict = {}
    half, scale = half_machine(machine) if pipeline != "off" else (machine, 1.0)
    choices = [tuple(mpf)] if mpf is not None and method == "mpf" else mpf_choices(len(geom.pools), method)
    grids = sorted({g for g in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64) if g <= max_grid})
    for flags in choices:
        top = 0.0
        for g in grids:
            grid = tuple(min(g, max(1, lim)) for lim in limit)
            cand = predict(net, geom, grid, flags, method, machine, budget, cache=cache, target=target,
                           device_budget=device_budget)
            if pipeline != "off":
                cand = with_pipeline(net, geom, cand, pipeline,
                                     predict(net, geom, grid, flags, method, half, budget, cache=cache), scale,
                                     device_speedup)
            if smallest is None or cand.peak_bytes < smallest.peak_bytes:
                smallest = cand
            if budget is not None and cand.peak_bytes > budget or not fits_device(cand):
                break  # larger grids only need more
            if best is None or cand.voxels_per_second > best.voxels_per_second * (1 + 1e-9):
                best = cand
            if all(g >= lim for lim in limit) or cand.voxels_per_second < 0.7 * top:
                break  # the whole volume in one patch, or past this choice's best size
            top = max(top, cand.voxels_per_second)
    if best is None and smallest is not None and not fits_device(smallest) and (
            budget is None or smallest.peak_bytes <= budget):
        raise MemoryBudgetError(f"the CPU-GPU pipeline's device stage needs {human(smallest.device_peak_bytes)} at "
                                f"the smallest patch {list(smallest.patch)}, more than the device's memory budget of "
                                f"{human(smallest.device_budget or 0)} (--device_memory_budget)")
    if best is None:
        knob = "the GPU's: --device_memory_budget" if target == "gpu" else "CCT_MEMORY_BUDGET / Config.memory_budget"
        raise MemoryBudgetError(f"even the smallest patch {list(smallest.patch) if smallest else '?'} needs "
                                f"{human(smallest.peak_bytes) if smallest else '?'}, more than the memory budget "
                                f"of {human(budget or 0)} ({knob})")
    return best


def plan_for_patch(net, geom: NetGeometry, patch: Sequence[int], limit: Sequence[int], method: str = "mpf",
                   mpf: Sequence[bool] | None = None, budget: int | None = None,
                   machine: Machine | None = None, pipeline: str | int = "off", target: str = "host",
                   device_budget: int | None = None, device_speedup: float | None = None) -> InferencePlan:
    """The plan for a user's ``--patch``: the largest valid patch within it on each axis (MPF on every
    pooling layer unless ``mpf`` says otherwise; ``target``, ``device_budget`` as :func:`choose_plan`)."""
    if len(patch) != geom.num_spatial:
        raise CctError(f"--patch has {len(patch)} axes; the net has {geom.num_spatial} spatial axes")
    flags = tuple(mpf) if mpf is not None else (True,) * len(geom.pools)
    if method != "mpf":
        flags = (False,) * len(geom.pools)

    def patch_of(grid: tuple[int, ...]) -> tuple[int, ...]:
        if method == "strided":
            return geom.input_size(grid, flags)
        return tuple(g * s + f - 1 for g, s, f in zip(grid, geom.stride, geom.field_of_view))

    smallest = patch_of((1,) * geom.num_spatial)
    if any(p < s for p, s in zip(patch, smallest)):
        raise CctError(f"--patch {list(patch)} is smaller than the smallest patch {list(smallest)} of this net")
    grid = []
    for a in range(geom.num_spatial):
        g = 1
        while g < max(1, limit[a]):
            trial = [1] * geom.num_spatial
            trial[a] = g + 1
            if patch_of(tuple(trial))[a] > patch[a]:
                break
            g += 1
        grid.append(g)
    plan = predict(net, geom, tuple(grid), flags, method, machine, budget, target=target,
                   device_budget=device_budget)
    if pipeline != "off":
        machine = machine if machine is not None else load_machine(measure_if_missing=False)
        half, scale = half_machine(machine)
        plan = with_pipeline(net, geom, plan, pipeline,
                             predict(net, geom, tuple(grid), flags, method, half, budget), scale, device_speedup)
        if not fits_device(plan):
            raise MemoryBudgetError(f"the CPU-GPU pipeline's device stage needs {human(plan.device_peak_bytes)} at "
                                    f"patch {list(plan.patch)}, more than the device's memory budget of "
                                    f"{human(plan.device_budget or 0)} (--device_memory_budget)")
    plan.chosen_by = "--patch"
    return plan
