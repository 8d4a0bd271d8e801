"""Caffe's per-parameter update rules (src/caffe/solvers/*.cpp), written once against the array module.

Every function works in place on arrays of the parameter's dtype (numpy or cupy) and leaves the
value to subtract from the weights in ``diff`` (``Net.update`` then does ``data -= diff``). Scalars
are rounded to the parameter dtype first, as Caffe's ``Dtype`` arithmetic does.

Notation: g = gradient (the diff after clipping, normalisation and regularisation), lr = the
policy rate times the param's ``lr_mult``.

    SGD        h = momentum * h + lr * g;                       update = h
    Nesterov   h' = momentum * h + lr * g;                      update = (1 + momentum) * h' - momentum * h
    AdaGrad    h += g^2;                                        update = lr * g / (sqrt(h) + delta)
    RMSProp    h = rms_decay * h + (1 - rms_decay) * g^2;       update = lr * g / (sqrt(h) + delta)
    AdaDelta   h = momentum * h + (1 - momentum) * g^2
               u = g * sqrt((hu + delta) / (h + delta));        hu = momentum * hu + (1 - momentum) * u^2
               update = lr * u
    Adam       m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g^2
               update = lr * sqrt(1 - beta2^t) / (1 - beta1^t) * m / (sqrt(v) + delta),  t = iter + 1
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from ..device.driver import array_module
from ..errors import SolverError

log = logging.getLogger("cct")


def _scalar(arr, value: float):
    """``value`` rounded to the dtype of ``arr`` (Caffe's ``Dtype`` scalar)."""
    return arr.dtype.type(value)


def clip_gradients(diffs: Sequence, clip: float) -> float | None:
    """Scale every diff by ``clip / ||g||`` when the global L2 norm ``||g||`` exceeds ``clip``.

    ``clip < 0`` disables clipping (Caffe's default ``clip_gradients: -1``). Returns the scale
    factor applied, or None.
    """
    if clip < 0 or not diffs:
        return None
    dtype = diffs[0].dtype.type
    sumsq = 0.0
    for d in diffs:
        xp = array_module(d)
        sumsq += float(xp.vdot(d.ravel(), d.ravel()))
    l2norm = dtype(math.sqrt(sumsq))
    clip_v = dtype(clip)
    if l2norm > clip_v:
        scale = dtype(clip_v / l2norm)
        log.info("Gradient clipping: scaling down gradients (L2 norm %g > %g) by scale factor %g",
                 l2norm, clip_v, scale)
        for d in diffs:
            d *= scale
        return float(scale)
    return None


def normalize(diff, iter_size: int) -> None:
    """Divide an accumulated gradient by ``iter_size`` (Caffe multiplies by the float 1/iter_size)."""
    if iter_size == 1:
        return
    diff *= _scalar(diff, _scalar(diff, 1.0) / _scalar(diff, iter_size))


def regularize(data, diff, local_decay: float, regularization_type: str) -> None:
    """Add the weight-decay term: L2 ``diff += decay * w``; L1 ``diff += decay * sign(w)``."""
    decay = _scalar(diff, local_decay)
    if not decay:
        return
    xp = array_module(diff)
    if regularization_type == "L2":
        diff += decay * data
    elif regularization_type == "L1":
        diff += decay * xp.sign(data)
    else:
        raise SolverError(f"solver: Unknown regularization type: \"{regularization_type}\" (use L2 or L1)")


def sgd(diff, history, local_rate: float, momentum: float) -> None:
    """SGD with momentum: ``history = local_rate * g + momentum * history``; update = history."""
    history *= _scalar(history, momentum)
    history += _scalar(diff, local_rate) * diff
    diff[...] = history


def nesterov(diff, history, local_rate: float, momentum: float) -> None:
    """Nesterov's accelerated gradient (Caffe's NesterovSolver: step back, then over-step)."""
    mom = _scalar(history, momentum)
    previous = history.copy()
    history *= mom
    history += _scalar(diff, local_rate) * diff
    diff[...] = (_scalar(diff, 1) + mom) * history - mom * previous


def adagrad(diff, history, local_rate: float, delta: float) -> None:
    """AdaGrad: ``history += g^2``; update = local_rate * g / (sqrt(history) + delta)."""
    xp = array_module(diff)
    history += diff * diff
    denom = xp.sqrt(history)
    denom += _scalar(diff, delta)
    diff /= denom
    diff *= _scalar(diff, local_rate)


def rmsprop(diff, history, local_rate: float, delta: float, rms_decay: float) -> None:
    """RMSProp: ``history = rms_decay * history + (1 - rms_decay) * g^2``; update as AdaGrad's."""
    xp = array_module(diff)
    decay = _scalar(diff, rms_decay)
    history *= decay
    history += (_scalar(diff, 1) - decay) * (diff * diff)
    denom = xp.sqrt(history)
    denom += _scalar(diff, delta)
    diff /= denom
    diff *= _scalar(diff, local_rate)


def adadelta(diff, history, update_history, local_rate: float, delta: float, momentum: float) -> None:
    """AdaDelta (Zeiler 2012) as Caffe implements it (``momentum`` is the decay rho; lr scales the step)."""
    xp = array_module(diff)
    mom = _scalar(diff, momentum)
    one_minus = _scalar(diff, 1) - mom
    d = _scalar(diff, delta)
    history *= mom
    history += one_minus * (diff * diff)
    ratio = (update_history + d) / (history + d)
    diff *= xp.sqrt(ratio)
    update_history *= mom
    update_history += one_minus * (diff * diff)
    diff *= _scalar(diff, local_rate)


def adam_correction(it: int, beta1: float, beta2: float, dtype) -> float:
    """Caffe's bias correction ``sqrt(1 - beta2^t) / (1 - beta1^t)``, t = it + 1 (double, then Dtype)."""
    t = it + 1
    b1, b2 = float(dtype(beta1)), float(dtype(beta2))
    return dtype(math.sqrt(1.0 - b2 ** t) / (1.0 - b1 ** t))


def adam(diff, m, v, local_rate: float, beta1: float, beta2: float, delta: float, it: int) -> None:
    """Adam (Kingma & Ba) with Caffe's correction folded into the rate."""
    xp = array_module(diff)
    b1, b2 = _scalar(diff, beta1), _scalar(diff, beta2)
    one = _scalar(diff, 1)
    m *= b1
    m += (one - b1) * diff
    v *= b2
    v += (one - b2) * (diff * diff)
    correction = adam_correction(it, beta1, beta2, diff.dtype.type)
    denom = xp.sqrt(v)
    denom += _scalar(diff, delta)
    xp.divide(m, denom, out=diff)
    diff *= _scalar(diff, local_rate) * correction
