"""Loss and metric layers, as BVLC Caffe (1.0) computes them.

Every loss layer writes a 0-d top (shape ``()``). In backward the loss weight is read from
``top[0].diff`` (Caffe stores the loss weight in the loss top's diff) and scales the gradient.
Label bottoms cannot receive a gradient: ``allow_force_backward`` is False for them and a
``propagate_down`` request for them raises, as Caffe's ``LOG(FATAL)`` does.

Layers: Softmax, SoftmaxWithLoss, EuclideanLoss, SigmoidCrossEntropyLoss, HingeLoss,
ContrastiveLoss, MultinomialLogisticLoss, InfogainLoss, Accuracy.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from ..blob import Blob
from ..device.deferred import layer_check
from ..errors import CctError
from ..io.blobproto import blobproto_to_array, read_binaryproto
from ..proto import caffe_pb2
from .base import Layer, register

FLT_MIN = float(np.finfo(np.float32).tiny)  # Caffe's FLT_MIN clamp in SoftmaxWithLoss
LOG_THRESHOLD = 1e-20  # Caffe's kLOG_THRESHOLD

_NORM = caffe_pb2.LossParameter
_NORM_NAMES = {_NORM.FULL: "FULL", _NORM.VALID: "VALID", _NORM.BATCH_SIZE: "BATCH_SIZE", _NORM.NONE: "NONE"}


def softmax(xp, x, axis: int):
    """Numerically stable softmax of ``x`` along ``axis`` (subtracts the max, as Caffe does)."""
    e = xp.exp(x - x.max(axis=axis, keepdims=True))
    e /= e.sum(axis=axis, keepdims=True)
    return e


def _shape_str(blob: Blob) -> str:
    return str(list(blob.shape))


def _label_layout(layer: Layer, bottom: Sequence[Blob], axis_param: int, axis_name: str) -> None:
    """Set ``layer.axis/outer/inner/num_labels`` for predictions vs labels (one label per position).

    Caffe's check shared by SoftmaxWithLoss, InfogainLoss and Accuracy; names both shapes on a mismatch.
    """
    try:
        layer.axis = bottom[0].canonical_axis(axis_param)
    except CctError as e:
        raise layer.error(str(e)) from None
    layer.outer = bottom[0].count_range(0, layer.axis)
    layer.inner = bottom[0].count_range(layer.axis + 1)
    layer.num_labels = bottom[0].shape[layer.axis]
    if layer.outer * layer.inner != bottom[1].count:
        raise layer.error(
            f"number of labels must match number of predictions; e.g., if {axis_name} axis == 1 and "
            "prediction shape is (N, C, H, W), label count (number of labels) must be N*H*W, with "
            f"integer values in {{0, 1, ..., C-1}}. Got predictions {_shape_str(bottom[0])} "
            f"({axis_name} axis {layer.axis}) and labels {_shape_str(bottom[1])}")


class LossLayer(Layer):
    """Caffe's LossLayer: two bottoms (prediction, label), a 0-d loss top, label gets no gradient."""

    is_loss = True
    exact_num_bottom = 2
    exact_num_top = 1

    def allow_force_backward(self, bottom_index: int) -> bool:
        return bottom_index != 1

    def _loss_reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        """LossLayer::Reshape: same first dimension, 0-d loss top."""
        for i, b in enumerate(bottom[:2]):
            if b.num_axes < 1:
                raise self.error(f"bottom[{i}] '{b.name}' must have at least one axis, got shape ()")
        if bottom[0].shape[0] != bottom[1].shape[0]:
            raise self.error(
                f"the data and label should have the same first dimension: bottom[0] {_shape_str(bottom[0])} "
                f"vs bottom[1] {_shape_str(bottom[1])}")
        top[0].reshape(())

    def _no_label_backward(self, propagate_down: Sequence[bool], label_indices: Sequence[int] = (1,)) -> None:
        for i in label_indices:
            if i < len(propagate_down) and propagate_down[i]:
                what = "label" if i == 1 else "this"
                raise self.error(f"cannot backpropagate to {what} input bottom[{i}] "
                                 "(set propagate_down: false for it)")

    def _check_labels(self, xp, labels, valid, num_labels: int):
        """Labels (ints) must lie in [0, num_labels) where valid (Caffe only DCHECKs this); returns them as
        gather indices (see :func:`check_label_range`)."""
        return check_label_range(self, xp, labels, valid, num_labels)


