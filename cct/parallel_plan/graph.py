"""The planner's view of a net: layers grouped into nodes, each with the output it splits, the region
rule of its inputs, the split dimensions it allows and its parameter bytes (DeePa's computation graph).

Element-wise layers with one bottom and one top (ReLU, Dropout, BatchNorm, Scale, ...) follow their
producer's split: they join the producer's node. Concat, Eltwise and Split (Caffe's, inserted where a
blob feeds several layers) are nodes of their own. A node's configuration splits its first top; other
tops (a data layer's labels) are split the same way along the axes they have.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..io import read_net_prototxt
from ..net import Net
from ..proto import caffe_pb2
from .regions import (
    AllChannels,
    ChannelWindow,
    ConcatChannels,
    Convolution,
    LossInputs,
    Pooling,
    RegionRule,
    SameBox,
    SampleRows,
    Window,
)
from .split import DIMS, PlanError

Shape4 = tuple[int, int, int, int]

#: layers that follow their producer's split (one bottom, one top, each output element from the same input element)
ELEMENTWISE = frozenset({"ReLU", "PReLU", "ELU", "Sigmoid", "TanH", "AbsVal", "Power", "Exp", "Log", "BNLL",
                         "Threshold", "Dropout", "Clip", "Swish", "BatchNorm", "Scale", "Bias"})
#: layers that produce the batch (their configuration only says which worker reads what)
SOURCES = frozenset({"Input", "Data", "ImageData", "HDF5Data", "DummyData", "MemoryData", "WindowData"})


def as4(shape: tuple[int, ...], where: str) -> Shape4:
    """A blob shape as ``(N, C, H, W)``: ``(N, C)`` -> ``(N, C, 1, 1)``; more than 4 axes is refused."""
    s = tuple(int(d) for d in shape)
    if len(s) > 4:
        raise PlanError(f"{where}: blob shape {list(s)} has more than 4 axes; the planner splits (N, C, H, W) only")
    if not s:
        return (1, 1, 1, 1)
    return s + (1,) * (4 - len(s))  # type: ignore[return-value]


@dataclass
class PlanNode:
    """One node of the plan graph: the layers it runs, what its configuration splits and its inputs."""

    name: str
    kind: str
    layers: list[str]
    types: list[str]
    out_shape: Shape4
    dims: tuple[str, ...]
    rule: RegionRule
    param_bytes: int = 0
    top_shapes: list[Shape4] = field(default_factory=list)
    #: per bottom: (producer node index, producer top index)
    inputs: list[tuple[int, int]] = field(default_factory=list)
    in_shapes: list[Shape4] = field(default_factory=list)


@dataclass
class PlanGraph:
    """The plan graph of a net: nodes in the net's order (producers before consumers)."""

    nodes: list[PlanNode]
    itemsize: int = 4

    def edges(self) -> list[tuple[int, int, int, int]]:
        """``(producer, producer top, consumer, consumer bottom)`` for every input of every node."""
        return [(u, t, v, b) for v, node in enumerate(self.nodes) for b, (u, t) in enumerate(node.inputs)]

    def index(self, name: str) -> int:
        """The index of the node named ``name`` (its first layer's name)."""
        for i, n in enumerate(self.nodes):
            if n.name == name:
                return i
        raise PlanError(f"no node named '{name}' in the plan graph (nodes: {', '.join(n.name for n in self.nodes)})")


def _learnable_bytes(layer, itemsize: int) -> int:
    total = 0
    for j, blob in enumerate(layer.blobs):
        lr = layer.param.param[j].lr_mult if j < len(layer.param.param) else 1.0
        if lr != 0:
            total += blob.count * itemsize
    return total


