"""A solver's test passes (Caffe's TestAll/Test: each test net for its ``test_iter`` batches, the outputs averaged
and logged) and the logging of a net's outputs. A mixin of :class:`cct.solver.solver.Solver`."""
from __future__ import annotations

import logging

import numpy as np

from ..device.driver import to_host
from ..errors import LayerError
from ..log import ostream_float as _fmt
from ..net import Net
from . import signals

log = logging.getLogger("cct")


class Evaluation:
    """Test passes and output logging of a :class:`~cct.solver.solver.Solver`."""

    def test_all(self) -> None:
        """Run every test net (Caffe's TestAll). Distributed: every rank calls it (the root alone tests)."""
        for gather in self.parallel.share_slices if self.parallel is not None else ():
            gather()
        for i in range(len(self.test_nets)):
            if self.requested_early_exit:
                break
            self.test(i)

    def test(self, test_net_id: int = 0) -> list[float]:
        """Run test net ``test_net_id`` for its ``test_iter`` batches and log the mean outputs."""
        log.info("Iteration %d, Testing net (#%d)", self.iter, test_net_id)
        net = self.test_nets[test_net_id]
        net.share_weights_with(self.net)
        p = self.param
        n_iter = p.test_iter[test_net_id]
        scores: list[np.float32] = []
        score_names: list[str] = []
        loss = np.float32(0)
        for i in range(n_iter):
            # a distributed run (the root tests alone) takes signals between iterations only
            request = self.get_requested_action() if self.parallel is None else signals.NONE
            while request != signals.NONE:
                if request == signals.SNAPSHOT:
                    self.snapshot()
                elif request == signals.STOP:
                    self.requested_early_exit = True
                request = self.get_requested_action()
            if self.requested_early_exit:
                break
            try:
                iter_loss = net.forward()
            except LayerError as e:
                raise e.in_context(f"test net #{test_net_id}, test batch {i} at iteration {self.iter}") from e
            if p.test_compute_loss:
                loss += np.float32(iter_loss)
            for idx, (name, v) in enumerate(net.output_values()):
                if i == 0:
                    scores.append(v)
                    score_names.append(name)
                else:
                    scores[idx] += v
        if self.requested_early_exit:
            log.info("Test interrupted.")
            return []
        if p.test_compute_loss:
            loss /= np.float32(n_iter)
            log.info("Test loss: %s", _fmt(loss))
        means = []
        for i, (name, s) in enumerate(zip(score_names, scores)):
            mean = np.float32(s) / np.float32(n_iter)
            means.append(float(mean))
            w = net.blob_loss_weights.get(name, 0.0)
            extra = f" (* {_fmt(w)} = {_fmt(np.float32(w) * mean)} loss)" if w else ""
            log.info("    Test net output #%d: %s = %s%s", i, name, _fmt(mean), extra)
        if self.tensorboard is not None:
            self.tensorboard.test_result(self.iter, test_net_id, list(zip(score_names, means)),
                                         float(loss) if p.test_compute_loss else None)
        return means

    def _log_outputs(self, net: Net, what: str) -> list[tuple[str, float]]:
        """Log every value of the net's outputs; returns them as (name, value), a blob's values as name/k."""
        index = 0
        values_out: list[tuple[str, float]] = []
        for name in net.output_blob_names:
            values = np.asarray(to_host(net.blobs[name].data), dtype=np.float32).ravel()
            w = net.blob_loss_weights.get(name, 0.0)
            for k, v in enumerate(values):
                extra = f" (* {_fmt(w)} = {_fmt(np.float32(w) * v)} loss)" if w else ""
                log.info("    %s net output #%d: %s = %s%s", what, index, name, _fmt(v), extra)
                values_out.append((name if len(values) == 1 else f"{name}/{k}", float(v)))
                index += 1
        return values_out