def check_label_range(layer: Layer, xp, labels, valid, num_labels: int):
    """Fail naming the first label outside [0, num_labels) where ``valid``, with its item in the batch
    (``labels`` is (items,) or (items, positions); the solver adds the iteration). Through the net's
    :class:`~cct.device.deferred.DeviceChecks`: at once on numpy, at the next boundary on a device net.

    Returns the labels as indices safe to gather with: 0 where ignored or out of range (a bad label
    may be reported only at the next boundary: it must not read out of bounds before)."""
    ok = valid & (labels >= 0) & (labels < num_labels)
    bad = valid ^ ok  # valid but out of range
    inner = labels.shape[1] if labels.ndim > 1 else 1

    def describe(flat: int, value: int) -> str:
        where = f"item {flat // inner} of the batch" + (f", position {flat % inner}" if inner > 1 else "")
        return f"label value {value} out of range [0, {num_labels}) at {where} (bottom[1])"

    layer_check(layer, "label range", bad, labels, describe)
    return xp.where(ok, labels, 0)


def _normalization_mode(layer: Layer, default: int, allow_legacy: bool = True) -> int:
    """The loss_param normalization, honouring the legacy ``normalize`` flag as Caffe does."""
    lp = layer.param.loss_param
    if lp.HasField("normalization"):
        return lp.normalization
    if lp.HasField("normalize"):
        if not allow_legacy:
            raise layer.error('loss_param.normalize is deprecated; use "normalization"')
        return _NORM.VALID if lp.normalize else _NORM.BATCH_SIZE
    return default


def loss_normalizer(mode: int, outer: int, inner: int, valid_count):
    """Caffe's get_normalizer, clamped to >= 1 (``valid_count`` may be an xp scalar)."""
    if mode == _NORM.FULL:
        return max(1, outer * inner)
    if mode == _NORM.VALID:
        if valid_count is None:
            return max(1, outer * inner)
        if isinstance(valid_count, (int, float)):
            return max(1, valid_count)
        return valid_count.clip(1, None)
    if mode == _NORM.BATCH_SIZE:
        return max(1, outer)
    if mode == _NORM.NONE:
        return 1
    raise CctError(f"unknown normalization mode {mode}")


# --------------------------------------------------------------------------------------------
@register("Softmax")
class SoftmaxLayer(Layer):
    """Softmax along ``softmax_param.axis`` (default 1), numerically stable."""

    param_fields = ("softmax_param",)
    exact_num_bottom = 1
    exact_num_top = 1

    def layer_setup(self, bottom, top):
        self.axis_param = self.param.softmax_param.axis

    def reshape(self, bottom, top):
        try:
            self.axis = bottom[0].canonical_axis(self.axis_param)
        except CctError as e:
            raise self.error(str(e)) from None
        if top[0] is not bottom[0]:
            top[0].reshape(bottom[0].shape)

    def forward(self, bottom, top):
        xp = bottom[0].xp
        top[0].data[...] = softmax(xp, bottom[0].data, self.axis)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        y, dy = top[0].data, top[0].diff
        dot = (dy * y).sum(axis=self.axis, keepdims=True)
        bottom[0].diff[...] = (dy - dot) * y


