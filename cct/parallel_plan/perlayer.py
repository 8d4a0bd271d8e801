"""Any per-layer mix of DeePa's configurations on MPI ranks: each Convolution, Pooling, InnerProduct, LRN,
Softmax, Concat, Eltwise, Split, SoftmaxWithLoss, Accuracy and data layer split ``n=.. h=.. w=.. c=..`` over the
N ranks or a divisor of them, every layer between two configurations moved by one point-to-point exchange of
exactly the regions each rank needs.

:class:`PerLayerExecutor` runs a data-parallel solver's train net (each rank reads its ``b`` samples of the
global batch ``N*b``; the layers not configured run on them as under data parallelism). A configured layer with
:class:`~.split.Split` ``s`` (``s.workers`` dividing N; rank r is worker r of :func:`~.split.worker_boxes`,
ranks from ``s.workers`` on are idle for the layer: they send their part of its input and compute nothing)
computes rank r's box of its global output -- samples, output channels, rows and columns -- with a copy of the
layer resized to the box (``num_output`` the channel slice, the padding of a split height or width made explicit
as zero rows and columns of its input frame) fed the channel slice of the weights. An LRN or a Softmax
(:data:`REGION_TYPES`) runs whole on its input region -- the planner's: ``local_size // 2`` halo channels of
an LRN across channels, halo rows and columns of one within channels, every channel of a Softmax -- and its
box is cut out of the result (the halo's outputs, another rank's, get no gradient). A Concat (along
channels) or an Eltwise (:class:`JoinStep`) moves each input from its own split to its region of the box: a
Concat straight into its channels of the output box, an Eltwise into inputs of a copy of the layer.
A Split (Caffe's, where a blob feeds several layers; :class:`~.fanout.FanOutStep`) holds one box per top and
sums their gradients; a SoftmaxWithLoss (:class:`~.losssplit.LossStep`) computes its box's losses, the
softmax's maximum and sum reduced over the ranks holding a box's channel slices, the normalizer the global
batch's (an Accuracy likewise); a data layer (:class:`~.datasplit.DataStep`) reads the global batch on every
rank and keeps its box of each top. A grouped convolution split by channel takes the groups of its slice
(whole groups, or a part of one); an in-place configured layer's top is a new blob for its readers.

* forward: the input frame is filled by a :class:`~.boxexchange.BoxExchange` from wherever the producer's
  output lives -- the net's blob by sample, or the producer's boxes under its own configuration, whatever
  the pair (n, h, w, c) -> (n', h', w', c'): each rank receives from every other exactly the intersection
  of that rank's box with its region (:mod:`.regions`: halos of a window, every input channel of a
  convolution or an InnerProduct, the same channels of a pooling); element-wise layers that follow a
  configured layer run on its box; a box read by a layer that is not configured (the loss, ...) is
  returned to the sample split by another exchange;
* backward mirrors every exchange (gradients go back to their owners, overlapping halos summed);
* parameters: a layer split ``c=1`` holds its whole filters: the box's gradients are added to the
  layer's and all-reduced with every other parameter by data parallelism; a layer split ``c>1`` owns its
  slice of output channels: the slice's gradient, scaled by 1/N (Caffe's multi-solver rule), is summed
  only among the ``n*h*w`` ranks holding the same slice (a sub-communicator), and the slices are
  all-gathered among the ``c`` ranks of one box of the other axes before snapshots and tests (and broadcast
  from rank 0 to the ranks idle for the layer).

Overlap (``overlap=True``, the default): a slice's sum is started non-blocking (``iallreduce`` in place on
a buffer per parameter made at setup, :class:`SliceSum`) as soon as the layer's backward has computed it;
every later layer's backward polls the sums in flight (MPI progresses only inside MPI calls) and
:meth:`PerLayerExecutor.finish_backward` waits for them and adds them into the layers' diffs, before the
update; the parameters all-reduced by data parallelism start from the net's backward hooks as soon as their
layer is done (:attr:`PerLayerExecutor.diffs_final_per_layer`). ``overlap=False`` waits for each sum
inside the layer's backward and starts data parallelism's buckets after the whole backward. Both run the
same operations on the same buffers (only when they complete differs), so the weights are bit-identical
and the bytes equal; a layer whose parameters another layer shares is always summed at once (its diff's
order of additions is kept).

N ranks at batch b then train as one process at batch N*b, and the bytes each rank receives in the
exchanges equal the planner's transfer count (:mod:`.transfer`; the reductions of slices are the update's).
Refused with a :class:`PlanError` naming the layer and its configuration: a worker count not dividing the
ranks, an Input, DummyData, MemoryData or WindowData layer not split by sample, a configured layer of another
type (other losses, BatchNorm, ...), a Concat, Softmax, SoftmaxWithLoss or Accuracy along an axis other than
channels, one of the last two with two tops or labels not one per position, grouped convolutions split by
channel with a slice crossing a group boundary, dilated or 3-D convolutions and global or padded poolings
split by height or width, InnerProduct layers with ``transpose`` or an axis other than 1, BatchNorm or a layer
with parameters following a channel-split layer, the scheduler's ``--devices`` split inside a rank and unequal
batch shares. In-process devices run a plan as the workers of a
:class:`~cct.distributed.threadcomm.ThreadComm` instead, one per device (:mod:`.inprocess`).
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..blob import Blob
from ..distributed.comm import Comm, Request
from ..distributed.threadcomm import ranks_word
from ..layers.base import Layer
from ..proto import caffe_pb2
from .boxexchange import BoxExchange, at_box
from .datasplit import DataStep, data_refusal
from .fanout import FanOutStep
from .graph import ELEMENTWISE, SOURCES, region_rule
from .losssplit import LOSS_TYPES, AccuracyStep, LabelledBox, LossStep, label_shape, loss_refusal
from .owt import ChannelSlice, attach, gather_rows, layer_copy, splittable
from .split import PlanError, Split, part_bounds, worker_boxes

log = logging.getLogger("cct")

Shape4 = tuple[int, int, int, int]
#: the layer types a configuration other than the sample split runs on
SPLIT_TYPES = ("Convolution", "Pooling", "InnerProduct", "LRN", "Softmax", "Concat", "Eltwise", "Split")
#: the layers computed whole on their input region (halo included; the planner's region rule), their box cut out
REGION_TYPES = ("LRN", "Softmax")
#: the graph nodes joining several inputs, each fetched from its own split to the node's box
JOIN_TYPES = ("Concat", "Eltwise")


def view4(a: np.ndarray) -> np.ndarray:
    """``a`` as a 4-D view ``(N, C, H, W)`` (a 2-D InnerProduct output is ``(N, C, 1, 1)``)."""
    return a.reshape(a.shape + (1,) * (4 - a.ndim))


def global_shape(shape: tuple[int, ...], ranks: int, what: str) -> Shape4:
    """The global ``(N, C, H, W)`` shape of a blob of one rank's ``shape`` (its samples, of N ranks')."""
    if not 1 <= len(shape) <= 4:
        raise PlanError(f"per-layer split: {what} has shape {list(shape)}; only blobs of up to 4 axes are split")
    full = (int(shape[0]) * ranks,) + tuple(int(d) for d in shape[1:])
    return full + (1,) * (4 - len(full))  # type: ignore[return-value]


def rank_boxes(split: Split, shape: Shape4, ranks: int) -> np.ndarray:
    """``(ranks, 4, 2)``: worker r's box of ``shape`` under ``split`` for the first ``split.workers`` ranks, an
    empty box for the others (idle for this layer)."""
    boxes = np.zeros((ranks, 4, 2), dtype=np.int64)
    boxes[:split.workers] = worker_boxes(split, shape)
    return boxes


@dataclass
class Placed:
    """A blob held under a configuration: this rank's box (the local array) and every rank's box."""

    blob: Blob
    boxes: np.ndarray   # (N, 4, 2)
    writer: int         # the layer that last wrote it


@dataclass
class Step:
    """One layer run on its box: the resized copy (None for an element-wise follower, which runs itself), its
    input frame and output box, the exchanges around it, and the channel slice of its parameters."""

    index: int
    split: Split
    part: Layer | None
    inp: Blob
    out: Blob
    fetch: BoxExchange | None       # the producer's boxes (or the samples) -> the input frame
    source: Placed | None           # the producer's boxes, None when it runs by sample
    lo: int = 0                     # this rank's slice [lo, hi) of the output channels (parameter rows)
    hi: int = 0
    padded: bool = False            # the frame reaches past the input (explicit zero padding)
    idle: bool = False              # this rank holds no box of the layer (a configuration on fewer ranks)
    gather: BoxExchange | None = None  # the output box -> the net's blob by sample
    frame_out: Blob | None = None   # a REGION_TYPES copy's output over its whole input frame (halo included) ...
    crop: tuple[slice, ...] = ()    # ... and this rank's box in it


@dataclass
class JoinStep:
    """A Concat or Eltwise node run on its box: each input moved from its own split (or the samples) to
    its region of the box -- Eltwise: the box of every input, fed to a copy of the layer; Concat along
    channels: the input's channels inside the box, written straight into the output box (no copy)."""

    index: int
    split: Split
    part: Layer | None              # Eltwise's copy on the box; None for Concat
    inputs: list[Blob]              # Eltwise: each input's box
    out: Blob
    fetches: list[BoxExchange]      # input k's split -> its region of the box
    sources: list[Placed | None]    # input k's boxes, None when it runs by sample
    views: list[tuple[slice, ...]]  # Concat: input k's channels in the output box
    idle: bool = False
    gather: BoxExchange | None = None

    def dst(self, k: int, diff: bool = False) -> np.ndarray:
        """Where input ``k``'s region lands (its data or gradient; a placeholder on a rank idle for it)."""
        if self.idle:
            return self.out.diff if diff else self.out.data
        if self.part is not None:
            return self.inputs[k].diff if diff else self.inputs[k].data
        return view4(self.out.diff if diff else self.out.data)[self.views[k]]


