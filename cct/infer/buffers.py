"""Activation buffers of dense inference, reused across layers (liveness decided at setup).

A forward-only pass needs a blob's data only from the layer that writes it to the last layer that reads
it. :func:`net_accesses` lists, per layer of a dense-inference chain (with each max-pooling-fragments layer
expanded into its per-axis stride-1 stages and the fold), which storages it reads and writes; a storage is a
blob together with the blobs that view its data (in-place layers, Split, one-input Concat, one-output
Slice). :func:`assign_slots` walks that list once and gives each storage a slot of a pool: a slot is free
again after the last access that reads its storage, an element-wise layer's top takes over the slot of a
bottom that dies at that layer (in place), and a slot grows to the largest storage it ever holds. The pool
(one flat array per slot) is then allocated once per patch shape by :class:`cct.infer.dense.PatchRunner`,
and its size is the activation term of the planner's peak (:mod:`cct.infer.plan`): both use the same
functions, so the prediction follows what runs.

With a two-stage pipeline (:mod:`cct.infer.stages`) the stages run at the same time, so their slots are
kept apart: ``split`` starts a second pool, and the second stage's reads of first-stage storages are its
private copies (not slots of either pool).
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from .fragments import stage_shapes
from .geometry import NetGeometry

# Layers whose top may take over the storage of a bottom that no later layer reads: each output element
# depends only on the same element of the input, computed before it is written (checked per layer).
IN_PLACE_SAFE = frozenset({"ReLU", "Sigmoid", "TanH", "AbsVal", "ELU", "Exp", "Log", "BNLL", "Threshold", "Clip",
                           "Dropout", "Swish"})
# Layers whose tops are views of their bottom's data (one storage).
_VIEWS = frozenset({"Split"})


@dataclass(frozen=True)
class Access:
    """One step of the forward pass: the storages it reads and writes; ``elementwise``: its write may
    reuse a read storage's slot when that storage dies here."""

    reads: tuple[Hashable, ...]
    writes: tuple[Hashable, ...]
    elementwise: bool = False


@dataclass
class SlotPlan:
    """Which pool slot holds each storage, and each slot's size in elements."""

    slot_of: dict[Hashable, int] = field(default_factory=dict)
    sizes: list[int] = field(default_factory=list)

    @property
    def elements(self) -> int:
        """The pool's total size in elements."""
        return sum(self.sizes)


def _prod(values: Sequence[int]) -> int:
    out = 1
    for v in values:
        out *= int(v)
    return out


def storage_roots(net) -> dict[str, str]:
    """Each blob name -> the name of the blob whose storage it uses (itself unless a view)."""
    root: dict[str, str] = {}
    for i, (bnames, tnames) in enumerate(zip(net.bottom_names, net.top_names)):
        lp = net.param.layer[i]
        view = lp.type in _VIEWS or (lp.type == "Concat" and len(bnames) == 1) or \
            (lp.type == "Slice" and len(tnames) == 1)
        for t in tnames:
            if t not in root:
                root[t] = root.get(bnames[0], bnames[0]) if view and bnames else t
    return root


def blob_depths(net, geom: NetGeometry) -> dict[str, int]:
    """Number of spatial ops (convolutions and poolings) on the path to each blob of the chain."""
    spatial = {op.layer: k for k, op in enumerate(geom.ops)}
    depth = {geom.input_blob: 0}
    for i, (bnames, tnames) in enumerate(zip(net.bottom_names, net.top_names)):
        if not bnames:
            continue
        d = max(depth.get(b, 0) for b in bnames)
        if i in spatial:
            d = spatial[i] + 1
        for t in tnames:
            depth[t] = d
    return depth


def op_batches(geom: NetGeometry, mpf: Sequence[bool]) -> list[int]:
    """The batch (fragments so far) of the input and after each spatial op."""
    batches, b, pool_i = [1], 1, 0
    for op in geom.ops:
        if op.kind == "pool":
            if mpf[pool_i]:
                b *= _prod(op.size)
            pool_i += 1
        batches.append(b)
    return batches


def blob_shapes(net, geom: NetGeometry, run_shape: Sequence[int], mpf: Sequence[bool]) -> dict[str, tuple[int, ...]]:
    """Every blob's shape for one run on an input of spatial ``run_shape`` (batch = fragments so far)."""
    sizes = [tuple(run_shape)] + geom.layer_sizes(tuple(run_shape), tuple(mpf))
    batches = op_batches(geom, mpf)
    depth = blob_depths(net, geom)
    shapes = {}
    for name, blob in net.blobs.items():
        d = depth.get(name, 0)
        c = blob.shape[1] if blob.num_axes > 1 else 1
        shapes[name] = (batches[d], c) + tuple(sizes[d])
    return shapes


def stage_key(layer: int, axis: int) -> tuple[str, int, int]:
    """The storage key of axis ``axis``'s stride-1 pooling buffer of the MPF layer ``layer``."""
    return ("mpf-stage", layer, axis)