# --------------------------------------------------------------------------------------------
@register("SoftmaxWithLoss")
class SoftmaxWithLossLayer(LossLayer):
    """Softmax + multinomial logistic loss (Caffe's SoftmaxWithLoss); optional top[1] = probabilities."""

    param_fields = ("softmax_param", "loss_param")
    exact_num_top = -1
    min_num_top = 1
    max_num_top = 2

    def layer_setup(self, bottom, top):
        self.axis_param = self.param.softmax_param.axis
        lp = self.param.loss_param
        self.has_ignore = lp.HasField("ignore_label")
        self.ignore_label = lp.ignore_label
        self.normalization = _normalization_mode(self, _NORM.VALID)

    def reshape(self, bottom, top):
        self._loss_reshape(bottom, top)
        _label_layout(self, bottom, self.axis_param, "softmax")
        if len(top) >= 2:
            top[1].reshape(bottom[0].shape)

    def _labels(self, xp, label_blob):
        lab = label_blob.data.reshape(self.outer, self.inner).astype(xp.int64)
        valid = lab != self.ignore_label if self.has_ignore else xp.ones(lab.shape, dtype=bool)
        return self._check_labels(xp, lab, valid, self.num_labels), valid

    def forward(self, bottom, top):
        xp = bottom[0].xp
        x = bottom[0].data.reshape(self.outer, self.num_labels, self.inner)
        prob = softmax(xp, x, 1)
        self.prob = prob
        lab, valid = self._labels(xp, bottom[1])
        p_true = xp.take_along_axis(prob, lab[:, None, :], axis=1)[:, 0, :]
        logp = xp.log(xp.maximum(p_true, prob.dtype.type(FLT_MIN)))
        loss = -xp.where(valid, logp, 0).sum()
        count = valid.sum()
        top[0].data[...] = loss / loss_normalizer(self.normalization, self.outer, self.inner, count)
        if len(top) >= 2:
            top[1].data[...] = prob.reshape(bottom[0].shape)

    def backward(self, top, propagate_down, bottom):
        self._no_label_backward(propagate_down)
        if not propagate_down[0]:
            return
        xp = bottom[0].xp
        prob = getattr(self, "prob", None)  # from the forward pass, as Caffe's prob_
        if prob is None or prob.shape != (self.outer, self.num_labels, self.inner):
            prob = softmax(xp, bottom[0].data.reshape(self.outer, self.num_labels, self.inner), 1)
        lab, valid = self._labels(xp, bottom[1])
        onehot = xp.arange(self.num_labels)[None, :, None] == lab[:, None, :]
        grad = (prob - onehot) * valid[:, None, :]
        count = valid.sum()
        scale = top[0].diff / loss_normalizer(self.normalization, self.outer, self.inner, count)
        bottom[0].diff[...] = (grad * scale).reshape(bottom[0].shape)


# --------------------------------------------------------------------------------------------
@register("EuclideanLoss")
class EuclideanLossLayer(LossLayer):
    """sum((a - b)^2) / (2N); both bottoms get a gradient (the second with the opposite sign)."""

    param_fields = ()

    def allow_force_backward(self, bottom_index: int) -> bool:
        return True

    def reshape(self, bottom, top):
        self._loss_reshape(bottom, top)
        if bottom[0].count_range(1) != bottom[1].count_range(1):
            raise self.error(f"inputs must have the same dimension: bottom[0] {_shape_str(bottom[0])} "
                             f"vs bottom[1] {_shape_str(bottom[1])}")

    def forward(self, bottom, top):
        d = bottom[0].data.reshape(-1) - bottom[1].data.reshape(-1)
        self.diff_ = d
        top[0].data[...] = (d * d).sum() / bottom[0].shape[0] / 2

    def backward(self, top, propagate_down, bottom):
        d = bottom[0].data.reshape(-1) - bottom[1].data.reshape(-1)
        for i in (0, 1):
            if propagate_down[i]:
                sign = 1.0 if i == 0 else -1.0
                alpha = sign * top[0].diff / bottom[i].shape[0]
                bottom[i].diff[...] = (alpha * d).reshape(bottom[i].shape)


