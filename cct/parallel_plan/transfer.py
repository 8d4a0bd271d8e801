"""Exact bytes moved between two configurations of an edge, and per-step parameter reduction.

``xfer(c_u, c_v)`` of an edge ``u -> v``: under ``c_u`` worker i owns a box of ``u``'s output; under
``c_v`` worker j reads the region of it that :mod:`.regions` gives for j's output box. Worker j
receives ``|box_i  intersect  region_j|`` elements from every i != j (its own box is local). The
backward pass sends the same regions' gradients back to their owners (none into a data layer, a loss's
labels or an Accuracy), so
an edge moves its forward bytes twice per step. Times: each worker receives its parts one after the
other at its links' bandwidths (``inv_bw[i, j]``: seconds per byte from worker i to worker j) and the
workers receive in parallel: the slowest receiver sets the time (a model; see :mod:`.cluster`).

``update(c)``: a configuration splitting the output channels c ways owns ``1/c`` of the layer's
parameters per channel group (no reduction across groups); each slice's gradient is all-reduced among
the ``n*h*w`` workers sharing it (a ring: each moves ``2 (r-1)/r`` of the slice). A SoftmaxWithLoss split
``c`` ways reduces its softmax's maximum and sum over the ``c`` workers of each box of the other axes
(:func:`loss_reduction_cost`, counted as the loss node's update; an Accuracy's two sums over channels
likewise).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .graph import PlanGraph
from .split import Split, worker_boxes


def stacked_boxes(splits: list[Split], shape: tuple[int, int, int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(boxes (R, 4, 2), worker ids (R,), block starts (K,))``: every configuration's worker boxes stacked."""
    boxes = [worker_boxes(s, shape) for s in splits]
    ids = np.concatenate([np.arange(len(b)) for b in boxes])
    starts = np.cumsum([0] + [len(b) for b in boxes[:-1]])
    return np.concatenate(boxes), ids, starts


def overlap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``(Ra, Rb)`` element counts of the intersections of boxes ``a (Ra, 4, 2)`` and ``b (Rb, 4, 2)``."""
    lo = np.maximum(a[:, None, :, 0], b[None, :, :, 0])
    hi = np.minimum(a[:, None, :, 1], b[None, :, :, 1])
    return np.prod(np.maximum(hi - lo, 0), axis=2)


@dataclass
class EdgeCost:
    """One edge's costs for every pair of configurations: ``bytes[cu, cv]`` received per step (forward
    and backward), ``seconds[cu, cv]`` the transfer time under the links given."""

    bytes: np.ndarray
    seconds: np.ndarray


def edge_cost(graph: PlanGraph, edge: tuple[int, int, int, int], splits_u: list[Split], splits_v: list[Split],
              inv_bw: np.ndarray) -> EdgeCost:
    """:class:`EdgeCost` of ``edge = (u, top, v, bottom)`` for every configuration pair of u and v."""
    u, top, v, bottom = edge
    nu, nv = graph.nodes[u], graph.nodes[v]
    tensor = nu.top_shapes[top]
    own, own_ids, own_starts = stacked_boxes(splits_u, tensor)
    out, need_ids, need_starts = stacked_boxes(splits_v, nv.out_shape)
    need = nv.rule.needed(out, bottom, nv.in_shapes[bottom])
    elems = overlap(own, need).astype(np.float64)
    elems[own_ids[:, None] == need_ids[None, :]] = 0.0
    nbytes = elems * graph.itemsize
    timed = nbytes * inv_bw[own_ids[:, None], need_ids[None, :]]
    per_receiver = np.add.reduceat(timed, own_starts, axis=0)  # (Ku, Rv): what each v-worker receives
    fwd = np.maximum.reduceat(per_receiver, need_starts, axis=1)
    total = np.add.reduceat(np.add.reduceat(nbytes, own_starts, axis=0), need_starts, axis=1)
    if nu.kind == "source" or nv.kind == "metric" or (nv.kind == "loss" and bottom == 1):  # no gradient back
        return EdgeCost(total, fwd)
    per_owner = np.add.reduceat(timed, need_starts, axis=1)  # (Ru, Kv): gradients each u-worker gets back
    bwd = np.maximum.reduceat(per_owner, own_starts, axis=0)
    return EdgeCost(2.0 * total, fwd + bwd)


def update_cost(param_bytes: int, splits: list[Split], inv_bw: np.ndarray) -> EdgeCost:
    """Per configuration (as a 1-row :class:`EdgeCost`): bytes all workers receive reducing the parameter
    gradients, and the time of the slowest slice's ring all-reduce."""
    nbytes = np.zeros(len(splits))
    secs = np.zeros(len(splits))
    for k, s in enumerate(splits):
        r = s.n * s.h * s.w
        if r == 1 or param_bytes == 0:
            continue
        slice_bytes = param_bytes / s.c
        nbytes[k] = s.c * 2.0 * (r - 1) * slice_bytes
        worst = 0.0
        for g in range(s.c):  # the workers sharing channel slice g: every c-th worker of the grid
            ring = np.arange(g, s.workers, s.c)
            worst = max(worst, float(np.max(inv_bw[ring, np.roll(ring, -1)])))
        secs[k] = 2.0 * (r - 1) / r * slice_bytes * worst
    return EdgeCost(nbytes[None, :], secs[None, :])


def loss_reduction_cost(positions_box: np.ndarray, splits: list[Split], itemsize: int,
                        inv_bw: np.ndarray) -> EdgeCost:
    """Per configuration of a SoftmaxWithLoss (as a 1-row :class:`EdgeCost`): the bytes all workers receive
    reducing the softmax's maximum and sum over channels -- for each row of ``c`` workers (the channel
    slices of one box of the other axes) two ring all-reduces of one number per position of the box, each
    moving ``2 (c-1)/c`` of it into every worker -- and the slowest row's time. ``positions_box``: the
    scores' ``(N, C, H, W)`` shape."""
    shape = tuple(int(d) for d in positions_box)
    nbytes = np.zeros(len(splits))
    secs = np.zeros(len(splits))
    for k, s in enumerate(splits):
        if s.c == 1:
            continue
        boxes = worker_boxes(s, shape)  # type: ignore[arg-type]
        worst = 0.0
        for first in range(0, s.workers, s.c):  # one row: workers first .. first + c - 1
            box = boxes[first]
            per_array = float(np.prod(box[[0, 2, 3], 1] - box[[0, 2, 3], 0])) * itemsize * 2.0 * (s.c - 1) / s.c
            nbytes[k] += 2.0 * s.c * per_array
            ring = np.arange(first, first + s.c)
            worst = max(worst, 2.0 * per_array * float(np.max(inv_bw[ring, np.roll(ring, -1)])))
        secs[k] = worst
    return EdgeCost(nbytes[None, :], secs[None, :])
