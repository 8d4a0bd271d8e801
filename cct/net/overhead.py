"""Per-call overhead of a net's GEMM layers: an InnerProduct forward in the net vs the bare GEMM.

An InnerProduct forward is one GEMM ``(M x K) @ (K x N)`` plus a bias add; whatever it costs beyond
the same GEMM called alone is overhead (Python dispatch, reshapes, thread-pool wake-ups after the
layers before it, the bias sweep). ``cct time`` records every layer's forward time per iteration and
then calls :func:`gemm_overhead`, which times, in the same process and on the layer's own arrays,
``numpy.matmul(x, W.T, out=y)`` (numpy's bundled BLAS) and the same product through
:func:`cct.blas.gemm` on the backend the net uses, and logs in-net median vs bare median.
"""
from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import blas
from ..device.driver import device_of

log = logging.getLogger("cct")


def _median_seconds(fn, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    clock = time.perf_counter
    for _ in range(max(1, repeats)):
        t = clock()
        fn()
        ts.append(clock() - t)
    return statistics.median(ts)


def gemm_overhead(net: Any, forward_samples: Sequence[Sequence[float]], repeats: int = 50) -> list[dict]:
    """One row per InnerProduct layer of ``net`` whose arrays are numpy float: its shape (M, K, N),
    the median of its in-net forward times (``forward_samples[i]``, seconds per iteration of layer
    ``i``), the median bare ``numpy.matmul`` and bare backend GEMM of the same operands, and the
    ratio in-net / bare numpy."""
    rows = []
    for i, (name, layer) in enumerate(zip(net.layer_names, net.layers)):
        if layer.type != "InnerProduct" or not forward_samples[i]:
            continue
        x = net.bottom_vecs[i][0].data
        w = layer.blobs[0].data
        if device_of(x).is_gpu or x.dtype not in (np.float32, np.float64):
            continue
        m, k, n = layer.M, layer.K, layer.num_output
        x2 = np.ascontiguousarray(x.reshape(m, k))
        w_nk = w.T if layer.transpose else w
        out = np.empty((m, n), x.dtype)
        bare = _median_seconds(lambda a=x2, b=w_nk.T, c=out: np.matmul(a, b, out=c), repeats)
        backend = blas.get_backend()
        bare_backend = _median_seconds(lambda a=x2, b=w_nk, c=out: blas.gemm(a, b, out=c, trans_b=True), repeats)
        in_net = statistics.median(forward_samples[i])
        rows.append({"layer": name, "M": m, "K": k, "N": n, "in_net_s": in_net, "bare_numpy_s": bare,
                     "bare_backend_s": bare_backend, "backend": backend,
                     "ratio": in_net / bare if bare > 0 else float("inf")})
    return rows


def log_gemm_overhead(rows: Sequence[dict]) -> None:
    """Log :func:`gemm_overhead`'s rows (one line per layer)."""
    for r in rows:
        log.info("%10s\tforward (median) %.4g ms vs bare GEMM %dx%dx%d: numpy.matmul %.4g ms, %s %.4g ms "
                 "(in net / numpy = %.2fx)", r["layer"], r["in_net_s"] * 1e3, r["M"], r["K"], r["N"],
                 r["bare_numpy_s"] * 1e3, r["backend"], r["bare_backend_s"] * 1e3, r["ratio"])