# --------------------------------------------------------------------------------------------
@register("SigmoidCrossEntropyLoss")
class SigmoidCrossEntropyLossLayer(LossLayer):
    """Cross-entropy of sigmoid(x) against targets in [0, 1]; default normalization BATCH_SIZE."""

    param_fields = ("loss_param", "sigmoid_param")

    def layer_setup(self, bottom, top):
        lp = self.param.loss_param
        self.has_ignore = lp.HasField("ignore_label")
        self.ignore_label = lp.ignore_label
        self.normalization = _normalization_mode(self, _NORM.BATCH_SIZE)

    def reshape(self, bottom, top):
        self._loss_reshape(bottom, top)
        self.outer = bottom[0].shape[0]
        self.inner = bottom[0].count_range(1)
        if bottom[0].count != bottom[1].count:
            raise self.error(f"inputs must have the same count: bottom[0] {_shape_str(bottom[0])} "
                             f"vs bottom[1] {_shape_str(bottom[1])}")

    def _valid(self, xp, t):
        if self.has_ignore:
            return t.astype(xp.int64) != self.ignore_label
        return None

    def forward(self, bottom, top):
        xp = bottom[0].xp
        x = bottom[0].data.reshape(-1)
        t = bottom[1].data.reshape(-1)
        pos = (x >= 0).astype(x.dtype)
        per = x * (t - pos) - xp.log1p(xp.exp(x - 2 * x * pos))
        valid = self._valid(xp, t)
        if valid is None:
            loss = -per.sum()
            count = x.size
        else:
            loss = -xp.where(valid, per, 0).sum()
            count = valid.sum()
        self.norm_ = loss_normalizer(self.normalization, self.outer, self.inner, count)
        top[0].data[...] = loss / self.norm_

    def backward(self, top, propagate_down, bottom):
        self._no_label_backward(propagate_down)
        if not propagate_down[0]:
            return
        xp = bottom[0].xp
        x = bottom[0].data.reshape(-1)
        t = bottom[1].data.reshape(-1)
        grad = 1 / (1 + xp.exp(-x)) - t
        valid = self._valid(xp, t)
        if valid is not None:
            grad = grad * valid
            norm = loss_normalizer(self.normalization, self.outer, self.inner, valid.sum())
        else:
            norm = loss_normalizer(self.normalization, self.outer, self.inner, x.size)
        bottom[0].diff[...] = (grad * (top[0].diff / norm)).reshape(bottom[0].shape)


# --------------------------------------------------------------------------------------------
@register("HingeLoss")
class HingeLossLayer(LossLayer):
    """One-vs-all hinge loss: sum_k max(0, 1 - d(l==k) x_k)^p / N with d = +1/-1, p = 1 (L1) or 2 (L2)."""

    param_fields = ("hinge_loss_param",)

    def layer_setup(self, bottom, top):
        self.norm = self.param.hinge_loss_param.norm
        if self.norm not in (caffe_pb2.HingeLossParameter.L1, caffe_pb2.HingeLossParameter.L2):
            raise self.unsupported(f"hinge_loss_param.norm = {self.norm}")

    def reshape(self, bottom, top):
        self._loss_reshape(bottom, top)
        self.num = bottom[0].shape[0]
        self.dim = bottom[0].count // max(self.num, 1)
        if bottom[1].count != self.num:
            raise self.error(f"needs one label per item: predictions {_shape_str(bottom[0])}, "
                             f"labels {_shape_str(bottom[1])}")

    def _margins(self, xp, bottom):
        x = bottom[0].data.reshape(self.num, self.dim)
        lab = bottom[1].data.reshape(-1).astype(xp.int64)
        self._check_labels(xp, lab, xp.ones(lab.shape, dtype=bool), self.dim)
        sign = xp.where(xp.arange(self.dim)[None, :] == lab[:, None], -1, 1).astype(x.dtype)
        return xp.maximum(0, 1 + sign * x), sign

    def forward(self, bottom, top):
        xp = bottom[0].xp
        m, _ = self._margins(xp, bottom)
        if self.norm == caffe_pb2.HingeLossParameter.L1:
            loss = m.sum()
        else:
            loss = (m * m).sum()
        top[0].data[...] = loss / self.num

    def backward(self, top, propagate_down, bottom):
        self._no_label_backward(propagate_down)
        if not propagate_down[0]:
            return
        xp = bottom[0].xp
        m, sign = self._margins(xp, bottom)
        g = m * sign  # Caffe flips the true class's sign back
        if self.norm == caffe_pb2.HingeLossParameter.L1:
            g = xp.sign(g) * (top[0].diff / self.num)
        else:
            g = g * (top[0].diff * 2 / self.num)
        bottom[0].diff[...] = g.reshape(bottom[0].shape)


