"""TensorBoard event files for a training run or an existing log (the ``[tensorboard]`` extra: tensorboardX).

:class:`TensorBoardWriter` writes what the log shows, under the same names: ``train/smoothed_loss``
(the loss a display prints, averaged over ``average_loss`` iterations), ``train/<output>`` (the train
net's outputs at each display, e.g. ``train/loss``), ``lr``
(the rate at each display), ``test/<output>`` (each test net output; ``test<k>/...`` for test net
k > 0, ``test/loss`` with ``test_compute_loss``), and with ``histogram_interval`` N > 0 the
histograms ``weights/<layer>/<i>`` and ``gradients/<layer>/<i>`` every N iterations. The solver
writes through one (``get_solver(..., tensorboard=DIR)``, ``cct train --tensorboard DIR``) on the
root rank only; :func:`write_log_events` converts the rows ``cct parse_log`` reads from a log.
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence

import numpy as np

from ..device.driver import to_host
from ..errors import CctError

# parse_log's columns that are not net outputs
_ROW_META = ("NumIters", "Seconds", "LearningRate")


def _summary_writer(logdir: str | os.PathLike):
    try:
        from tensorboardX import SummaryWriter  # optional dependency: the [tensorboard] extra
    except ImportError as e:
        raise CctError(f"--tensorboard needs tensorboardX (install the [tensorboard] extra: "
                       f"pip install 'cct[tensorboard]'): {e}") from None
    try:
        return SummaryWriter(logdir=os.fspath(logdir), flush_secs=30)
    except OSError as e:
        raise CctError(f"cannot write TensorBoard events to '{os.fspath(logdir)}': {e.strerror or e}") from None


def tag_of_test_output(net_id: int, name: str) -> str:
    """The tag of test net ``net_id``'s output ``name`` (``test/NAME``, ``test1/NAME``, ...)."""
    return f"test{net_id or ''}/{name}"


class TensorBoardWriter:
    """Scalars (and optional histograms) of one run, written as TensorBoard event files in ``logdir``."""

    def __init__(self, logdir: str | os.PathLike, histogram_interval: int = 0):
        if histogram_interval < 0:
            raise CctError(f"the histogram interval must be >= 0 (got {histogram_interval})")
        self.logdir = os.fspath(logdir)
        self.histogram_interval = int(histogram_interval)
        self._writer = _summary_writer(logdir)

    @property
    def writer(self):
        """The open tensorboardX SummaryWriter (a new event file in the same folder after :meth:`close`)."""
        if self._writer is None:
            self._writer = _summary_writer(self.logdir)
        return self._writer

    def scalar(self, tag: str, value: float, iteration: int) -> None:
        """One scalar point (NaN and inf are written as they are, as TensorBoard shows them)."""
        self.writer.add_scalar(tag, float(value), int(iteration))

    def train_display(self, iteration: int, loss: float, outputs: Sequence[tuple[str, float]]) -> None:
        """A display of the train net: the smoothed loss and each output value."""
        self.scalar("train/smoothed_loss", loss, iteration)
        for name, value in outputs:
            self.scalar(f"train/{name}", value, iteration)

    def test_result(self, iteration: int, net_id: int, outputs: Sequence[tuple[str, float]],
                    loss: float | None = None) -> None:
        """A test pass: each mean output (and the mean loss with ``test_compute_loss``)."""
        for name, value in outputs:
            self.scalar(tag_of_test_output(net_id, name), value, iteration)
        if loss is not None:
            self.scalar(tag_of_test_output(net_id, "loss"), loss, iteration)

    def learning_rate(self, iteration: int, rate: float) -> None:
        """The learning rate used at ``iteration``."""
        self.scalar("lr", rate, iteration)

    def wants_histograms(self, iteration: int) -> bool:
        """Whether ``iteration`` gets weight and gradient histograms."""
        return self.histogram_interval > 0 and iteration % self.histogram_interval == 0

    def histograms(self, iteration: int, layers: Iterable) -> None:
        """Histograms of every parameter blob's values and gradients of ``layers`` (a net's layers)."""
        for layer in layers:
            for i, blob in enumerate(layer.blobs):
                self.writer.add_histogram(f"weights/{layer.name}/{i}", np.asarray(to_host(blob.data)), iteration)
                self.writer.add_histogram(f"gradients/{layer.name}/{i}", np.asarray(to_host(blob.diff)), iteration)

    def close(self) -> None:
        """Write out every pending event and close the event file (tensorboardX's flush alone may leave
        queued events unwritten); a later point opens a new event file in the same folder."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def write_log_events(logdir: str | os.PathLike, train: Sequence[dict], test: Sequence[dict]) -> int:
    """Write the rows of a parsed log (:func:`cct.tools.parse_log.parse_log`) as events; returns the point count."""
    tb = TensorBoardWriter(logdir)
    points = 0
    try:
        for row in train:
            it = int(row["NumIters"])
            if not math.isnan(row.get("LearningRate", math.nan)):
                tb.learning_rate(it, row["LearningRate"])
                points += 1
            for name, value in row.items():
                if name not in _ROW_META:
                    tb.scalar(f"train/{name}", value, it)
                    points += 1
        for row in test:
            it = int(row["NumIters"])
            for name, value in row.items():
                if name not in _ROW_META:
                    tb.scalar(tag_of_test_output(0, name), value, it)
                    points += 1
    finally:
        tb.close()
    return points