@dataclass
class SliceSum:
    """The sum of a channel-split step's parameter-slice gradients among the ranks holding the same slice:
    one buffer per parameter (made at setup), summed in place; ``deferred``: completed by
    :meth:`PerLayerExecutor.finish_backward` (else at once, inside the layer's backward)."""

    step: Step
    comm: Comm                      # the ranks holding this slice (a sub-communicator)
    bufs: list[np.ndarray]          # per parameter: its slice's gradient scaled by 1/N, then the sum
    deferred: bool
    requests: list[Request] = field(default_factory=list)  # the iallreduce requests in flight


def _refuse(name: str, split: Split, why: str) -> PlanError:
    return PlanError(f"per-layer split: layer '{name}' {split}: {why}")


def _check_parts(name: str, split: Split, shape: Shape4, what: str) -> None:
    """Refuse ``split`` of layer ``name`` when it cuts an axis of its ``what`` (``shape``) into more parts than
    the axis has."""
    for d, a in (("n", 0), ("c", 1), ("h", 2), ("w", 3)):
        if split.degree(d) > shape[a]:
            raise _refuse(name, split, f"its {what} has {shape[a]} along {d}, fewer than its {split.degree(d)} parts")


def refusal(layer: Layer, split: Split, ranks: int) -> str | None:
    """Why :class:`PerLayerExecutor` cannot run ``layer`` under ``split`` on ``ranks`` ranks (None: it can;
    the sample split ``n=ranks`` always can). The layer's own checks; its place in the net is checked when
    the executor is built."""
    if split == Split(n=ranks):
        return None
    if ranks % split.workers:
        return f"uses {split.workers} workers, which does not divide the {ranks} ranks"
    if layer.type in SOURCES:
        return data_refusal(layer)
    if layer.type in LOSS_TYPES:
        return loss_refusal(layer)
    if layer.type not in SPLIT_TYPES:
        return f"a {layer.type} layer runs by sample (n={ranks}) only; {', '.join(SPLIT_TYPES)} layers take other " \
               "configurations"
    spatial = split.h > 1 or split.w > 1
    if layer.type == "Convolution":
        g, group = layer.geom, layer.param.convolution_param.group or 1
        if g is None or len(g.in_shape) != 2:
            return "only 2-D convolutions are split"
        if spatial and any(d != 1 for d in g.dilation):
            return f"dilated (dilation {list(g.dilation)}) convolutions are not split by height or width"
        if split.c > 1 and group != 1:
            return group_refusal(g.channels_out, group, split.c)
    elif layer.type == "Pooling":
        if layer.global_pooling and spatial:
            return "a global pooling (its window is the whole input) is not split by height or width"
        for a, d in ((0, split.h), (1, split.w)):
            if d > 1 and not layer.global_pooling and layer.pad[a]:
                return f"pools with padding {layer.pad[a]} along the split {'height' if a == 0 else 'width'}; " \
                       "not supported"
    elif layer.type == "InnerProduct":
        p = layer.param.inner_product_param
        if p.transpose or p.axis != 1:
            return "only InnerProduct layers on axis 1 without transpose are split"
    elif layer.type == "Softmax":
        if layer.param.softmax_param.axis != 1 or len(layer.param.bottom) != 1:
            return "only a Softmax over channels (axis: 1) is split"
    elif layer.type == "Concat":
        p = layer.param.concat_param
        if p.HasField("concat_dim") or p.axis != 1:
            return "only a Concat along channels (axis: 1) is split"
    return None


