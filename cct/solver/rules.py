"""Caffe's six solver types (SGD, Nesterov, AdaGrad, RMSProp, AdaDelta, Adam): each a :class:`Solver` whose
``compute_update_value`` applies its rule (:mod:`.updates`) to one parameter, and whose ``flat_rule`` names the
same rule fused over the flat parameter buffers (:mod:`.flat_update`); registered by ``type`` name for
:func:`~cct.solver.solver.get_solver`."""
from __future__ import annotations

from .. import kernels
from ..device.driver import host_kernels_usable
from ..errors import SolverError
from . import updates
from .flat_update import Hyper
from .solver import Solver, register_solver


@register_solver
class SGDSolver(Solver):
    """Stochastic gradient descent with momentum."""

    type = "SGD"
    flat_rule = "sgd"

    def compute_update_value(self, param_id: int, rate: float) -> None:
        blob = self.net.learnable_params[param_id]
        updates.sgd(blob.diff, self.history[param_id], self.local_rate(param_id, rate), self.param.momentum)

    def fused_update(self, param_id: int, rate: float, apply_data: bool = False) -> bool:
        """L2 decay + momentum SGD in one pass (:func:`cct.kernels.update.sgd_l2`) for plain SGD
        with numpy float parameters; subclasses and overridden steps take the general path."""
        cls = type(self)
        if (cls.compute_update_value is not SGDSolver.compute_update_value or cls.regularize is not Solver.regularize
                or self.param.regularization_type != "L2"):
            return False
        blob = self.net.learnable_params[param_id]
        history = self.history[param_id]
        if not host_kernels_usable(blob.data, blob.diff, history, contiguous=True):
            return False
        ku = kernels.get("update")
        if ku is None:
            return False
        dt = blob.diff.dtype.type
        decay = dt(self.param.weight_decay) * dt(self.net.params_weight_decay[param_id])
        ku.sgd_l2(blob.data, blob.diff, history, decay, self.local_rate(param_id, rate), self.param.momentum,
                  apply_data)
        return True


@register_solver
class NesterovSolver(SGDSolver):
    """Nesterov's accelerated gradient."""

    type = "Nesterov"
    flat_rule = "nesterov"

    def compute_update_value(self, param_id: int, rate: float) -> None:
        blob = self.net.learnable_params[param_id]
        updates.nesterov(blob.diff, self.history[param_id], self.local_rate(param_id, rate), self.param.momentum)


@register_solver
class AdaGradSolver(SGDSolver):
    """AdaGrad (momentum must be 0)."""

    type = "AdaGrad"
    flat_rule = "adagrad"

    def check_params(self) -> None:
        if self.param.momentum != 0:
            raise SolverError(f"{self.source}: Momentum cannot be used with AdaGrad.")

    def compute_update_value(self, param_id: int, rate: float) -> None:
        blob = self.net.learnable_params[param_id]
        updates.adagrad(blob.diff, self.history[param_id], self.local_rate(param_id, rate), self.param.delta)


@register_solver
class RMSPropSolver(SGDSolver):
    """RMSProp (momentum must be 0; 0 <= rms_decay < 1)."""

    type = "RMSProp"
    flat_rule = "rmsprop"

    def check_params(self) -> None:
        if self.param.momentum != 0:
            raise SolverError(f"{self.source}: Momentum cannot be used with RMSProp.")
        if not 0 <= self.param.rms_decay < 1:
            raise SolverError(f"{self.source}: rms_decay should lie between 0 and 1 "
                              f"(rms_decay: {self.param.rms_decay:g})")

    def flat_hyper(self) -> Hyper:
        """As the base class's, with ``rms_decay`` in the second-momentum slot."""
        hyper = super().flat_hyper()
        hyper.momentum2 = self.param.rms_decay
        return hyper

    def compute_update_value(self, param_id: int, rate: float) -> None:
        blob = self.net.learnable_params[param_id]
        updates.rmsprop(blob.diff, self.history[param_id], self.local_rate(param_id, rate), self.param.delta,
                        self.param.rms_decay)


@register_solver
class AdaDeltaSolver(SGDSolver):
    """AdaDelta (``momentum`` is the decay; history holds the gradient then the update averages)."""

    type = "AdaDelta"
    flat_rule = "adadelta"
    history_sets = 2

    def compute_update_value(self, param_id: int, rate: float) -> None:
        blob = self.net.learnable_params[param_id]
        n = len(self.net.learnable_params)
        updates.adadelta(blob.diff, self.history[param_id], self.history[n + param_id],
                         self.local_rate(param_id, rate), self.param.delta, self.param.momentum)


@register_solver
class AdamSolver(SGDSolver):
    """Adam (``momentum`` = beta1, ``momentum2`` = beta2, ``delta`` = epsilon)."""

    type = "Adam"
    flat_rule = "adam"
    history_sets = 2

    def compute_update_value(self, param_id: int, rate: float) -> None:
        blob = self.net.learnable_params[param_id]
        n = len(self.net.learnable_params)
        p = self.param
        updates.adam(blob.diff, self.history[param_id], self.history[n + param_id],
                     self.local_rate(param_id, rate), p.momentum, p.momentum2, p.delta, self.iter)
