"""A SoftmaxWithLoss layer split over MPI ranks (DeePa's configurations applied to the loss): each rank holds
its box ``(samples, channels, rows, columns)`` of the scores and computes the loss of those positions exactly
as one process computes it at the global batch.

* channels split ``c`` ways: the ``c`` ranks holding the slices of one box of the other axes (a row
  sub-communicator) reduce the softmax's maximum and sum over their channels (two all-reduces of one number
  per position); each position's loss comes from the rank holding its label's channel;
* samples, rows and columns split: each rank computes the per-position losses of its box.

The loss, and the positions counted by the normalizer (``VALID``: the labels other than ``ignore_label``, each
position counted by the first rank of its row), are summed over every rank (two numbers); every rank's loss
top then holds the single-process loss, ``loss / normalizer`` with Caffe's normalizer of the global batch
(``FULL``, ``VALID``, ``BATCH_SIZE``, ``NONE``), so the solver's mean over the ranks logs that loss. Backward
gives each rank's box ``(prob - onehot) * loss_weight * N / normalizer`` on the positions with a valid label:
the data-parallel reduction divides every parameter gradient by the N ranks, which makes the global gradient
exact.

An Accuracy splits the same way (:class:`AccuracyStep`). The bytes of the channel reductions are priced by
the planner as the node's update (:func:`~.transfer.loss_reduction_cost`); the two numbers summed over all
ranks are not counted (as the solver's loss mean is not).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..blob import Blob
from ..layers.base import Layer
from ..layers.loss import FLT_MIN, check_label_range, loss_normalizer
from .boxexchange import BoxExchange
from .split import Split

#: the layers of scores and labels a configuration other than the sample split runs on
LOSS_TYPES = ("SoftmaxWithLoss", "Accuracy")


def loss_refusal(layer: Layer) -> str | None:
    """Why a loss or Accuracy ``layer`` cannot run split (None: it can; its bottoms' shapes are checked when
    built)."""
    axis = layer.param.accuracy_param.axis if layer.type == "Accuracy" else layer.param.softmax_param.axis
    if axis != 1:
        return f"only a {layer.type} over channels (axis: 1) is split"
    if len(layer.param.top) != 1:
        return f"a {layer.type} with a second top runs by sample only"
    return None


def label_shape(label: tuple[int, ...], scores: tuple[int, int, int, int], what: str) -> tuple[int, int, int, int]:
    """The global labels ``(N, 1, H, W)`` of scores ``(N, C, H, W)``: a label blob of the rank's shape
    ``label`` (``(n,)``, ``(n, 1)`` or ``(n, 1, H, W)``) laid out one label per position."""
    n, _c, h, w = scores
    ok = (len(label) == 1 and h == w == 1) or (len(label) == 2 and label[1] == 1 and h == w == 1) or \
        (len(label) == 4 and tuple(label[1:]) == (1, h, w))
    if not ok:
        raise ValueError(f"{what} has shape {list(label)}; a split loss reads labels of shape (N,), (N, 1) or "
                         f"(N, 1, H, W) for scores of {h}x{w} positions")
    return (n, 1, h, w)


@dataclass
class LabelledBox:
    """A layer of scores and labels (SoftmaxWithLoss, Accuracy) run on this rank's box of the scores."""

    index: int
    split: Split
    layer: Layer
    scores: Blob                 # this rank's box of the scores (n, c, h, w)
    labels: Blob                 # its samples' and positions' labels (n, 1, h, w)
    fetch: BoxExchange           # the producer's boxes (or the samples) -> the scores' box
    label_fetch: BoxExchange     # the labels by sample -> the box's labels
    source: object | None        # the producer's Placed (None: the scores are the net's blob by sample)
    channels: tuple[int, int]    # this rank's slice [lo, hi) of the channels
    global_shape: tuple[int, int, int, int]
    comm: object                 # every rank (the loss and its count are summed over them)
    row: object | None = None    # the c ranks of this box's row (None: c == 1 or idle)
    idle: bool = False
    first_of_row: bool = True    # counts its positions for the normalizer
    reduce_bytes: float = 0.0    # bytes received in the channel reductions
    label_source: object | None = None  # the labels' Placed (a split data layer), None: by sample
    prob: np.ndarray | None = None
    normalizer: float = 1.0

    def _reduce(self, a: np.ndarray, op: str) -> None:
        if self.row is not None:
            self.row.allreduce(a, op=op, out=a)
            self.reduce_bytes += 2.0 * (self.row.size - 1) / self.row.size * a.nbytes

    def _valid(self, xp, lab: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        valid = lab != self.layer.ignore_label if self.layer.has_ignore else xp.ones(lab.shape, dtype=bool)
        return check_label_range(self.layer, xp, lab, valid, self.global_shape[1]), valid

    def _fetch(self, src: np.ndarray, labels: np.ndarray) -> int:
        """This rank's box of the scores and its labels; returns the bytes received."""
        return self.fetch.forward(src, self.scores.data) + self.label_fetch.forward(labels, self.labels.data)

    def _box_labels(self, xp) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(scores (n, c, positions), labels (n, positions) safe to gather with, valid)`` of the box."""
        n, cb, h, w = self.scores.shape
        lab, valid = self._valid(xp, self.labels.data.reshape(n, h * w).astype(np.int64))
        return self.scores.data.reshape(n, cb, h * w), lab, valid

    def _true_scores(self, xp, x: np.ndarray, lab: np.ndarray, mine: np.ndarray) -> np.ndarray:
        """Each position's score of its label's channel from the slice holding it (0 elsewhere)."""
        lo = self.channels[0]
        picked = xp.take_along_axis(x, np.clip(lab - lo, 0, x.shape[1] - 1)[:, None, :], axis=1)[:, 0, :]
        return xp.where(mine, picked, 0)

    def _mine(self, lab: np.ndarray, valid: np.ndarray) -> np.ndarray:
        lo, hi = self.channels
        return valid & (lab >= lo) & (lab < hi)


@dataclass
class LossStep(LabelledBox):
    """A SoftmaxWithLoss layer run on this rank's box (see module docstring)."""

    def forward(self, src: np.ndarray, labels: np.ndarray, top: Sequence[Blob]) -> int:
        """The loss of the global batch on every rank's ``top``; ``src`` the producer's box (or the net's
        scores by sample), ``labels`` the labels' box (or the net's labels by sample), 4-D. Returns the bytes
        of the exchanges."""
        moved = self._fetch(src, labels)
        xp = self.scores.xp
        loss, count = 0.0, 0
        if not self.idle:
            x, lab, valid = self._box_labels(xp)
            top_x = np.ascontiguousarray(x.max(axis=1))
            self._reduce(top_x, "max")
            e = xp.exp(x - top_x[:, None, :])
            total = np.ascontiguousarray(e.sum(axis=1))
            self._reduce(total, "sum")
            self.prob = e / total[:, None, :]
            mine = self._mine(lab, valid)
            p_true = self._true_scores(xp, self.prob, lab, mine)
            logp = xp.log(xp.maximum(p_true, self.prob.dtype.type(FLT_MIN)))
            loss = float(-xp.where(mine, logp, 0).sum(dtype=self.prob.dtype))
            count = int(valid.sum()) if self.first_of_row else 0
        sums = np.array([loss, count], dtype=np.float64)
        self.comm.allreduce(sums, out=sums)
        big_n, _c, big_h, big_w = self.global_shape
        count_all = int(round(sums[1])) if self.layer.has_ignore else None
        self.normalizer = float(loss_normalizer(self.layer.normalization, big_n, big_h * big_w, count_all))
        top[0].data[...] = np.float32(sums[0]) / np.float32(self.normalizer)
        return moved

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], dst: np.ndarray) -> int:
        """The scores' gradient of this rank's box returned to its owners (``dst``: the producer's box or
        the net's scores by sample). Returns the bytes of the exchange."""
        if not propagate_down[0]:
            return 0
        if not self.idle:
            xp = self.scores.xp
            _x, lab, valid = self._box_labels(xp)
            lo, hi = self.channels
            onehot = xp.arange(lo, hi)[None, :, None] == lab[:, None, :]
            scale = top[0].diff.reshape(()) * top[0].diff.dtype.type(self.comm.size / self.normalizer)
            grad = (self.prob - onehot) * valid[:, None, :]
            self.scores.diff[...] = (grad * scale).reshape(self.scores.shape)
        return self.fetch.backward(self.scores.diff, dst)