def group_refusal(channels_out: int, group: int, c: int) -> str | None:
    """Why a convolution of ``group`` groups cannot split its ``channels_out`` outputs ``c`` ways (None: every
    slice is whole groups -- c dividing the groups -- or lies inside one group -- the groups dividing c)."""
    per_out = channels_out // group
    for lo, hi in part_bounds(channels_out, c).tolist():
        if lo // per_out != (hi - 1) // per_out and (lo % per_out or hi % per_out):
            return f"a grouped convolution (group: {group}) split c={c}: its output channels [{lo}, {hi}) " \
                   f"cross a group boundary; split by a divisor or a multiple of the groups"
    return None


def conv_groups(layer: Layer, lo: int, hi: int) -> int:
    """The groups a copy computing output channels ``[lo, hi)`` of a convolution has (its whole groups, or 1
    inside one group; :func:`group_refusal` checked)."""
    group = layer.param.convolution_param.group or 1
    per_out = layer.geom.channels_out // group
    return (hi - lo) // per_out if lo // per_out != (hi - 1) // per_out else 1


def follower_refusal(layer: Layer, split: Split) -> str | None:
    """Why an element-wise ``layer`` cannot run on the boxes of a layer split ``split`` (None: it can)."""
    if layer.type == "BatchNorm":
        return "a BatchNorm layer (its statistics need every sample and position) does not run on a split layer's box"
    if layer.blobs and split.c > 1:
        return f"a {layer.type} layer with parameters does not run on a channel-split box"
    return None


def _windows(layer: Layer, in_shape: Shape4) -> list[tuple[int, int, int]]:
    """``(extent, stride, pad)`` along height and width of a Convolution or Pooling layer (a whole axis for
    an InnerProduct and a global pooling)."""
    if layer.type == "Convolution":
        g = layer.geom
        return list(zip(g.kernel_extent, g.stride, g.pad))
    if layer.type == "Pooling" and not layer.global_pooling:
        return list(zip(layer.kernel, layer.stride, layer.pad))
    return [(in_shape[2], 1, 0), (in_shape[3], 1, 0)]


def _part_copy(layer: Layer, split: Split, lo: int, hi: int, inp: Blob, out: Blob) -> Layer:
    """A copy of ``layer`` for one box: ``outputs`` output channels (Convolution, InnerProduct), no padding
    along a split height or width (its frame carries the zeros), the groups of its slice, fillers cleared (it
    takes the layer's weights)."""
    def edit(param: caffe_pb2.LayerParameter) -> None:
        if layer.type == "InnerProduct":
            sub = param.inner_product_param
        else:
            sub = param.convolution_param if layer.type == "Convolution" else param.pooling_param
            pads = layer.geom.pad if layer.type == "Convolution" else layer.pad
            sub.ClearField("pad")
            sub.pad_h = 0 if split.h > 1 else int(pads[0])
            sub.pad_w = 0 if split.w > 1 else int(pads[1])
        if layer.type == "Convolution":
            sub.group = conv_groups(layer, lo, hi)
        if layer.type != "Pooling":
            sub.num_output = hi - lo
            for filler in (sub.weight_filler, sub.bias_filler):
                filler.Clear()

    return layer_copy(layer, edit, inp, out)


