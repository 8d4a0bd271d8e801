"""Finite-difference gradient checking of layers, as Caffe's GradientChecker does.

The objective is a fixed random projection of the tops, ``sum_i <R_i, top_i>``, so a
single backward pass gives the analytic gradient of every bottom and parameter, and
two forward passes per element give the numeric one. Run it in float64 where the
layer allows (blobs created with ``dtype=np.float64``) for tight tolerances.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .blob import Blob
from .device.driver import Device
from .layers.base import Layer


def make_blob(arr: np.ndarray, name: str = "", device: Device | None = None) -> Blob:
    """A blob holding a copy of ``arr`` (its dtype is kept) on ``device`` (default: the host)."""
    arr = np.asarray(arr)
    blob = Blob(arr.shape, dtype=arr.dtype, device=device, name=name)
    blob.device.upload(arr, out=blob.data)
    return blob


def _objective(layer: Layer, bottom, top, weights, seed, random_state: dict | None = None) -> float:
    """The projection of the tops after one forward, every random draw repeated: the layer's host random
    source reseeded, the layer's own stream (Dropout's mask) rewound to ``random_state``."""
    layer.host_random().seed(seed)
    if random_state is not None:
        layer.random.set_state(random_state)
    layer.reshape(bottom, top)
    layer.forward(bottom, top)
    return float(sum(float(t.xp.sum(w * t.data)) for w, t in zip(weights, top) if w is not None))


def check_gradient(
    layer: Layer,
    bottom: Sequence[Blob],
    top: Sequence[Blob],
    check_bottom: Sequence[int] | None = None,
    check_params: bool = True,
    stepsize: float = 1e-3,
    threshold: float = 1e-4,
    kink: float | None = None,
    kink_range: float = -1.0,
    seed: int = 1701,
    top_weights: Sequence[Any | None] | None = None,
    setup: bool = True,
) -> None:
    """Assert the layer's backward matches central finite differences.

    ``check_bottom``: bottom indices to check (default all). ``kink``/``kink_range``:
    skip elements whose value lies within ``kink_range`` of a non-differentiable point.
    Raises AssertionError naming the blob and element on a mismatch. Works on the blobs' own array
    module (numpy, or cupy for the GPU path).
    """
    if setup:
        layer.host_random().seed(seed)
        layer.setup(bottom, top)
    wrng = np.random.default_rng(seed + 1)
    random_state = layer.random.state() if layer.random is not None else None
    if top_weights is None:
        top_weights = [None] * len(top)
        _objective(layer, bottom, top, [None] * len(top), seed, random_state)
        top_weights = [wrng.standard_normal(t.shape).astype(t.dtype) for t in top]
    top_weights = [None if w is None else t.xp.asarray(w) for w, t in zip(top_weights, top)]
    check_bottom = list(range(len(bottom))) if check_bottom is None else list(check_bottom)

    # Analytic gradients.
    _objective(layer, bottom, top, top_weights, seed, random_state)
    for t, w in zip(top, top_weights):
        if w is not None:
            t.diff[...] = w
    for p in layer.blobs:
        p.diff[...] = 0
    propagate = [i in check_bottom for i in range(len(bottom))]
    layer.backward(top, propagate, bottom)
    targets: list[tuple[str, Blob, np.ndarray]] = []
    for i in check_bottom:
        targets.append((f"bottom[{i}]", bottom[i], bottom[i].diff.copy()))
    if check_params:
        for j, p in enumerate(layer.blobs):
            if j < len(layer.param_propagate_down) and not layer.param_propagate_down[j]:
                continue
            targets.append((f"param[{j}]", p, p.diff.copy()))

    for label, blob, analytic in targets:
        flat = blob.data.reshape(-1)
        grad = analytic.reshape(-1)
        for k in range(flat.size):
            x0 = flat[k].item()
            if kink is not None and abs(x0 - kink) < kink_range:
                continue
            flat[k] = x0 + stepsize
            f_plus = _objective(layer, bottom, top, top_weights, seed, random_state)
            flat[k] = x0 - stepsize
            f_minus = _objective(layer, bottom, top, top_weights, seed, random_state)
            flat[k] = x0
            numeric = (f_plus - f_minus) / (2 * stepsize)
            computed = float(grad[k])
            scale = max(abs(computed), abs(numeric), 1.0)
            if abs(computed - numeric) > threshold * scale:
                raise AssertionError(
                    f"{layer.type} layer '{layer.name}': gradient of {label} element {k} "
                    f"is {computed:.8g}, finite differences give {numeric:.8g}"
                )