def region_rule(layer, in_shapes: list[Shape4], in_ndim: int) -> tuple[str, tuple[str, ...], RegionRule]:
    """``(kind, split axes, region rule)`` of ``layer`` on inputs of ``in_shapes`` (the first of ``in_ndim``
    axes): what the planner prices and :mod:`.perlayer` reads."""
    t = layer.type
    if t in SOURCES:
        return "source", DIMS, SameBox()
    if t in ("Convolution",) and len(layer.geom.in_shape) == 2:
        g = layer.geom
        wins = [Window(e, s, p) for e, s, p in zip(g.kernel_extent, g.stride, g.pad)]
        return "conv", DIMS, Convolution(wins[0], wins[1], g.channels_out, g.group)
    if t == "Pooling" and len(layer.kernel) == 2:
        wins = [Window(k, s, p) for k, s, p in zip(layer.kernel, layer.stride, layer.pad)]
        return "pool", DIMS, Pooling(wins[0], wins[1])
    if t == "LRN":
        p = layer.param.lrn_param
        if p.norm_region == p.ACROSS_CHANNELS:
            return "lrn", DIMS, ChannelWindow(int(p.local_size))
        w = Window(int(p.local_size), 1, (int(p.local_size) - 1) // 2)
        return "lrn", DIMS, Pooling(w, w)
    if t == "InnerProduct" and layer.param.inner_product_param.axis in (1, 1 - in_ndim):
        return "fc", ("n", "c"), SampleRows()
    if t == "Concat" and layer.param.concat_param.axis == 1 and not layer.param.concat_param.HasField("concat_dim"):
        offs = [0]
        for s in in_shapes:
            offs.append(offs[-1] + s[1])
        return "concat", DIMS, ConcatChannels(tuple(offs))
    if t in ("Eltwise", "Split") or t in ELEMENTWISE:
        return "same", DIMS, SameBox()
    if t == "Softmax" and layer.param.softmax_param.axis == 1:
        return "softmax", ("n", "h", "w"), AllChannels()
    if t == "SoftmaxWithLoss" and layer.param.softmax_param.axis == 1 and len(in_shapes) == 2:
        return "loss", DIMS, LossInputs()
    if t == "Accuracy" and layer.param.accuracy_param.axis == 1 and len(in_shapes) == 2:
        return "metric", DIMS, LossInputs()  # as a loss, without gradients
    return "sample", ("n",), SampleRows()


def graph_from_net(net: Net, batch: int | None = None) -> PlanGraph:
    """The plan graph of a built net; ``batch`` replaces the net's batch size (the first axis of every
    blob whose first axis is the batch) so that a net built at batch 1 plans for any batch."""
    nodes: list[PlanNode] = []
    owner: dict[str, tuple[int, int]] = {}  # blob name -> (node, top index)
    net_batch = None
    itemsize = net.dtype.itemsize

    def shape_of(name: str, where: str) -> Shape4:
        s = as4(net.blobs[name].shape, where)
        if batch is not None and net_batch is not None and s[0] == net_batch:
            s = (batch,) + s[1:]
        return s

    for layer, lname, bnames, tnames in zip(net.layers, net.layer_names, net.bottom_names, net.top_names):
        where = f"layer '{lname}'"
        if layer.type in SOURCES and tnames and net_batch is None:
            net_batch = as4(net.blobs[tnames[0]].shape, where)[0]
        for b in bnames:
            if b not in owner:
                raise PlanError(f"{where}: bottom '{b}' has no producer in the net")
        if (layer.type in ELEMENTWISE and len(bnames) == 1 and len(tnames) == 1
                and nodes[owner[bnames[0]][0]].kind != "source"):
            node_i, top_i = owner[bnames[0]]
            node = nodes[node_i]
            node.layers.append(lname)
            node.types.append(layer.type)
            node.param_bytes += _learnable_bytes(layer, itemsize)
            bn = layer.param.batch_norm_param
            if layer.type == "BatchNorm" and not (bn.HasField("use_global_stats") and bn.use_global_stats) \
                    and net.phase == 0:
                node.dims = tuple(d for d in node.dims if d not in ("h", "w"))  # batch statistics per channel
            owner[tnames[0]] = (node_i, top_i)
            continue
        in_shapes = [shape_of(b, where) for b in bnames]
        tops = [shape_of(t, where) for t in tnames]
        kind_probe = layer.type.endswith("Loss") or layer.type == "Accuracy" or not tops
        out_shape = in_shapes[0] if (kind_probe and in_shapes) else (tops[0] if tops else (1, 1, 1, 1))
        in_ndim = len(net.blobs[bnames[0]].shape) if bnames else 0
        kind, dims, rule = region_rule(layer, in_shapes, in_ndim)
        node = PlanNode(name=lname, kind=kind, layers=[lname], types=[layer.type], out_shape=out_shape, dims=dims,
                        rule=rule, param_bytes=_learnable_bytes(layer, itemsize), top_shapes=tops,
                        inputs=[owner[b] for b in bnames], in_shapes=in_shapes)
        nodes.append(node)
        for j, t in enumerate(tnames):
            owner[t] = (len(nodes) - 1, j)
    return PlanGraph(nodes, itemsize)


def planning_net(net: str | caffe_pb2.NetParameter, phase: str = "TRAIN") -> tuple[Net, int | None]:
    """``(net built at batch 1, the prototxt's batch)``: Input and DummyData shapes get batch 1 so that a
    large net is cheap to build; pass the batch to :func:`graph_from_net` to plan at the real one.
    (Other data layers are built as they are; the batch is then the net's.)"""
    param = read_net_prototxt(net) if isinstance(net, str) else net
    small = caffe_pb2.NetParameter()
    small.CopyFrom(param)
    batch = None
    for layer in small.layer:
        shapes = (layer.input_param.shape if layer.type == "Input" else
                  layer.dummy_data_param.shape if layer.type == "DummyData" else [])
        for s in shapes:
            if s.dim:
                batch = batch if batch is not None else int(s.dim[0])
                s.dim[0] = 1
    return Net(small, phase), batch