class PerLayerExecutor:
    """The net's executor with every configured layer run on its box (see module docstring); ``overlap``:
    the slices' sums and data parallelism's buckets run while backward goes on (see module docstring)."""

    def __init__(self, net, comm, splits: Mapping[str, Split], overlap: bool = True):
        self.net, self.comm = net, comm
        self.overlap = bool(overlap)
        self.size, self.rank = comm.size, comm.rank
        split_at: dict[int, Split] = {}
        for name, s in splits.items():
            if name not in net.layer_names:
                raise PlanError(f"per-layer split: no layer '{name}' in net '{net.name}'")
            i = net.layer_names.index(name)
            if s == Split(n=self.size):
                continue  # by sample: as data parallelism
            why = refusal(net.layers[i], s, self.size)
            if why is not None:
                raise _refuse(name, s, why)
            split_at[i] = s
        #: the configured layers (layer index -> Split), in net order
        self.splits = dict(sorted(split_at.items()))
        self.steps: dict[int, Step | JoinStep | LabelledBox | FanOutStep | DataStep] = {}
        self._label_shapes: dict[int, tuple[int, int, int, int]] = {}  # a split loss's labels (N, 1, H, W)
        self._build()
        #: bytes this rank received in the exchanges of forward and backward passes (the planner's transfers)
        self.bytes_moved = 0
        #: bytes this rank received summing channel slices' gradients among the ranks sharing them
        self.update_bytes = 0
        #: bytes this rank received gathering the slices (snapshots, tests)
        self.gather_bytes = 0
        #: seconds finish_backward waited for the slices' sums (what the overlap did not hide)
        self.sum_wait_s = 0.0
        self._comms: dict[Split, tuple] = {}
        self._sums: dict[int, SliceSum] = {}     # layer index -> its slice sum (made by setup_groups)
        self._in_flight: list[SliceSum] = []     # started in this backward, completed in finish_backward

    @property
    def diffs_final_per_layer(self) -> bool:
        """Whether a layer's parameter diffs left to data parallelism are final when its backward returns
        (its buckets may start from the net's backward hooks): with ``overlap``."""
        return self.overlap

    # -- setup ---------------------------------------------------------------------------------------
    def _sample_boxes(self, blob: Blob, what: str) -> np.ndarray:
        return worker_boxes(Split(n=self.size), global_shape(blob.shape, self.size, what))

    def _build(self) -> None:
        net = self.net
        placed: dict[str, Placed] = {}   # blob name -> its boxes (while the last writer is a step)
        readers: dict[str, int] = {}     # blob name -> the step reading it
        for i, layer in enumerate(net.layers):
            name, bottoms, tops = net.layer_names[i], net.bottom_names[i], net.top_names[i]
            if i in self.splits and layer.type in JOIN_TYPES:
                self._join_step(i, name, self.splits[i], placed, readers)
            elif i in self.splits and layer.type in LOSS_TYPES:
                self._loss_step(i, name, self.splits[i], placed, readers)
            elif i in self.splits and layer.type in SOURCES:
                self._data_step(i, name, self.splits[i], placed)
            elif i in self.splits and layer.type == "Split":
                self._fanout_step(i, name, self.splits[i], placed, readers)
            elif i in self.splits:
                self._split_step(i, name, self.splits[i], placed, readers)
            elif layer.type in ELEMENTWISE and len(bottoms) == 1 and len(tops) == 1 and bottoms[0] in placed:
                self._follower_step(i, name, placed, readers)
            else:
                for b in bottoms:
                    if b in placed:
                        self._gather_at(placed.pop(b), b)
        for b, p in placed.items():  # net outputs left on boxes
            self._gather_at(p, b)

    def _read(self, i: int, blob: str, placed: dict[str, Placed], readers: dict[str, int]) -> Placed | None:
        if blob in readers:
            raise PlanError(f"per-layer split: blob '{blob}' is read by layers '{self.net.layer_names[readers[blob]]}'"
                            f" and '{self.net.layer_names[i]}'; a split blob may have one reader")
        readers[blob] = i
        return placed.pop(blob, None)

    def _split_step(self, i: int, name: str, split: Split, placed: dict[str, Placed],
                    readers: dict[str, int]) -> None:
        net, layer = self.net, self.net.layers[i]
        bottoms, tops = net.bottom_names[i], net.top_names[i]
        if len(bottoms) != 1 or len(tops) != 1:
            raise _refuse(name, split, "a split layer must have one bottom and one top")
        x, y = net.blobs[bottoms[0]], net.blobs[tops[0]]
        in_shape = global_shape(x.shape, self.size, f"layer '{name}' bottom '{bottoms[0]}'")
        out_shape = global_shape(y.shape, self.size, f"layer '{name}' top '{tops[0]}'")
        for d, a in (("n", 0), ("c", 1), ("h", 2), ("w", 3)):
            if split.degree(d) > out_shape[a]:
                raise _refuse(name, split, f"its output has {out_shape[a]} along {d}, fewer than its "
                                           f"{split.degree(d)} parts")
        out_boxes = rank_boxes(split, out_shape, self.size)
        if layer.type in REGION_TYPES:  # the planner's region (LRN's halo, Softmax's channels), clipped
            need = region_rule(layer, [in_shape], 4)[2].needed(out_boxes, 0, in_shape)
            self._add_step(i, name, split, placed, readers, out_boxes, need, need)
            return
        windows = _windows(layer, in_shape)
        need = np.empty_like(out_boxes)   # what each rank reads (the planner's region, clipped to the input)
        frame = np.empty_like(out_boxes)  # the copy's input: split axes unclipped (explicit padding)
        need[:, 0] = frame[:, 0] = out_boxes[:, 0]
        need[:, 1] = frame[:, 1] = out_boxes[:, 1] if layer.type == "Pooling" else (0, in_shape[1])
        if layer.type == "Convolution" and (layer.param.convolution_param.group or 1) > 1:  # its groups' inputs
            need[:, 1] = frame[:, 1] = region_rule(layer, [in_shape], 4)[2].needed(out_boxes, 0, in_shape)[:, 1]
        for a, d in ((2, split.h), (3, split.w)):
            ext, stride, pad = windows[a - 2]
            lo = out_boxes[:, a, 0] * stride - pad
            hi = (out_boxes[:, a, 1] - 1) * stride - pad + ext
            need[:, a, 0], need[:, a, 1] = np.clip(lo, 0, in_shape[a]), np.clip(hi, 0, in_shape[a])
            need[split.workers:] = 0  # idle ranks read nothing
            if d > 1:
                frame[:, a, 0] = lo
                frame[:, a, 1] = hi if layer.type == "Convolution" else np.minimum(hi, in_shape[a])
            else:
                frame[:, a] = (0, in_shape[a])
        self._add_step(i, name, split, placed, readers, out_boxes, need, frame)

    def _add_step(self, i: int, name: str, split: Split, placed: dict[str, Placed], readers: dict[str, int],
                  out_boxes: np.ndarray, need: np.ndarray, frame: np.ndarray) -> None:
        """The step of layer ``i`` computing ``out_boxes`` from the input regions ``need``, each rank's
        held in its ``frame`` (``need`` with explicit padding where the copy does not pad)."""
        net, layer = self.net, self.net.layers[i]
        bottoms, tops = net.bottom_names[i], net.top_names[i]
        x = net.blobs[bottoms[0]]
        in_shape = global_shape(x.shape, self.size, f"layer '{name}' bottom '{bottoms[0]}'")
        idle = self.rank >= split.workers
        me = self.rank
        source = self._read(i, bottoms[0], placed, readers)
        own = source.boxes if source is not None else self._sample_boxes(x, f"layer '{name}' bottom '{bottoms[0]}'")
        if idle:  # sends its part of the others' inputs, computes nothing
            fetch = BoxExchange(self.comm, own, need, np.zeros(4, np.int64), net.dtype)
            self.steps[i] = Step(i, split, None, Blob((1,), net.dtype), Blob((1,), net.dtype), fetch, source,
                                 idle=True)
            placed[tops[0]] = Placed(self.steps[i].out, out_boxes, i)
            readers.pop(tops[0], None)  # in place: the top is a new blob for its readers
            return
        frame_shape = tuple(int(v) for v in frame[me, :, 1] - frame[me, :, 0])
        inp = Blob(frame_shape[:len(x.shape)] if layer.type == "InnerProduct" and len(x.shape) < 4 else frame_shape,
                   net.dtype, name=f"{name}_box_in")
        out = Blob((1,), net.dtype, name=f"{name}_box_out")
        lo, hi = (int(v) for v in out_boxes[me, 1])
        want = tuple(int(v) for v in out_boxes[me, :, 1] - out_boxes[me, :, 0])
        frame_out, crop = None, ()
        if layer.type in REGION_TYPES:  # runs on its whole frame; its box is cut out of the result
            frame_out = Blob((1,), net.dtype, name=f"{name}_frame_out")
            part = layer_copy(layer, lambda _param: None, inp, frame_out)
            crop = at_box(out_boxes[me], frame[me, :, 0])
            out.reshape(want)
        else:
            part = _part_copy(layer, split, lo, hi, inp, out)
        if tuple(view4(out.data).shape) != want:
            raise _refuse(name, split, f"the copy for a box computes {list(out.shape)}, not the box's {list(want)}")
        padded = bool(np.any(frame[me, :, 0] < 0) or np.any(frame[me, :, 1] > np.array(in_shape)))
        fetch = BoxExchange(self.comm, own, need, frame[me, :, 0], net.dtype)
        self.steps[i] = Step(i, split, part, inp, out, fetch, source, lo, hi, padded, frame_out=frame_out, crop=crop)
        placed[tops[0]] = Placed(out, out_boxes, i)
        readers.pop(tops[0], None)  # in place: the top is a new blob for its readers

    def _join_step(self, i: int, name: str, split: Split, placed: dict[str, Placed],
                   readers: dict[str, int]) -> None:
        net, layer = self.net, self.net.layers[i]
        bottoms, tops = net.bottom_names[i], net.top_names[i]
        if len(tops) != 1 or tops[0] in bottoms:
            raise _refuse(name, split, "a split join must have one (other) top")
        shapes = [global_shape(net.blobs[b].shape, self.size, f"layer '{name}' bottom '{b}'") for b in bottoms]
        out_shape = global_shape(net.blobs[tops[0]].shape, self.size, f"layer '{name}' top '{tops[0]}'")
        for d, a in (("n", 0), ("c", 1), ("h", 2), ("w", 3)):
            if split.degree(d) > out_shape[a]:
                raise _refuse(name, split, f"its output has {out_shape[a]} along {d}, fewer than its "
                                           f"{split.degree(d)} parts")
        rule = region_rule(layer, shapes, len(net.blobs[bottoms[0]].shape))[2]
        out_boxes = rank_boxes(split, out_shape, self.size)
        me, idle = self.rank, self.rank >= split.workers
        want = tuple(int(v) for v in out_boxes[me, :, 1] - out_boxes[me, :, 0])
        out = Blob(want[:len(net.blobs[tops[0]].shape)] if not idle else (1,), net.dtype, name=f"{name}_box_out")
        fetches, sources, inputs, views = [], [], [], []
        for k, b in enumerate(bottoms):
            need = rule.needed(out_boxes, k, shapes[k])
            source = self._read(i, b, placed, readers)
            own = source.boxes if source is not None else self._sample_boxes(net.blobs[b], f"bottom '{b}'")
            fetches.append(BoxExchange(self.comm, own, need, need[me, :, 0], net.dtype))
            sources.append(source)
            if layer.type == "Concat":  # input k's channels [off, off + C_k) of the output, inside the box
                off = int(rule.offsets[k])
                lo = int(np.clip(out_boxes[me, 1, 0], off, off + shapes[k][1]) - out_boxes[me, 1, 0])
                views.append((slice(None), slice(lo, lo + int(need[me, 1, 1] - need[me, 1, 0]))))
            elif not idle:
                inputs.append(Blob(out.shape, net.dtype, name=f"{name}_box_in{k}"))
        part = None
        if layer.type == "Eltwise" and not idle:
            part = layer_copy(layer, lambda _param: None, inputs, out)
        self.steps[i] = JoinStep(i, split, part, inputs, out, fetches, sources, views, idle)
        placed[tops[0]] = Placed(out, out_boxes, i)

    def _data_step(self, i: int, name: str, split: Split, placed: dict[str, Placed]) -> None:
        """A data layer reading the global batch and keeping this rank's box of each top (:mod:`.datasplit`)."""
        net = self.net
        tops = net.top_names[i]
        shapes = [global_shape(net.blobs[t].shape, self.size, f"layer '{name}' top '{t}'") for t in tops]
        _check_parts(name, split, shapes[0], "output")
        me, idle = self.rank, self.rank >= split.workers
        boxes = [rank_boxes(split, shape, self.size) for shape in shapes]
        outs = [Blob(tuple(int(v) for v in b[me, :, 1] - b[me, :, 0]), net.dtype, name=f"{name}_box_{t}")
                for t, b in zip(tops, boxes)]
        crops = [at_box(b[me], np.zeros(4, np.int64)) for b in boxes]
        self.steps[i] = DataStep(i, split, net.layers[i], [Blob((1,), net.dtype) for _ in tops], outs, crops,
                                 shapes[0][0], idle)
        for t, out, b in zip(tops, outs, boxes):
            placed[t] = Placed(out, b, i)

    def _fanout_step(self, i: int, name: str, split: Split, placed: dict[str, Placed],
                     readers: dict[str, int]) -> None:
        """A Split layer on its box (:mod:`.fanout`): one box per top, each placed for its reader."""
        net = self.net
        bottom, tops = net.bottom_names[i][0], net.top_names[i]
        shape = global_shape(net.blobs[bottom].shape, self.size, f"layer '{name}' bottom '{bottom}'")
        _check_parts(name, split, shape, "input")
        boxes = rank_boxes(split, shape, self.size)
        me, idle = self.rank, self.rank >= split.workers
        source = self._read(i, bottom, placed, readers)
        own = source.boxes if source is not None else self._sample_boxes(net.blobs[bottom], f"bottom '{bottom}'")
        want = tuple(int(v) for v in boxes[me, :, 1] - boxes[me, :, 0])[:len(net.blobs[bottom].shape)]
        want = want if not idle else (1,)
        step = FanOutStep(i, split, Blob(want, net.dtype, name=f"{name}_box_in"),
                          [Blob(want, net.dtype, name=f"{name}_box_{t}") for t in tops],
                          BoxExchange(self.comm, own, boxes, boxes[me, :, 0], net.dtype), source, idle)
        self.steps[i] = step
        for t, out in zip(tops, step.outs):
            placed[t] = Placed(out, boxes, i)

    def _loss_step(self, i: int, name: str, split: Split, placed: dict[str, Placed],
                   readers: dict[str, int]) -> None:
        """A SoftmaxWithLoss or an Accuracy on its box of the scores (:mod:`.losssplit`), its labels fetched
        from the samples or the data layer's boxes."""
        net, layer = self.net, self.net.layers[i]
        bottoms = net.bottom_names[i]
        scores = global_shape(net.blobs[bottoms[0]].shape, self.size, f"layer '{name}' bottom '{bottoms[0]}'")
        _check_parts(name, split, scores, "input")
        try:
            labels = label_shape(net.blobs[bottoms[1]].shape, scores, f"bottom '{bottoms[1]}'")
        except ValueError as e:
            raise _refuse(name, split, str(e)) from None
        boxes = rank_boxes(split, scores, self.size)
        me, idle = self.rank, self.rank >= split.workers
        source = self._read(i, bottoms[0], placed, readers)
        label_source = self._read(i, bottoms[1], placed, readers)
        own = source.boxes if source is not None else worker_boxes(Split(n=self.size), scores)
        label_own = label_source.boxes if label_source is not None else worker_boxes(Split(n=self.size), labels)
        label_need = boxes.copy()
        label_need[:, 1] = (0, 1)
        label_need[split.workers:] = 0
        want = tuple(int(v) for v in boxes[me, :, 1] - boxes[me, :, 0]) if not idle else (1, 1, 1, 1)
        lab_want = (want[0], 1) + want[2:]
        kind = AccuracyStep if layer.type == "Accuracy" else LossStep
        step = kind(i, split, layer, Blob(want, net.dtype, name=f"{name}_box_in"),
                    Blob(lab_want, net.dtype, name=f"{name}_box_labels"),
                    BoxExchange(self.comm, own, boxes, boxes[me, :, 0], net.dtype),
                    BoxExchange(self.comm, label_own, label_need, label_need[me, :, 0], net.dtype), source,
                    (int(boxes[me, 1, 0]), int(boxes[me, 1, 1])), scores, self.comm, idle=idle,
                    first_of_row=me % split.c == 0, label_source=label_source)
        self.steps[i] = step
        self._label_shapes[i] = labels

    def _follower_step(self, i: int, name: str, placed: dict[str, Placed], readers: dict[str, int]) -> None:
        net, layer = self.net, self.net.layers[i]
        bottom, top = net.bottom_names[i][0], net.top_names[i][0]
        writer = self.steps[placed[bottom].writer]
        why = follower_refusal(layer, writer.split)
        if why is not None:
            raise _refuse(name, writer.split, f"{why} (it follows layer '{net.layer_names[writer.index]}')")
        if bottom == top:
            source = placed[bottom]
            self.steps[i] = Step(i, writer.split, None, source.blob, source.blob, None, source, idle=writer.idle)
        else:
            source = self._read(i, bottom, placed, readers)
            out = Blob(source.blob.shape, net.dtype, name=f"{name}_box")
            self.steps[i] = Step(i, writer.split, None, source.blob, out, None, source, idle=writer.idle)
        placed[top] = Placed(self.steps[i].out, source.boxes, i)

    def _gather_at(self, p: Placed, blob: str) -> None:
        """The step that last wrote ``blob`` returns it to the sample split (a layer outside reads it)."""
        need = self._sample_boxes(self.net.blobs[blob], f"blob '{blob}'")
        step = self.steps[p.writer]
        back = BoxExchange(self.comm, p.boxes, need, need[self.rank, :, 0], self.net.dtype)
        if isinstance(step, (FanOutStep, DataStep)):
            step.gathers[self.net.top_names[p.writer].index(blob)] = back
        else:
            step.gather = back

    def _groups(self, split: Split):
        """``(slice_comm, row_comm)`` of a channel-split configuration: the ranks holding the same slice
        (None when it is one rank) and the ``c`` ranks holding every slice of one box of the other axes
        (None on a rank idle for it; collectives, made once per configuration in net order on every rank)."""
        if split not in self._comms:
            c, r = split.c, self.rank
            works = r < split.workers
            same = self.comm.split(r % c if works else None, r // c) if split.workers // c > 1 else None
            rows = self.comm if c == self.size else self.comm.split(r // c if works else None, r % c)
            self._comms[split] = (same, rows)
        return self._comms[split]

    def setup_groups(self) -> None:
        """Make the sub-communicators of the channel-split configurations (a collective: every rank) and
        the buffers of the slices' sums this rank takes part in."""
        net = self.net
        users = Counter(net.learnable_param_ids)
        shared = {lid for nid, (lid, _pid) in enumerate(net.param_layer_indices)
                  if users[net.learnable_param_ids[nid]] > 1}
        for i, s in self.splits.items():
            if s.c > 1 and isinstance(self.steps[i], LabelledBox):
                self.steps[i].row = self._groups(s)[1]
            elif s.c > 1 and net.layers[i].blobs:
                same, _rows = self._groups(s)
                step = self.steps[i]
                if same is not None and not step.idle:
                    self._sums[i] = SliceSum(step, same, [np.empty_like(p.diff) for p in step.part.blobs],
                                             self.overlap and i not in shared)

    def read_global_batches(self) -> None:
        """Make every split data layer read the whole global batch (a collective: every rank)."""
        for step in self.steps.values():
            if isinstance(step, DataStep):
                step.read_global(self.comm)

    @property
    def whole_batch(self) -> dict[str, int]:
        """The split data layers (every rank reads the whole global batch): layer name -> global batch."""
        return {self.net.layer_names[s.index]: s.global_batch for s in self.steps.values() if isinstance(s, DataStep)}

    def owned_param_ids(self) -> list[int]:
        """The parameters of the layers split by channel (each rank owns a slice; reduced here)."""
        net = self.net
        return [net.learnable_param_ids[nid] for nid, (lid, _pid) in enumerate(net.param_layer_indices)
                if lid in self.splits and self.splits[lid].c > 1]

    @property
    def loss_bytes(self) -> float:
        """Bytes this rank received in the channel reductions of split losses (the planner prices them as
        the loss node's update)."""
        return sum(s.reduce_bytes for s in self.steps.values() if isinstance(s, LabelledBox))

    # -- the executor interface --------------------------------------------------------------------
    def forward(self, i: int, layer: Layer, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        """Run layer ``i`` (configured layers and their followers on their boxes, the others as they are)."""
        step = self.steps.get(i)
        if step is None:
            layer.forward(bottom, top)
            return
        if isinstance(step, JoinStep):
            self._join_forward(step, bottom, top)
            return
        if isinstance(step, DataStep):
            self.bytes_moved += step.forward(top, view4)
            return
        if isinstance(step, FanOutStep):
            src = step.source.blob.data if step.source is not None else bottom[0].data
            self.bytes_moved += step.forward(src, [t.data for t in top], view4)
            return
        if isinstance(step, LabelledBox):
            src = step.source.blob.data if step.source is not None else bottom[0].data
            if step.label_source is not None:  # held on boxes (a split data layer)
                labels = view4(step.label_source.blob.data)
            else:
                labels = bottom[1].data.reshape((bottom[1].shape[0],) + self._label_shapes[i][1:])
            self.bytes_moved += step.forward(view4(src), labels, top)
            return
        if step.idle:
            if step.fetch is not None:
                src = step.source.blob.data if step.source is not None else bottom[0].data
                self.bytes_moved += step.fetch.forward(view4(src), view4(step.inp.data))
        elif step.part is None:
            layer.reshape([step.inp], [step.out])
            layer.forward([step.inp], [step.out])
        else:
            src = step.source.blob.data if step.source is not None else bottom[0].data
            if step.padded:
                step.inp.data[...] = 0
            self.bytes_moved += step.fetch.forward(view4(src), view4(step.inp.data))
            for full, part in zip(layer.blobs, step.part.blobs):
                part.data[...] = full.data[step.lo:step.hi] if step.split.c > 1 else full.data
            if step.frame_out is None:
                step.part.reshape([step.inp], [step.out])
                step.part.forward([step.inp], [step.out])
            else:
                step.part.forward([step.inp], [step.frame_out])
                step.out.data[...] = step.frame_out.data[step.crop]
        if step.gather is not None:
            self.bytes_moved += step.gather.forward(view4(step.out.data), view4(top[0].data))

    def backward(self, i: int, layer: Layer, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        """Back-propagate layer ``i`` (see module docstring)."""
        for red in self._in_flight:  # drive MPI's progress of the sums in flight
            for req in red.requests:
                req.test()
        step = self.steps.get(i)
        if step is None:
            layer.backward(top, propagate_down, bottom)
            return
        if isinstance(step, JoinStep):
            self._join_backward(step, top, propagate_down, bottom)
            return
        if isinstance(step, DataStep):
            return  # no gradient flows into a data layer
        if isinstance(step, FanOutStep):
            dst = step.source.blob.diff if step.source is not None else bottom[0].diff
            if propagate_down[0]:
                self.bytes_moved += step.backward([t.diff for t in top], dst, view4)
            return
        if isinstance(step, LabelledBox):
            dst = step.source.blob.diff if step.source is not None else bottom[0].diff
            self.bytes_moved += step.backward(top, propagate_down, view4(dst))
            return
        if step.gather is not None:
            self.bytes_moved += step.gather.backward(view4(top[0].diff), view4(step.out.diff))
        if step.idle:
            if step.fetch is not None and propagate_down[0]:
                dst = step.source.blob.diff if step.source is not None else bottom[0].diff
                self.bytes_moved += step.fetch.backward(view4(step.inp.diff), view4(dst))
            return
        if step.part is None:
            layer.backward([step.out], [bool(propagate_down[0])], [step.inp])
            return
        for blob in step.part.blobs:
            blob.diff[...] = 0
        if step.frame_out is None:
            step.part.backward([step.out], [bool(propagate_down[0])], [step.inp])
        else:  # the halo's outputs belong to other ranks: no gradient here
            step.frame_out.diff[...] = 0
            step.frame_out.diff[step.crop] = step.out.diff
            step.part.backward([step.frame_out], [bool(propagate_down[0])], [step.inp])
        if step.split.c > 1 and layer.blobs:
            if i in self._sums:  # the other ranks holding this slice
                self._start_sum(self._sums[i])
            elif self._groups(step.split)[0] is not None:
                raise PlanError(f"per-layer split: layer '{layer.name}' {step.split}: its slice's sum has no "
                                "buffers (setup_groups() was not called)")
            else:  # this rank holds the slice alone
                scale = self.net.dtype.type(1.0 / self.size)
                for full, part in zip(layer.blobs, step.part.blobs):
                    full.diff[step.lo:step.hi] += part.diff * scale
        else:
            for full, part in zip(layer.blobs, step.part.blobs):
                full.diff[...] += part.diff
        if propagate_down[0]:
            dst = step.source.blob.diff if step.source is not None else bottom[0].diff
            self.bytes_moved += step.fetch.backward(view4(step.inp.diff), view4(dst))

    def _join_forward(self, step: JoinStep, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        for k, fetch in enumerate(step.fetches):
            src = step.sources[k].blob.data if step.sources[k] is not None else bottom[k].data
            self.bytes_moved += fetch.forward(view4(src), view4(step.dst(k)))
        if step.part is not None:
            step.part.reshape(step.inputs, [step.out])
            step.part.forward(step.inputs, [step.out])
        if step.gather is not None:
            self.bytes_moved += step.gather.forward(view4(step.out.data), view4(top[0].data))

    def _join_backward(self, step: JoinStep, top: Sequence[Blob], propagate_down: Sequence[bool],
                       bottom: Sequence[Blob]) -> None:
        if step.gather is not None:
            self.bytes_moved += step.gather.backward(view4(top[0].diff), view4(step.out.diff))
        if step.part is not None:
            step.part.backward([step.out], [bool(d) for d in propagate_down], step.inputs)
        for k, fetch in enumerate(step.fetches):
            if propagate_down[k]:
                dst = step.sources[k].blob.diff if step.sources[k] is not None else bottom[k].diff
                self.bytes_moved += fetch.backward(view4(step.dst(k, diff=True)), view4(dst))

    def _start_sum(self, red: SliceSum) -> None:
        """Scale the step's slice gradients by 1/N into the sum's buffers and start their sums (complete
        them at once unless deferred)."""
        if red.requests:  # the previous pass's, if its finish_backward was not called
            self._complete_sum(red)
            self._in_flight.remove(red)
        scale = self.net.dtype.type(1.0 / self.size)
        for buf, part in zip(red.bufs, red.step.part.blobs):
            np.multiply(part.diff, scale, out=buf)
            red.requests.append(red.comm.iallreduce(buf, out=buf))
            self.update_bytes += int(2 * (red.comm.size - 1) / red.comm.size * buf.nbytes)
        if red.deferred:
            self._in_flight.append(red)
        else:
            self._complete_sum(red)

    def _complete_sum(self, red: SliceSum) -> None:
        """Wait for the step's slice sums and add them into the layer's parameter diffs (once per start)."""
        layer, step = self.net.layers[red.step.index], red.step
        for req in red.requests:
            req.wait()
        red.requests.clear()
        for full, buf in zip(layer.blobs, red.bufs):
            full.diff[step.lo:step.hi] += buf

    def finish_backward(self) -> None:
        """Wait for the slices' sums started in this backward and add them into the diffs (before the
        update; the time waited is :attr:`sum_wait_s`)."""
        if not self._in_flight:
            return
        t = time.perf_counter()
        for red in self._in_flight:
            self._complete_sum(red)
        self._in_flight.clear()
        self.sum_wait_s += time.perf_counter() - t

    def release(self) -> None:
        """Free the sub-communicators (collective; the executor is not used again)."""
        for same, rows in self._comms.values():
            if same is not None:
                same.free()
            if rows is not None and rows is not self.comm:
                rows.free()
        self._comms.clear()
        self._sums.clear()

    def gather_owned(self, history: Sequence[np.ndarray] = ()) -> None:
        """All-gather the channel slices of the weights (and of the solver ``history``) among the ranks
        holding one box's every slice, then, for a configuration on fewer ranks, broadcast them from rank 0
        to the idle ones, so that every rank holds the single-process values (a collective)."""
        net = self.net
        by_split: dict[Split, dict[int, ChannelSlice]] = {}
        idle_layers = []
        for i, s in self.splits.items():
            layer = net.layers[i]
            if s.c == 1 or not layer.blobs:
                continue
            if s.workers < self.size:
                idle_layers.append(i)
            step = self.steps[i]
            if step.idle:
                continue
            bounds = part_bounds(int(layer.blobs[0].shape[0]), s.c)
            by_split.setdefault(s, {})[i] = ChannelSlice(i, layer, step.part, bounds, step.inp, step.out,
                                                         self.rank % s.c)
        for s in dict.fromkeys(self.splits[i] for i in self.splits):  # net order: the same on every rank
            if s in by_split:
                self.gather_bytes += gather_rows(self._groups(s)[1], net, by_split[s], history)
        per = len(net.learnable_params)
        for nid, (lid, _pid) in enumerate(net.param_layer_indices):
            if lid in idle_layers:
                k = net.learnable_param_ids[nid]
                for a in [net.learnable_params[k].data] + [h for j, h in enumerate(history) if j % per == k]:
                    self.comm.bcast(a, root=0)
                    if self.rank:
                        self.gather_bytes += a.nbytes


def describe_splits(ex: PerLayerExecutor) -> str:
    """The configured layers of ``ex``, for the log."""
    return ", ".join(f"{ex.net.layer_names[i]} {s}" for i, s in ex.splits.items())


def build_per_layer(net, comm, splits: Mapping[str, Split], overlap: bool = True) -> PerLayerExecutor | None:
    """A :class:`PerLayerExecutor` of ``splits`` with its sub-communicators made (collective), or None when
    every layer runs by sample."""
    ex = PerLayerExecutor(net, comm, splits, overlap)
    if not ex.splits:
        return None
    ex.setup_groups()
    ex.read_global_batches()
    return ex


def enable_per_layer(solver, splits: Mapping[str, Split], overlap: bool = True) -> PerLayerExecutor | None:
    """Run ``solver``'s train net with each layer of ``splits`` (layer name -> Split) on its
    box over its data-parallel ranks (see module docstring; ``overlap``: communication overlapped with
    backward); None when every layer runs by sample."""
    par = splittable(solver, "per-layer split")
    ex = build_per_layer(solver.net, par.comm, splits, overlap)
    if ex is None:
        return None
    attach(solver, ex)
    if par.is_root:
        log.info("Per-layer splits on %d %s: %s; every other layer by sample", par.size, ranks_word(par.comm),
                 describe_splits(ex))
    return ex