def net_accesses(net, geom: NetGeometry, mpf: Sequence[bool], shapes: dict[str, tuple[int, ...]]
                 ) -> tuple[list[tuple[int, Access]], dict[Hashable, tuple[int, ...]]]:
    """``(layer index, access)`` per step in order (MPF layers as their stages), and every storage's shape."""
    root = storage_roots(net)
    shape_of: dict[Hashable, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        shape_of.setdefault(root.get(name, name), shape)
    frag = {op.layer: op for op, m in zip(geom.pools, mpf) if m}
    steps: list[tuple[int, Access]] = []
    for i, (bnames, tnames) in enumerate(zip(net.bottom_names, net.top_names)):
        lp = net.param.layer[i]
        if lp.type == "Input":
            continue
        reads = tuple(dict.fromkeys(root.get(b, b) for b in bnames))
        writes = tuple(dict.fromkeys(root.get(t, t) for t in tnames))
        if i in frag:  # stride-1 pooling axis by axis, then the fold into the top
            src = reads
            for a, shape in enumerate(stage_shapes(shapes[bnames[0]], frag[i].size)):
                key = stage_key(i, a)
                shape_of[key] = shape
                steps.append((i, Access(src, (key,))))
                src = (key,)
            steps.append((i, Access(src, writes)))
            continue
        steps.append((i, Access(reads, writes, lp.type in IN_PLACE_SAFE)))
    return steps, shape_of


def assign_slots(accesses: Sequence[Access], elements: dict[Hashable, int], keep: Sequence[Hashable] = (),
                 plan: SlotPlan | None = None, external: frozenset = frozenset()) -> SlotPlan:
    """Slots for the storages of ``accesses`` (see the module docstring); ``elements``: each storage's size;
    ``keep``: storages live until the end (the output); ``external``: storages that are not pooled here
    (ignored); ``plan``: add to this plan's slot numbering (a second, separate pool)."""
    plan = plan if plan is not None else SlotPlan()
    first_slot = len(plan.sizes)
    last: dict[Hashable, int] = {}
    for k, acc in enumerate(accesses):
        for key in acc.reads + acc.writes:
            if key not in external:
                last[key] = k
    for key in keep:
        if key in last:
            last[key] = len(accesses)
    free: list[int] = []

    def take(key: Hashable) -> None:
        need = elements[key]
        fits = [s for s in free if plan.sizes[s] >= need]
        if fits:
            slot = min(fits, key=lambda s: (plan.sizes[s], s))
        elif free:
            slot = max(free, key=lambda s: (plan.sizes[s], -s))
            plan.sizes[slot] = need
        else:
            slot = len(plan.sizes)
            plan.sizes.append(need)
        if slot in free:
            free.remove(slot)
        plan.slot_of[key] = slot

    for k, acc in enumerate(accesses):
        reads = [r for r in acc.reads if r not in external]
        for key in reads:  # read before any write: the input, loaded before the pass
            if key not in plan.slot_of:
                take(key)
        dying = [r for r in reads if last[r] == k and r not in acc.writes]
        for key in acc.writes:
            if key in external or key in plan.slot_of:
                continue
            donor = next((r for r in dying if acc.elementwise and elements[r] == elements[key]), None)
            if donor is not None:
                plan.slot_of[key] = plan.slot_of[donor]
                dying.remove(donor)
                last[donor] = -1  # its slot now belongs to ``key``
            else:
                take(key)
        for key in dict.fromkeys(reads + list(acc.writes)):
            if key not in external and last.get(key) == k:
                slot = plan.slot_of[key]
                if slot >= first_slot and slot not in free:
                    free.append(slot)
    return plan


def plan_slots(net, geom: NetGeometry, run_shape: Sequence[int], mpf: Sequence[bool], output: str,
               split_layer: int | None = None) -> tuple[SlotPlan, list[tuple[int, Access]], dict]:
    """The slot plan of one run (``split_layer``: the first layer of a pipeline's second stage, whose slots are
    a pool of their own), the steps and every storage's shape."""
    shapes = blob_shapes(net, geom, run_shape, mpf)
    steps, shape_of = net_accesses(net, geom, mpf, shapes)
    elements = {k: _prod(s) for k, s in shape_of.items()}
    out = storage_roots(net).get(output, output)
    if split_layer is None:
        return assign_slots([a for _i, a in steps], elements, keep=(out,)), steps, shape_of
    first = [a for i, a in steps if i < split_layer]
    second = [a for i, a in steps if i >= split_layer]
    produced = frozenset(k for a in first for k in a.writes) | {geom.input_blob}
    boundary = [k for a in second for k in a.reads if k in produced]  # copied out when the first stage ends
    plan = assign_slots(first, elements, keep=boundary)
    return assign_slots(second, elements, keep=(out,), plan=plan, external=produced), steps, shape_of