# --------------------------------------------------------------------------------------------
@register("ContrastiveLoss")
class ContrastiveLossLayer(LossLayer):
    """Contrastive loss of feature pairs (a, b) with similarity labels; sum / 2N."""

    param_fields = ("contrastive_loss_param",)
    exact_num_bottom = 3

    def allow_force_backward(self, bottom_index: int) -> bool:
        return bottom_index != 2

    def layer_setup(self, bottom, top):
        p = self.param.contrastive_loss_param
        self.margin = float(p.margin)
        self.legacy = bool(p.legacy_version)

    def reshape(self, bottom, top):
        self._loss_reshape(bottom, top)
        a, b, s = bottom
        try:
            ok = (a.channels == b.channels and a.height == 1 and a.width == 1 and b.height == 1
                  and b.width == 1 and s.channels == 1 and s.height == 1 and s.width == 1)
        except CctError as e:
            raise self.error(str(e)) from None
        if not ok or a.shape[0] != s.shape[0]:
            raise self.error(
                f"expects features (N, C) or (N, C, 1, 1) for both bottom[0] and bottom[1] and similarity "
                f"labels (N,) for bottom[2]; got {_shape_str(a)}, {_shape_str(b)}, {_shape_str(s)}")
        self.num = a.shape[0]

    def _terms(self, xp, bottom):
        a = bottom[0].data.reshape(self.num, -1)
        b = bottom[1].data.reshape(self.num, -1)
        d = a - b
        dist_sq = (d * d).sum(axis=1)
        sim = bottom[2].data.reshape(-1).astype(xp.int64) != 0
        return d, dist_sq, sim

    def forward(self, bottom, top):
        xp = bottom[0].xp
        d, dist_sq, sim = self._terms(xp, bottom)
        if self.legacy:
            dis = xp.maximum(self.margin - dist_sq, 0)
        else:
            dis = xp.maximum(self.margin - xp.sqrt(dist_sq), 0) ** 2
        loss = xp.where(sim, dist_sq, dis).sum()
        top[0].data[...] = loss / self.num / 2

    def backward(self, top, propagate_down, bottom):
        self._no_label_backward(propagate_down, (2,))
        xp = bottom[0].xp
        d, dist_sq, sim = self._terms(xp, bottom)
        for i in (0, 1):
            if not propagate_down[i]:
                continue
            sign = 1.0 if i == 0 else -1.0
            alpha = sign * top[0].diff / bottom[i].shape[0]
            if self.legacy:
                mdist = self.margin - dist_sq
                beta = -alpha * xp.ones_like(dist_sq)
            else:
                dist = xp.sqrt(dist_sq)
                mdist = self.margin - dist
                beta = -alpha * mdist / (dist + 1e-4)  # Caffe's exact (regularised) formula
            coef = xp.where(sim, alpha, xp.where(mdist > 0, beta, 0))
            bottom[i].diff[...] = (coef[:, None] * d).reshape(bottom[i].shape)


# --------------------------------------------------------------------------------------------
@register("MultinomialLogisticLoss")
class MultinomialLogisticLossLayer(LossLayer):
    """-log(max(p[label], 1e-20)) averaged over N; bottom[0] holds probabilities."""

    param_fields = ()

    def reshape(self, bottom, top):
        self._loss_reshape(bottom, top)
        lb = bottom[1]
        if lb.num_axes > 4 or lb.count != lb.shape[0]:
            raise self.error(f"label must be (N,) or (N, 1, 1, 1), got {_shape_str(lb)}")
        self.num = bottom[0].shape[0]
        self.dim = bottom[0].count // max(self.num, 1)

    def _p(self, xp, bottom):
        p = bottom[0].data.reshape(self.num, self.dim)
        lab = bottom[1].data.reshape(-1).astype(xp.int64)
        lab = self._check_labels(xp, lab, xp.ones(lab.shape, dtype=bool), self.dim)
        pt = xp.take_along_axis(p, lab[:, None], axis=1)[:, 0]
        return xp.maximum(pt, p.dtype.type(LOG_THRESHOLD)), lab

    def forward(self, bottom, top):
        xp = bottom[0].xp
        pt, _ = self._p(xp, bottom)
        top[0].data[...] = -xp.log(pt).sum() / self.num

    def backward(self, top, propagate_down, bottom):
        self._no_label_backward(propagate_down)
        if not propagate_down[0]:
            return
        xp = bottom[0].xp
        pt, lab = self._p(xp, bottom)
        scale = -top[0].diff / self.num
        onehot = xp.arange(self.dim)[None, :] == lab[:, None]
        g = xp.where(onehot, (scale / pt)[:, None], 0)
        bottom[0].diff[...] = g.reshape(bottom[0].shape).astype(bottom[0].dtype)


