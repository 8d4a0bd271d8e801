"""Caffe's learning-rate policies (SGDSolver::GetLearningRate), in Caffe's float32 arithmetic.

    fixed      base_lr
    step       base_lr * gamma ^ floor(iter / stepsize)
    exp        base_lr * gamma ^ iter
    inv        base_lr * (1 + gamma * iter) ^ (-power)
    multistep  base_lr * gamma ^ current_step   (current_step advances past each stepvalue)
    poly       base_lr * (1 - iter / max_iter) ^ power
    sigmoid    base_lr / (1 + exp(-gamma * (iter - stepsize)))

Caffe evaluates these with ``Dtype = float``: ``pow(float, int)`` promotes to double (step, exp,
multistep) while the other policies stay in single precision; the functions here round the same way
so that the rate is the float32 number Caffe computes.
"""
from __future__ import annotations

import logging

import numpy as np

from ..errors import SolverError
from ..proto import caffe_pb2

log = logging.getLogger("cct")

POLICIES = ("fixed", "step", "exp", "inv", "multistep", "poly", "sigmoid")

_f32 = np.float32


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise SolverError(f"solver: {what}")


def learning_rate(param: caffe_pb2.SolverParameter, it: int, current_step: int) -> tuple[float, int]:
    """The rate for iteration ``it`` and the (possibly advanced) ``current_step``.

    ``current_step`` is the solver's state for ``multistep`` (and is recomputed by ``step``), as
    Caffe keeps it in ``SolverState.current_step``. Returns ``(rate, current_step)``; ``rate`` is a
    Python float holding a float32 value.
    """
    policy = param.lr_policy
    base_lr = _f32(param.base_lr)
    gamma = _f32(param.gamma)
    with np.errstate(over="ignore", under="ignore", divide="ignore", invalid="ignore"):
        if policy == "fixed":
            rate = base_lr
        elif policy == "step":
            _check(param.stepsize > 0, f"lr_policy \"step\" needs stepsize > 0 (stepsize: {param.stepsize})")
            current_step = it // param.stepsize
            _check(gamma >= 0, f"lr_policy \"step\" needs gamma >= 0 (gamma: {param.gamma:g})")
            rate = _f32(float(base_lr) * float(gamma) ** current_step)
        elif policy == "exp":
            _check(gamma >= 0, f"lr_policy \"exp\" needs gamma >= 0 (gamma: {param.gamma:g})")
            rate = _f32(float(base_lr) * float(gamma) ** it)
        elif policy == "inv":
            _check(gamma >= 0, f"lr_policy \"inv\" needs gamma >= 0 (gamma: {param.gamma:g})")
            rate = base_lr * np.power(_f32(1) + gamma * _f32(it), -_f32(param.power))
        elif policy == "multistep":
            if current_step < len(param.stepvalue) and it >= param.stepvalue[current_step]:
                current_step += 1
                log.info("MultiStep Status: Iteration %d, step = %d", it, current_step)
            _check(gamma >= 0, f"lr_policy \"multistep\" needs gamma >= 0 (gamma: {param.gamma:g})")
            rate = _f32(float(base_lr) * float(gamma) ** current_step)
        elif policy == "poly":
            _check(param.max_iter != 0, "lr_policy \"poly\" needs max_iter > 0")
            rate = base_lr * np.power(_f32(1) - _f32(it) / _f32(param.max_iter), _f32(param.power))
        elif policy == "sigmoid":
            _check(gamma >= 0, f"lr_policy \"sigmoid\" needs gamma >= 0 (gamma: {param.gamma:g})")
            _check(param.stepsize > 0, f"lr_policy \"sigmoid\" needs stepsize > 0 (stepsize: {param.stepsize})")
            rate = base_lr * (_f32(1) / (_f32(1) + np.exp(-gamma * (_f32(it) - _f32(param.stepsize)))))
        else:
            known = ", ".join(POLICIES)
            raise SolverError(f"solver: Unknown learning rate policy: \"{policy}\" (known policies: {known})")
    return float(_f32(rate)), int(current_step)


def validate(param: caffe_pb2.SolverParameter) -> None:
    """Fail early (at solver construction) on a policy Caffe would reject at the first update."""
    # current_step past the last stepvalue: multistep neither advances nor logs here.
    learning_rate(param, 0, len(param.stepvalue))
