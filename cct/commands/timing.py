"""``cct time``: time a model's forward and backward passes layer by layer (Caffe's ``caffe time``), with each
conv layer's plan next to its measured time and the GEMM overhead."""
from __future__ import annotations

import argparse
import logging
import time

from ..flags import FlagParser, command_parser
from ..net.overhead import gemm_overhead, log_gemm_overhead
from ..progress import Progress
from ..runsetup import add_common_arguments, add_device_arguments, wants_progress
from .model import model_net

log = logging.getLogger("cct")


def build_parser() -> FlagParser:
    """The flags of ``cct time``."""
    p = command_parser("time", "Benchmark the execution time of a model, layer by layer.")
    p.add_argument("--model", default=None, help="the model definition prototxt")
    p.add_argument("--iterations", type=int, default=50, help="the number of forward-backward passes to time")
    p.add_argument("--phase", default="TRAIN", help="net phase (TRAIN or TEST)")
    p.add_argument("--weights", default=None, help="optional weights to load first")
    add_common_arguments(p)
    add_device_arguments(p)
    return p


def run(args: argparse.Namespace) -> int:
    """``cct time``: per-layer forward/backward timings (Caffe's ``caffe time``)."""
    net = model_net(args, "time", calibrate=True, need_weights=False)
    log.info("Performing Forward")
    initial_loss = net.forward()
    log.info("Initial loss: %g", initial_loss)
    log.info("Performing Backward")
    net.backward()
    n_layers = len(net.layers)
    fwd = [0.0] * n_layers
    bwd = [0.0] * n_layers
    fwd_samples: list[list[float]] = [[] for _ in range(n_layers)]
    forward_time = backward_time = 0.0
    log.info("*** Benchmark begins ***")
    log.info("Testing for %d iterations.", args.iterations)
    clock = time.perf_counter
    total_start = clock()
    with Progress(args.iterations, "time", unit="iter", enabled=wants_progress(args)) as bar:
        for j in range(args.iterations):
            iter_start = clock()
            for i, layer in enumerate(net.layers):
                t = clock()
                layer.reshape(net.bottom_vecs[i], net.top_vecs[i])
                layer.forward(net.bottom_vecs[i], net.top_vecs[i])
                dt = clock() - t
                fwd[i] += dt
                fwd_samples[i].append(dt)
            f_end = clock()
            forward_time += f_end - iter_start
            for i in range(n_layers - 1, -1, -1):
                if not net.layer_need_backward[i]:
                    continue
                t = clock()
                net.layers[i].backward(net.top_vecs[i], net.bottom_need_backward[i], net.bottom_vecs[i])
                bwd[i] += clock() - t
            backward_time += clock() - f_end
            log.info("Iteration: %d forward-backward time: %g ms.", j + 1, (clock() - iter_start) * 1e3)
            bar.update()
    total = clock() - total_start
    n = args.iterations
    log.info("Average time per layer: ")
    for i, name in enumerate(net.layer_names):
        log.info("%10s\tforward: %g ms.", name, fwd[i] * 1e3 / n)
        log.info("%10s\tbackward: %g ms.", name, bwd[i] * 1e3 / n)
    log.info("Average Forward pass: %g ms.", forward_time * 1e3 / n)
    log.info("Average Backward pass: %g ms.", backward_time * 1e3 / n)
    log.info("Average Forward-Backward: %g ms.", total * 1e3 / n)
    log.info("Total Time: %g ms.", total * 1e3)
    for i, layer in enumerate(net.layers):  # the engine's plan per conv layer, next to its measured time
        report = getattr(layer, "plan_report", None)
        if report:
            log.info("Plan %s; measured %g ms", report, (fwd[i] + bwd[i]) * 1e3 / n)
    log.info("*** Benchmark ends ***")

    log_gemm_overhead(gemm_overhead(net, fwd_samples, repeats=max(20, n)))
    return 0