# --------------------------------------------------------------------------------------------
@register("InfogainLoss")
class InfogainLossLayer(LossLayer):
    """Infogain loss with an internal softmax (this Caffe's version): -sum_k H[l, k] log p_k / norm.

    H comes from ``infogain_loss_param.source`` (a .binaryproto, path relative to the working
    directory as in Caffe) or from a third bottom. ``loss_param`` gives ignore_label and the
    normalization (default VALID; the legacy ``normalize`` flag is rejected, as in Caffe).
    Optional top[1] = the softmax probabilities.
    """

    param_fields = ("infogain_loss_param", "loss_param")
    exact_num_bottom = -1
    min_num_bottom = 2
    max_num_bottom = 3
    exact_num_top = -1
    min_num_top = 1
    max_num_top = 2

    def allow_force_backward(self, bottom_index: int) -> bool:
        return bottom_index == 0

    def layer_setup(self, bottom, top):
        ip = self.param.infogain_loss_param
        # BVLC's InfogainLossParameter has `axis` (default 1); use it when the proto carries it.
        self.axis_param = int(getattr(ip, "axis", 1))
        lp = self.param.loss_param
        self.has_ignore = lp.HasField("ignore_label")
        self.ignore_label = lp.ignore_label
        self.normalization = _normalization_mode(self, _NORM.VALID, allow_legacy=False)
        self.infogain = None
        if len(bottom) < 3:
            if not ip.HasField("source"):
                raise self.error("infogain matrix source must be specified "
                                 "(infogain_loss_param.source or a third bottom)")

            path = ip.source
            if not os.path.exists(path):
                raise self.error(f"cannot read infogain_loss_param.source '{path}' "
                                 f"(relative paths are relative to the working directory {os.getcwd()})")
            try:
                self.infogain = blobproto_to_array(read_binaryproto(path))
            except CctError as e:
                raise self.error(f"infogain_loss_param.source: {e}") from None
        elif ip.HasField("source"):
            raise self.error("H is given both as a third bottom and as infogain_loss_param.source")

    def reshape(self, bottom, top):
        self._loss_reshape(bottom, top)
        _label_layout(self, bottom, self.axis_param, "infogain")
        hcount = bottom[2].count if len(bottom) >= 3 else int(self.infogain.size)
        if hcount != self.num_labels * self.num_labels:
            hshape = _shape_str(bottom[2]) if len(bottom) >= 3 else str(list(self.infogain.shape))
            raise self.error(f"H must be {self.num_labels}x{self.num_labels} for {self.num_labels} labels, "
                             f"got shape {hshape}")
        if len(top) >= 2:
            top[1].reshape(bottom[0].shape)

    def _H(self, xp, bottom, dtype):
        if len(bottom) >= 3:
            return bottom[2].data.reshape(self.num_labels, self.num_labels)
        key = (xp.__name__, np.dtype(dtype).str)
        cache = getattr(self, "_h_cache", None)
        if cache is None or cache[0] != key:
            h = xp.asarray(self.infogain.reshape(self.num_labels, self.num_labels).astype(dtype))
            self._h_cache = (key, h)
        return self._h_cache[1]

    def _common(self, bottom):
        xp = bottom[0].xp
        x = bottom[0].data.reshape(self.outer, self.num_labels, self.inner)
        prob = softmax(xp, x, 1)
        lab = bottom[1].data.reshape(self.outer, self.inner).astype(xp.int64)
        valid = lab != self.ignore_label if self.has_ignore else xp.ones(lab.shape, dtype=bool)
        lab = self._check_labels(xp, lab, valid, self.num_labels)
        H = self._H(xp, bottom, x.dtype)
        rows = xp.moveaxis(H[lab], -1, 1)  # (outer, C, inner): H[label, k]
        return xp, prob, valid, rows, H, lab

    def forward(self, bottom, top):
        xp, prob, valid, rows, _, _ = self._common(bottom)
        logp = xp.log(xp.maximum(prob, prob.dtype.type(LOG_THRESHOLD)))
        loss = -((rows * logp).sum(axis=1) * valid).sum()
        top[0].data[...] = loss / loss_normalizer(self.normalization, self.outer, self.inner, valid.sum())
        if len(top) >= 2:
            top[1].data[...] = prob.reshape(bottom[0].shape)

    def backward(self, top, propagate_down, bottom):
        self._no_label_backward(propagate_down, (1, 2))
        if not propagate_down[0]:
            return
        xp, prob, valid, rows, H, lab = self._common(bottom)
        row_sum = H.sum(axis=1)[lab]  # (outer, inner)
        g = (prob * row_sum[:, None, :] - rows) * valid[:, None, :]
        scale = top[0].diff / loss_normalizer(self.normalization, self.outer, self.inner, valid.sum())
        bottom[0].diff[...] = (g * scale).reshape(bottom[0].shape)


