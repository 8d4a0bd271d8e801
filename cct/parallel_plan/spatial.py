"""Spatial (height, width) splits of convolution and pooling layers on MPI ranks (DeePa's ``h`` and ``w``).

:func:`enable_spatial_split` attaches a :class:`SpatialSplitExecutor` to a data-parallel solver: every
layer runs on the rank's own ``b`` samples as under data parallelism, except the named Convolution and
Pooling layers, each split ``h=a w=N/a`` over the N ranks: rank r computes a band (a block of output
rows and columns, :func:`~.split.worker_boxes`' worker order) of the layer's output for all ``N*b``
samples of the global batch, with a copy of the layer resized to its band (the padding of the split
axes made explicit: the band's input frame carries zero rows where it overlaps the padding). Every rank
holds the whole filters. The element-wise layers that follow a split layer (ReLU, ...) run on its band.

* forward: a split layer's input frame is filled by a :class:`~.boxexchange.BoxExchange` -- from the
  ranks' samples (the net's blob) when its producer runs by sample, else from the producer's bands (a
  halo exchange with the neighbours: the rows the kernel, stride and padding read beyond the band). A
  band read by a layer that is not split (the fully-connected tail, a change of configuration) is
  returned to the sample split by another exchange (each rank gets its samples' every row);
* backward mirrors it: gradients of the gathered bands go back to the bands, each band's input
  gradient (halo included) back to its owners, summed; the filters' gradients of the band are added to
  the layer's and all-reduced with every other parameter by data parallelism (the bands' sum over the
  global batch, scaled by 1/N as the ranks' per-sample sums are), so nothing is owned and snapshots are
  the usual ones.

N ranks at batch b then train as one process at batch N*b; the bytes each rank receives equal the
planner's transfer count (:mod:`.transfer`). Refused with a :class:`PlanError` naming the layer:
dilated, 3-D or in-place convolutions, global pooling, pooling padded along a split axis, more parts
than output rows (or columns), BatchNorm after a split layer (its statistics are over the batch and
every position), a split blob read by two layers, ``--devices`` and unequal batch shares; attaching it
beside another split executor (use :mod:`.combined` for several kinds of split in one net).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..blob import Blob
from ..layers.base import Layer
from ..proto import caffe_pb2
from .boxexchange import BoxExchange
from .graph import ELEMENTWISE
from .owt import attach, layer_copy, splittable
from .split import PlanError, Split, worker_boxes

log = logging.getLogger("cct")

Shape4 = tuple[int, int, int, int]


@dataclass
class Band:
    """A blob held as bands: the local array (all samples, this rank's box) and every rank's box."""

    blob: Blob
    boxes: np.ndarray   # (N, 4, 2) every rank's box of the global tensor
    writer: int         # the layer that last wrote it


@dataclass
class BandStep:
    """One layer run on bands: its resized copy (None for element-wise layers, which run themselves),
    the input it reads (a band or the net's blob by sample), and the exchanges around it."""

    index: int
    part: Layer | None
    inp: Blob                      # the input frame (split layers) or the producer's band (element-wise)
    out: Blob                      # this rank's band of the output
    fetch: BoxExchange | None      # producer -> the input frame (split layers only)
    source: Band | None            # the producer's band, None when the producer runs by sample
    gather: BoxExchange | None = None  # the band -> the net's blob by sample (a layer outside reads it)


def _global(shape: tuple[int, ...], ranks: int, what: str) -> Shape4:
    if len(shape) != 4:
        raise PlanError(f"spatial split: {what} has shape {list(shape)}; only (N, C, H, W) blobs are split")
    return (int(shape[0]) * ranks,) + tuple(int(d) for d in shape[1:])  # type: ignore[return-value]


def _windows(layer: Layer, name: str) -> list[tuple[int, int, int]]:
    """``(extent, stride, pad)`` of the two spatial axes of a Convolution or Pooling layer."""
    if layer.type == "Convolution":
        g = layer.geom
        if g is None or len(g.in_shape) != 2:
            raise PlanError(f"spatial split: layer '{name}' is not a 2-D convolution")
        if any(d != 1 for d in g.dilation):
            raise PlanError(f"spatial split: layer '{name}' is dilated (dilation {list(g.dilation)}); not supported")
        return list(zip(g.kernel_extent, g.stride, g.pad))
    if layer.type == "Pooling":
        if layer.global_pooling:
            raise PlanError(f"spatial split: layer '{name}' is a global pooling (its window is the whole input)")
        return list(zip(layer.kernel, layer.stride, layer.pad))
    raise PlanError(f"spatial split: layer '{name}' is a {layer.type}; only Convolution and Pooling layers are "
                    "split by height or width")


def _band_copy(layer: Layer, pads: tuple[int, int], inp: Blob, out: Blob) -> Layer:
    """A copy of ``layer`` with padding ``pads`` (0 on the split axes), set up on ``inp`` -> ``out``; its
    fillers cleared (it takes the layer's weights)."""
    def edit(param: caffe_pb2.LayerParameter) -> None:
        sub = param.convolution_param if layer.type == "Convolution" else param.pooling_param
        sub.ClearField("pad")
        sub.pad_h, sub.pad_w = pads
        if layer.type == "Convolution":
            for filler in (sub.weight_filler, sub.bias_filler):
                filler.Clear()

    return layer_copy(layer, edit, inp, out)


class SpatialSplitExecutor:
    """The net's executor with some Convolution/Pooling layers split by height and width (module docstring)."""

    def __init__(self, net, comm, splits: Mapping[str, Split]):
        self.net, self.comm = net, comm
        self.size, self.rank = comm.size, comm.rank
        for name, s in splits.items():
            if name not in net.layer_names:
                raise PlanError(f"spatial split: no layer '{name}' in net '{net.name}'")
            if s.n != 1 or s.c != 1 or s.workers != self.size:
                raise PlanError(f"spatial split: layer '{name}' {s}: expected n=1 c=1 and h*w = {self.size} "
                                f"(the ranks)")
        #: the split layers' configurations (layer name -> Split)
        self.splits = dict(splits)
        self.steps: dict[int, BandStep] = {}
        self._build({net.layer_names.index(k): v for k, v in splits.items()})
        #: bytes this rank received in the exchanges of forward and backward passes
        self.bytes_moved = 0
        #: nothing is owned: the gathers before snapshots and tests move nothing
        self.gather_bytes = 0

    # -- setup ---------------------------------------------------------------------------------------
    def _sample_boxes(self, blob: Blob, what: str) -> np.ndarray:
        return worker_boxes(Split(n=self.size), _global(blob.shape, self.size, what))

    def _build(self, split_at: dict[int, Split]) -> None:
        net = self.net
        bands: dict[str, Band] = {}      # blob name -> its band (while the last writer is a band step)
        readers: dict[str, int] = {}     # blob name -> the band step reading it
        for i, layer in enumerate(net.layers):
            name, bottoms, tops = net.layer_names[i], net.bottom_names[i], net.top_names[i]
            follows = (layer.type in ELEMENTWISE and len(bottoms) == 1 and len(tops) == 1 and bottoms[0] in bands)
            if i in split_at:
                self._split_step(i, name, split_at[i], bands, readers)
            elif follows:
                self._follower_step(i, name, bands, readers)
            else:
                for b in bottoms:
                    if b in bands:
                        self._gather_at(bands.pop(b), b)
        for b, band in bands.items():  # net outputs left as bands
            self._gather_at(band, b)

    def _read(self, i: int, blob: str, bands: dict[str, Band], readers: dict[str, int]) -> Band | None:
        if blob in readers:
            raise PlanError(f"spatial split: blob '{blob}' is read by layers '{self.net.layer_names[readers[blob]]}' "
                            f"and '{self.net.layer_names[i]}'; a split blob may have one reader")
        readers[blob] = i
        return bands.pop(blob, None)  # read here: no gather for it

    def _split_step(self, i: int, name: str, split: Split, bands: dict[str, Band], readers: dict[str, int]) -> None:
        net, layer = self.net, self.net.layers[i]
        bottoms, tops = net.bottom_names[i], net.top_names[i]
        if len(bottoms) != 1 or len(tops) != 1 or bottoms[0] == tops[0]:
            raise PlanError(f"spatial split: layer '{name}' must have one bottom and one (other) top")
        windows = _windows(layer, name)
        x, y = net.blobs[bottoms[0]], net.blobs[tops[0]]
        in_shape = _global(x.shape, self.size, f"layer '{name}' bottom '{bottoms[0]}'")
        out_shape = _global(y.shape, self.size, f"layer '{name}' top '{tops[0]}'")
        split_axes = [a for a, d in ((2, split.h), (3, split.w)) if d > 1]
        for a, d in ((2, split.h), (3, split.w)):
            if d > out_shape[a]:
                raise PlanError(f"spatial split: layer '{name}' has {out_shape[a]} output "
                                f"{'rows' if a == 2 else 'columns'}, fewer than its {d} parts")
            if layer.type == "Pooling" and d > 1 and windows[a - 2][2]:
                raise PlanError(f"spatial split: layer '{name}' pools with padding {windows[a - 2][2]} along the "
                                f"split {'height' if a == 2 else 'width'}; not supported")
        out_boxes = worker_boxes(split, out_shape)
        need = np.empty_like(out_boxes)   # what each rank reads (the planner's region, clipped to the input)
        frame = np.empty_like(out_boxes)  # the band copy's input: split axes unclipped (explicit padding)
        need[:, 1] = frame[:, 1] = (0, in_shape[1])
        need[:, 0] = frame[:, 0] = (0, in_shape[0])
        for a in (2, 3):
            ext, stride, pad = windows[a - 2]
            lo = out_boxes[:, a, 0] * stride - pad
            hi = (out_boxes[:, a, 1] - 1) * stride - pad + ext
            need[:, a, 0], need[:, a, 1] = np.clip(lo, 0, in_shape[a]), np.clip(hi, 0, in_shape[a])
            if a in split_axes:
                frame[:, a, 0] = lo
                frame[:, a, 1] = hi if layer.type == "Convolution" else np.minimum(hi, in_shape[a])
            else:
                frame[:, a] = (0, in_shape[a])
        me = self.rank
        source = self._read(i, bottoms[0], bands, readers)
        own = source.boxes if source is not None else self._sample_boxes(x, f"layer '{name}' bottom '{bottoms[0]}'")
        inp = Blob(tuple(int(d) for d in frame[me, :, 1] - frame[me, :, 0]), net.dtype, name=f"{name}_band_in")
        out = Blob((1,), net.dtype, name=f"{name}_band_out")
        pads = tuple(0 if a in split_axes else windows[a - 2][2] for a in (2, 3))
        part = _band_copy(layer, pads, inp, out)  # type: ignore[arg-type]
        want = tuple(int(d) for d in out_boxes[me, :, 1] - out_boxes[me, :, 0])
        if tuple(out.shape) != want:
            raise PlanError(f"spatial split: layer '{name}': the band copy computes {list(out.shape)}, not the "
                            f"band's {list(want)}")
        fetch = BoxExchange(self.comm, own, need, frame[me, :, 0])
        self.steps[i] = BandStep(i, part, inp, out, fetch, source)
        bands[tops[0]] = Band(out, out_boxes, i)

    def _follower_step(self, i: int, name: str, bands: dict[str, Band], readers: dict[str, int]) -> None:
        net, layer = self.net, self.net.layers[i]
        if layer.type == "BatchNorm":
            raise PlanError(f"spatial split: layer '{name}' (BatchNorm) follows a split layer; its statistics "
                            "need every position: not supported")
        bottom, top = net.bottom_names[i][0], net.top_names[i][0]
        if bottom == top:
            source = bands[bottom]
            self.steps[i] = BandStep(i, None, source.blob, source.blob, None, source)
        else:
            source = self._read(i, bottom, bands, readers)
            out = Blob(source.blob.shape, net.dtype, name=f"{name}_band")
            self.steps[i] = BandStep(i, None, source.blob, out, None, source)
        bands[top] = Band(self.steps[i].out, source.boxes, i)

    def _gather_at(self, band: Band, blob: str) -> None:
        """The band step that last wrote ``blob`` returns it to the sample split (a layer outside reads it)."""
        y = self.net.blobs[blob]
        need = self._sample_boxes(y, f"blob '{blob}'")
        self.steps[band.writer].gather = BoxExchange(self.comm, band.boxes, need, need[self.rank, :, 0])

    def owned_param_ids(self) -> list[int]:
        """None: every rank holds the whole filters (their gradients are all-reduced as under data parallelism)."""
        return []

    # -- the executor interface --------------------------------------------------------------------
    def forward(self, i: int, layer: Layer, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        """Run layer ``i`` (band steps on bands, the others as they are)."""
        step = self.steps.get(i)
        if step is None:
            layer.forward(bottom, top)
            return
        if step.part is None:
            layer.reshape([step.inp], [step.out])
            layer.forward([step.inp], [step.out])
        else:
            src = step.source.blob.data if step.source is not None else bottom[0].data
            step.inp.data[...] = 0  # the padding of the split axes
            self.bytes_moved += step.fetch.forward(src, step.inp.data)
            for full, part in zip(layer.blobs, step.part.blobs):
                part.data[...] = full.data
            step.part.reshape([step.inp], [step.out])
            step.part.forward([step.inp], [step.out])
        if step.gather is not None:
            self.bytes_moved += step.gather.forward(step.out.data, top[0].data)

    def backward(self, i: int, layer: Layer, top: Sequence[Blob], propagate_down: Sequence[bool],
                 bottom: Sequence[Blob]) -> None:
        """Back-propagate layer ``i`` (see module docstring)."""
        step = self.steps.get(i)
        if step is None:
            layer.backward(top, propagate_down, bottom)
            return
        if step.gather is not None:
            self.bytes_moved += step.gather.backward(top[0].diff, step.out.diff)
        if step.part is None:
            layer.backward([step.out], [bool(propagate_down[0])], [step.inp])
            return
        for blob in step.part.blobs:
            blob.diff[...] = 0
        step.part.backward([step.out], [bool(propagate_down[0])], [step.inp])
        for full, part in zip(layer.blobs, step.part.blobs):
            full.diff[...] += part.diff
        if propagate_down[0]:
            dst = step.source.blob.diff if step.source is not None else bottom[0].diff
            self.bytes_moved += step.fetch.backward(step.inp.diff, dst)

    def finish_backward(self) -> None:
        """Nothing is left to finish (the exchanges are synchronous)."""

    def release(self) -> None:
        """Nothing to free (the exchanges run on the ranks' own communicator)."""

    def gather_owned(self, history: Sequence[np.ndarray] = ()) -> None:
        """Nothing to gather: every rank holds the whole filters and their solver history."""


def enable_spatial_split(solver, splits: Mapping[str, Split]) -> SpatialSplitExecutor:
    """Split the Convolution/Pooling layers of ``splits`` (layer name -> ``Split(h=a, w=N/a)``) of ``solver``'s
    train net by height and width over its data-parallel ranks (see module docstring)."""
    par = splittable(solver, "spatial split")
    ex = attach(solver, SpatialSplitExecutor(solver.net, par.comm, splits))
    if par.is_root:
        log.info("Spatial split on %d MPI ranks: %s; every other layer by sample", par.size,
                 ", ".join(f"{name} h={s.h} w={s.w}" for name, s in splits.items()))
    return ex
