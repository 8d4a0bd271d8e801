"""``compute(c)``: a node's forward + backward seconds on one worker's part of its output.

:func:`measure_part` runs the node's layers with the engine as training runs them -- a small net of an
Input layer giving the worker's input regions (halos included) and the node's layers resized to the
worker's part (``num_output`` of a channel split, the input rows and columns of a spatial split with
the padding made explicit) -- forward then backward, timed with :func:`cct.lowering.tune.measure`
(best of a few rounds, each after an untimed call) and cached per machine, BLAS backend and thread
count (``deepa-compute-<machine>-<backend>-t<threads>.json`` in the cct cache dir), as the lowering
picks are.

Two models price every configuration from those measurements:

* :class:`MeasuredCompute`: every distinct part shape measured (the planner for this machine);
* :class:`ScaledCompute`: each node measured once at a reference batch on this machine, a part then
  costing its share of output elements at that rate divided by a worker's speed relative to this
  machine (the cluster simulator's FLOPS scaling: a model, not a measurement of the cluster).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from .. import blas
from ..lowering import tune
from ..net import Net
from ..proto import caffe_pb2
from .graph import PlanGraph, PlanNode
from .split import Split, worker_boxes

#: bumped when the measurement changes so that cached times are measured again
COMPUTE_VERSION = 1
#: the longest one node's measurement rounds may take (seconds, predicted from the first call)
NODE_SECONDS = 2.0


def compute_cache() -> tune.TuneCache:
    """The cache of measured part times of this machine, BLAS backend and thread count."""
    name = f"deepa-compute-{blas.machine_key()}-{blas.get_backend()}-t{blas.get_num_threads()}.json"
    return tune.TuneCache.named(name, f"deepa-compute|{COMPUTE_VERSION}")


def largest_part(split: Split, shape: tuple[int, int, int, int]) -> np.ndarray:
    """The ``(4, 2)`` box of the worker with the most output elements (it sets the node's time)."""
    boxes = worker_boxes(split, shape)
    return boxes[int(np.argmax(np.prod(boxes[:, :, 1] - boxes[:, :, 0], axis=1)))]


def _dims(box: np.ndarray) -> list[int]:
    return [int(hi - lo) for lo, hi in box]


def part_net(node: PlanNode, layer_params: list[caffe_pb2.LayerParameter], split: Split,
             dtype_is_double: bool = False) -> caffe_pb2.NetParameter | None:
    """The net that runs one worker's part of ``node`` under ``split`` (None for a data layer)."""
    if node.kind == "source":
        return None
    box = largest_part(split, node.out_shape)
    out = _dims(box)
    regions = [node.rule.needed(box[None], b, s)[0] for b, s in enumerate(node.in_shapes)]
    in_dims = [_dims(r) for r in regions]
    net = caffe_pb2.NetParameter(name=f"part-{node.name}", force_backward=True)
    first = caffe_pb2.LayerParameter()
    first.CopyFrom(layer_params[0])
    del first.include[:], first.exclude[:]
    bottoms = list(first.bottom)
    if node.kind == "conv":
        p = first.convolution_param
        groups = p.group or 1
        per_out, per_in = node.out_shape[1] // groups, node.in_shapes[0][1] // groups
        spanned = -(-out[1] // per_out) if out[1] >= per_out else 1
        p.group = spanned if out[1] % spanned == 0 else 1
        in_dims[0][1] = per_in * (spanned if p.group == spanned else 1)
        p.num_output = out[1]
        _explicit_padding(p, node, out, in_dims[0])
    elif node.kind == "pool":
        _explicit_padding(first.pooling_param, node, out, in_dims[0])
    elif node.kind == "fc":
        first.inner_product_param.num_output = out[1]
    elif node.kind == "concat":
        keep = [b for b, d in enumerate(in_dims) if np.prod(d) > 0]
        bottoms = [bottoms[b] for b in keep]
        in_dims = [in_dims[b] for b in keep]
        del first.bottom[:]
        first.bottom.extend(bottoms)
    data = net.layer.add(name="part_input", type="Input")
    for name, d in zip(bottoms, in_dims):
        data.top.append(name)
        data.input_param.shape.add().dim.extend(d)
    net.layer.add().CopyFrom(first)
    for lp in layer_params[1:]:
        layer = net.layer.add()
        layer.CopyFrom(lp)
        del layer.include[:], layer.exclude[:]
    return net


def _explicit_padding(p, node: PlanNode, out: list[int], in_dims: list[int]) -> None:
    """Pad 0 and the input rows/columns that give exactly ``out``'s (the padding rows then are input rows)."""
    rule = node.rule
    for axis, win in ((2, rule.window_h), (3, rule.window_w)):
        in_dims[axis] = (out[axis] - 1) * win.stride + win.extent
    if hasattr(p, "pad_h") and (p.HasField("pad_h") or p.HasField("pad_w")):
        p.pad_h = p.pad_w = 0
    if isinstance(p, caffe_pb2.ConvolutionParameter):
        del p.pad[:]
    else:
        if p.global_pooling:
            p.global_pooling = False
            p.kernel_size = rule.window_h.extent
        p.pad = 0


def measure_part(net_param: caffe_pb2.NetParameter, cache: tune.TuneCache | None) -> float:
    """Best seconds of one forward + backward of ``net_param`` (cached by its text)."""
    text = str(net_param)
    key = "part|" + hashlib.sha1(text.encode()).hexdigest()
    hit = cache.get(key) if cache is not None else None
    if hit is None:
        net = Net(net_param, phase="TRAIN")
        try:
            def step() -> None:
                net.forward()
                net.backward()

            first = tune.measure({"step": step}, 1)["step"]
            repeats = max(1, min(tune.MAX_REPEATS, int(NODE_SECONDS / (2 * max(first, 1e-6)))))
            seconds = min(first, tune.measure({"step": step}, repeats)["step"]) if repeats > 1 else first
        finally:
            net.close()
        hit = {"seconds": seconds}
        if cache is not None:
            cache.put(key, hit)
    return float(hit["seconds"])


@dataclass
class MeasuredCompute:
    """``compute(c)`` measured on every distinct part shape of a node (see :func:`measure_part`)."""

    net: Net
    cache: tune.TuneCache | None = None
    _memo: dict[str, float] = field(default_factory=dict)

    def seconds(self, graph: PlanGraph, index: int, splits: list[Split]) -> np.ndarray:
        """Per configuration of node ``index``: the slowest worker's forward + backward seconds."""
        node = graph.nodes[index]
        params = [self.net.layer_by_name(n).param for n in node.layers]
        out = np.zeros(len(splits))
        for k, s in enumerate(splits):
            p = part_net(node, params, s)
            if p is not None:
                out[k] = measure_part(p, self.cache)
        return out


@dataclass
class ScaledCompute:
    """``compute(c) = rate[node] * (output elements of the largest part) / speed``: each node's seconds per
    output element measured once on this machine (:func:`reference_rates`), scaled to a worker
    ``speed`` times as fast (a model)."""

    rate: dict[str, float]
    speed: float = 1.0

    def seconds(self, graph: PlanGraph, index: int, splits: list[Split]) -> np.ndarray:
        """Per configuration of node ``index``: the modelled seconds of its largest part."""
        node = graph.nodes[index]
        per = self.rate.get(node.name, 0.0) / self.speed
        return np.array([per * float(np.prod(_dims(largest_part(s, node.out_shape)))) for s in splits])


def reference_rates(net: Net, graph: PlanGraph, batch: int, cache: tune.TuneCache | None = None) -> dict[str, float]:
    """Seconds per output element of every node, measured at ``batch`` samples (a sample split of the
    graph's batch: each node's forward + backward on ``batch`` whole samples)."""
    rates: dict[str, float] = {}
    for node in graph.nodes:
        if node.kind == "source":
            continue
        n = node.out_shape[0]
        split = Split(n=max(1, n // batch)) if n >= batch else Split()
        params = [net.layer_by_name(name).param for name in node.layers]
        p = part_net(node, params, split)
        if p is None:
            continue
        secs = measure_part(p, cache)
        rates[node.name] = secs / float(np.prod(_dims(largest_part(split, node.out_shape))))
    return rates