# --------------------------------------------------------------------------------------------
@register("Accuracy")
class AccuracyLayer(Layer):
    """Top-k accuracy (ties count against: a class scoring >= the true one ranks above it).

    Optional top[1]: per-class accuracy, shape (num_classes,). No backward.
    """

    param_fields = ("accuracy_param",)
    exact_num_bottom = 2
    min_num_top = 1
    max_num_top = 2

    def allow_force_backward(self, bottom_index: int) -> bool:
        return False

    def layer_setup(self, bottom, top):
        p = self.param.accuracy_param
        self.top_k = int(p.top_k)
        self.axis_param = p.axis
        self.has_ignore = p.HasField("ignore_label")
        self.ignore_label = p.ignore_label

    def reshape(self, bottom, top):
        if bottom[1].count == 0 or self.top_k > bottom[0].count // bottom[1].count:
            raise self.error(f"top_k must be less than or equal to the number of classes "
                             f"(top_k {self.top_k}, predictions {_shape_str(bottom[0])}, "
                             f"labels {_shape_str(bottom[1])})")
        _label_layout(self, bottom, self.axis_param, "label")
        top[0].reshape(())
        if len(top) > 1:
            top[1].reshape((self.num_labels,))

    def forward(self, bottom, top):
        xp = bottom[0].xp
        x = bottom[0].data.reshape(self.outer, self.num_labels, self.inner)
        lab = bottom[1].data.reshape(self.outer, self.inner).astype(xp.int64)
        valid = lab != self.ignore_label if self.has_ignore else xp.ones(lab.shape, dtype=bool)
        safe = check_label_range(self, xp, lab, valid, self.num_labels)
        p_true = xp.take_along_axis(x, safe[:, None, :], axis=1)  # (outer, 1, inner)
        better = (x >= p_true).sum(axis=1) - 1  # the true class counts itself
        correct = (better < self.top_k) & valid
        count = valid.sum()
        acc = correct.sum()
        top[0].data[...] = xp.where(count == 0, 0, acc / xp.maximum(count, 1))
        if len(top) > 1:
            # per-class counts as sums of one-hot rows: no data-dependent shape, no read on the host
            dt = top[1].dtype
            onehot = safe[:, :, None] == xp.arange(self.num_labels)
            per_n = (onehot & valid[:, :, None]).sum(axis=(0, 1)).astype(dt)
            per_c = (onehot & correct[:, :, None]).sum(axis=(0, 1)).astype(dt)
            top[1].data[...] = xp.where(per_n == 0, 0, per_c / xp.maximum(per_n, 1))

    def backward(self, top, propagate_down, bottom):
        if any(propagate_down):
            raise self.error("has no backward pass (Accuracy is not differentiable)")
