"""``cct test``: score a model: run N batches of its TEST (or TRAIN) phase and log each output's mean (Caffe's
``caffe test``)."""
from __future__ import annotations

import argparse
import logging

from ..errors import LayerError
from ..flags import FlagParser, command_parser
from ..progress import Progress
from ..runsetup import add_common_arguments, add_device_arguments, wants_progress
from .model import model_net

log = logging.getLogger("cct")


def build_parser() -> FlagParser:
    """The flags of ``cct test``."""
    p = command_parser("test", "Score a model: run N batches and print per-batch and mean outputs.")
    p.add_argument("--model", default=None, help="the model definition prototxt")
    p.add_argument("--weights", default=None, help="the trained weights (.caffemodel or .h5; comma-separated)")
    p.add_argument("--iterations", type=int, default=50, help="the number of batches to run")
    p.add_argument("--phase", default="TEST", help="net phase (TEST or TRAIN)")
    add_common_arguments(p)
    add_device_arguments(p)
    return p


def run(args: argparse.Namespace) -> int:
    """``cct test``: run a model's TEST phase for N batches and report each output's mean."""
    import numpy as np

    net = model_net(args, "score", calibrate=False, need_weights=True)
    log.info("Running for %d iterations.", args.iterations)
    scores: list[np.float32] = []
    names: list[str] = []
    loss = np.float32(0)
    with Progress(args.iterations, "test", unit="batch", enabled=wants_progress(args)) as bar:
        for i in range(args.iterations):
            try:
                loss += np.float32(net.forward())
            except LayerError as e:
                raise e.in_context(f"batch {i}") from e
            for idx, (name, v) in enumerate(net.output_values()):
                if i == 0:
                    scores.append(v)
                    names.append(name)
                else:
                    scores[idx] += v
                log.info("Batch %d, %s = %g", i, name, v)
            bar.update()
    loss /= np.float32(args.iterations)
    log.info("Loss: %g", loss)
    for name, s in zip(names, scores):
        mean = np.float32(s) / np.float32(args.iterations)
        w = net.blob_loss_weights.get(name, 0.0)
        extra = f" (* {w:g} = {np.float32(w) * mean:g} loss)" if w else ""
        log.info("%s = %g%s", name, mean, extra)
    return 0