@dataclass
class AccuracyStep(LabelledBox):
    """An Accuracy layer on this rank's box: each position's true score from the slice holding its label's
    channel and the count of channels scoring at least as high are summed over the row (two all-reduces of
    one number per position, as a split loss's), the correct and valid positions over every rank; every
    rank's top holds one process's accuracy. No backward (as Caffe's)."""

    def forward(self, src: np.ndarray, labels: np.ndarray, top: Sequence[Blob]) -> int:
        """The accuracy of the global batch on every rank's ``top``; see :meth:`LossStep.forward`."""
        moved = self._fetch(src, labels)
        xp = self.scores.xp
        correct, count = 0, 0
        if not self.idle:
            x, lab, valid = self._box_labels(xp)
            p_true = np.ascontiguousarray(self._true_scores(xp, x, lab, self._mine(lab, valid)))
            self._reduce(p_true, "sum")
            better = np.ascontiguousarray((x >= p_true[:, None, :]).sum(axis=1).astype(x.dtype))
            self._reduce(better, "sum")
            hit = (better - 1 < self.layer.top_k) & valid  # the true class counts itself
            if self.first_of_row:
                correct, count = int(hit.sum()), int(valid.sum())
        sums = np.array([correct, count], dtype=np.float64)
        self.comm.allreduce(sums, out=sums)
        top[0].data[...] = 0 if sums[1] == 0 else np.float32(sums[0] / sums[1])
        return moved

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], dst: np.ndarray) -> int:
        """Nothing: an Accuracy takes no gradient."""
        return 0
