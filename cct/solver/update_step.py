"""How a solver turns the accumulated gradients into the update (Caffe's ApplyUpdate): the lr policy's rate, then
either one fused pass over the flat parameter buffers (:mod:`.flat_update`; on a GPU one kernel reading its scalars
from device memory) or Caffe's per-parameter loop (normalise, regularise, the solver type's rule, ``data -= diff``).
A mixin of :class:`cct.solver.solver.Solver`; the six solver types override :meth:`UpdateStep.compute_update_value`
(:mod:`.rules`)."""
from __future__ import annotations

import logging

import numpy as np

from ..log import ostream_float as _fmt
from . import lr_policy, updates
from .flat_update import FlatUpdate, Hyper

log = logging.getLogger("cct")


class UpdateStep:
    """The update half of a :class:`~cct.solver.solver.Solver` iteration (see module docstring)."""

    def use_flat_update(self, on: bool = True) -> bool:
        """Update through the fused pass over the flat buffers (:mod:`.flat_update`) or, with ``on`` False,
        parameter by parameter (a setup-time choice; the default is the flat pass for device nets and the
        per-parameter path on the CPU, where it measured faster: benchmarks/README.md). Solvers that
        override a step of the update (:meth:`compute_update_value`, :meth:`normalize`, :meth:`regularize`)
        always take the per-parameter path. Returns whether the flat pass is on."""
        rule = self._flat_rule()
        if not on or rule is None or self.net.flat_params is None:
            self.flat_update = None
            return False
        p = self.param
        self.flat_update = FlatUpdate(self.net.flat_params, rule, self.flat_hyper(), p.weight_decay,
                                      self.net.params_lr, self.net.params_weight_decay, self.history_buffers)
        return True

    def _flat_rule(self) -> str | None:
        """The ``flat_rule`` of the class that defines it, if no subclass changed a step of the update."""
        cls = type(self)
        owner = next((k for k in cls.__mro__ if "flat_rule" in vars(k)), None)
        if owner is None or owner.flat_rule is None:
            return None
        if (cls.compute_update_value is not owner.compute_update_value or cls.normalize is not UpdateStep.normalize
                or cls.regularize is not UpdateStep.regularize):
            return None
        return owner.flat_rule

    def flat_hyper(self) -> Hyper:
        """The rule's hyper-parameters for the flat update (``momentum``, ``momentum2``, ``delta``,
        ``iter_size``, ``clip_gradients``, ``regularization_type``)."""
        p = self.param
        return Hyper(momentum=p.momentum, momentum2=p.momentum2, delta=p.delta, iter_size=p.iter_size,
                     clip=p.clip_gradients, regularization=p.regularization_type)

    def get_learning_rate(self) -> float:
        """The lr policy's rate for the current iteration (advances ``current_step`` for multistep)."""
        rate, self.current_step = lr_policy.learning_rate(self.param, self.iter, self.current_step)
        return rate

    def apply_update(self) -> None:
        """Turn the accumulated gradients into the update and apply it (Caffe's ApplyUpdate):
        :meth:`prepare_update` (host: rate, log, the fused pass's scalars), then :meth:`device_update`."""
        self.prepare_update()
        if self._graphed_iteration:
            self.step_graphs.run_update()
        else:
            self.device_update()

    def prepare_update(self) -> float:
        """The host half of the update, between iterations: the lr policy's rate (logged at display
        iterations) written with the other scalars into the fused pass's scalar arrays. Returns the rate."""
        rate = self.get_learning_rate()
        self.lr = rate
        p = self.param
        if p.display and self.iter % p.display == 0:
            log.info("Iteration %d, lr = %s", self.iter, _fmt(rate))
            if self.tensorboard is not None:
                self.tensorboard.learning_rate(self.iter, rate)
        if self.flat_update is not None:
            self.flat_update.write_scalars(rate, self.iter)
        return rate

    def device_update(self) -> None:
        """The update itself (after :meth:`prepare_update`): with the flat buffers intact one fused pass
        (no host read on device nets, unless :attr:`defer_host_reads` is False and clipping is on: then the
        clip line is logged at once), else parameter by parameter."""
        fu = self.flat_update
        if fu is not None and self.net.flat_params.intact():
            if not fu.on_device:
                updates.clip_gradients([b.diff for b in self.net.learnable_params], self.param.clip_gradients)
            debug = self.net.debug_info
            fu.run(apply=not debug)
            if not self.defer_host_reads:
                self.flush_update_log()
            if debug:
                self.net.update_debug_info()
                self.net.update()
            return
        self._update_per_param(self.lr)

    def flush_update_log(self) -> None:
        """Log what the device recorded since the last call (a host read; a boundary): Caffe's gradient
        clipping line with the last clipped iteration's norm and scale."""
        report = self.flat_update.clip_report() if self.flat_update is not None else None
        if report is None:
            return
        norm, scale, count = report
        log.info("Gradient clipping: scaling down gradients (L2 norm %g > %g) by scale factor %g",
                 norm, np.float32(self.param.clip_gradients), scale)
        if count > 1:
            log.info("Gradient clipping: %d iterations were clipped since the last report", count)

    def _update_per_param(self, rate: float) -> None:
        """The update parameter by parameter (Caffe's loop; the numba SGD kernel where it applies)."""
        p = self.param
        params = self.net.learnable_params
        updates.clip_gradients([b.diff for b in params], p.clip_gradients)
        # the fused kernel also applies data -= diff in its pass, unless debug_info must show the
        # diffs and data in between (as Caffe logs them before Net::Update)
        apply = not self.net.debug_info
        applied = set()
        for pid in range(len(params)):
            self.normalize(pid)
            if self.fused_update(pid, rate, apply_data=apply):
                if apply:
                    applied.add(pid)
            else:
                self.regularize(pid)
                self.compute_update_value(pid, rate)
        if self.net.debug_info:
            self.net.update_debug_info()
        if not applied:
            self.net.update()
        else:
            for pid, blob in enumerate(params):
                if pid not in applied:
                    blob.data -= blob.diff

    def normalize(self, param_id: int) -> None:
        """Divide the accumulated gradient by ``iter_size``."""
        updates.normalize(self.net.learnable_params[param_id].diff, self.param.iter_size)

    def regularize(self, param_id: int) -> None:
        """Add ``weight_decay * decay_mult`` times the L2 (w) or L1 (sign w) term to the gradient."""
        blob = self.net.learnable_params[param_id]
        dt = blob.diff.dtype.type
        local_decay = dt(self.param.weight_decay) * dt(self.net.params_weight_decay[param_id])
        updates.regularize(blob.data, blob.diff, local_decay, self.param.regularization_type)

    def local_rate(self, param_id: int, rate: float):
        """``rate * lr_mult`` in the parameter's dtype."""
        dt = self.net.learnable_params[param_id].diff.dtype.type
        return dt(rate) * dt(self.net.params_lr[param_id])

    def compute_update_value(self, param_id: int, rate: float) -> None:
        """Replace the param's diff by the update to subtract (the solver's rule)."""
        raise NotImplementedError

    def fused_update(self, param_id: int, rate: float, apply_data: bool = False) -> bool:
        """Do :meth:`regularize` + :meth:`compute_update_value` in one compiled pass if this solver
        has one for the parameter (same result bits); False to take the two steps. With
        ``apply_data`` the pass also does the parameter's ``data -= diff``."""
        return False
