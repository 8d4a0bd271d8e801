"""Batch shares (CcT's FLOPS-proportional heuristic) and which layers can be split by batch.

CcT (section 2.3): each device takes the fraction of the batch equal to its fraction of the
total FLOPS. :func:`flops_share` turns rates into whole images; :class:`ShareTable` holds the
default shares plus per-layer overrides (CcT's ``gpu_N_batch_proportion`` idea);
:func:`layer_mode` decides per layer whether it runs split by batch ("split"), split but with
the device slices run one after the other in device order because the layer draws random numbers
("serial": the slices share the layer's stream, so their draws concatenate to exactly the single-device
draw), or whole on the
host ("host": losses, Accuracy, BatchNorm with batch statistics, data layers, Python layers,
layers working across the batch axis, unknown types).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from ..blob import Blob
from ..errors import CctError
from ..layers.base import Layer

SHARE_TOLERANCE = 1e-6


def _round_proportional(weights: Sequence[float], batch: int) -> list[int]:
    """Largest-remainder rounding of ``batch * w / sum(w)`` to integers summing to ``batch``."""
    total = float(sum(weights))
    if batch < 0:
        raise CctError(f"batch size must be >= 0, got {batch}")
    if not weights or total <= 0:
        raise CctError(f"cannot split a batch by weights {list(weights)} (they must be >= 0 and not all 0)")
    exact = [batch * float(w) / total for w in weights]
    counts = [math.floor(e) for e in exact]
    rest = batch - sum(counts)
    # Hand the remaining images to the largest remainders (ties: the earlier device).
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[:rest]:
        counts[i] += 1
    return counts


def flops_share(gflops_list: Sequence[float], batch: int) -> list[int]:
    """Whole images per device proportional to its GFLOPS, summing to ``batch`` (CcT's heuristic)."""
    for g in gflops_list:
        if not g >= 0 or math.isinf(g):
            raise CctError(f"device rates must be finite and >= 0, got {list(gflops_list)}")
    return _round_proportional(gflops_list, batch)


def shares_to_counts(shares: Sequence[float], batch: int) -> list[int]:
    """Whole images per device for fractional ``shares`` (which sum to 1)."""
    return _round_proportional(shares, batch)


def normalize_shares(shares: Sequence[float], n_devices: int, what: str = "shares") -> list[float]:
    """Check explicit shares: one per device, each in [0, 1], summing to 1 (else CctError)."""
    shares = [float(s) for s in shares]
    if len(shares) != n_devices:
        raise CctError(f"{what}: {len(shares)} value(s) given for {n_devices} device(s)")
    for s in shares:
        if not 0.0 <= s <= 1.0:
            raise CctError(f"{what}: every share must be in [0, 1], got {shares}")
    if abs(sum(shares) - 1.0) > SHARE_TOLERANCE:
        raise CctError(f"{what}: shares must sum to 1, got {shares} (sum {sum(shares):.6g})")
    return shares


class ShareTable:
    """Default per-device shares plus per-layer overrides (layer name -> shares)."""

    def __init__(self, default: Sequence[float], layer_shares: Mapping[str, Sequence[float]] | None = None):
        n = len(default)
        self.default = normalize_shares(default, n, "default shares")
        self.layers = {name: normalize_shares(s, n, f"shares of layer '{name}'")
                       for name, s in (layer_shares or {}).items()}

    def for_layer(self, name: str) -> list[float]:
        return self.layers.get(name, self.default)

    def counts(self, name: str, batch: int) -> list[int]:
        """Images per device for layer ``name`` at batch size ``batch``."""
        return shares_to_counts(self.for_layer(name), batch)


# -- which layers split -------------------------------------------------------------------------
# Types whose computation is independent per item along axis 0, given the axis checks below.
_ELEMENTWISE = {
    "ReLU", "PReLU", "ELU", "Sigmoid", "TanH", "AbsVal", "Power", "Exp", "Log", "BNLL", "Threshold", "Clip",
    "Swish", "Dropout", "LRN", "Pooling", "Eltwise", "MVN", "Im2col", "Embed",
}
# Views (top shares the bottom's memory) or no-ops: nothing to compute, run on the host.
_VIEW_OR_NOOP = {"Split", "Flatten", "Reshape", "Silence"}


def _axis(layer: Layer, value: int, blob: Blob) -> int:
    n = len(blob.shape)
    return value + n if value < 0 else value


def _batch_axis_free(layer: Layer, bottom: Sequence[Blob]) -> bool:
    """Type-specific check that the layer does not work across axis 0."""
    t = layer.type
    p = layer.param
    b0 = bottom[0] if bottom else None
    if t in _ELEMENTWISE:
        return True
    if t in ("Convolution", "Deconvolution"):
        return _axis(layer, p.convolution_param.axis, b0) >= 1
    if t == "InnerProduct":
        return _axis(layer, p.inner_product_param.axis, b0) >= 1
    if t == "Softmax":
        return _axis(layer, p.softmax_param.axis, b0) >= 1
    if t == "Concat":
        cp = p.concat_param
        return (cp.concat_dim if cp.HasField("concat_dim") else _axis(layer, cp.axis, b0)) >= 1
    if t == "Slice":
        sp = p.slice_param
        return (sp.slice_dim if sp.HasField("slice_dim") else _axis(layer, sp.axis, b0)) >= 1
    if t in ("Scale", "Bias"):
        prm = p.scale_param if t == "Scale" else p.bias_param
        return len(bottom) == 1 and _axis(layer, prm.axis, b0) >= 1
    if t == "BatchNorm":
        return bool(getattr(layer, "use_global_stats", False))
    if t == "Crop":
        return _axis(layer, p.crop_param.axis, b0) >= 1
    if t == "Tile":
        return _axis(layer, p.tile_param.axis, b0) >= 1
    if t == "Reduction":
        return _axis(layer, p.reduction_param.axis, b0) >= 1
    if t == "ArgMax":
        return not p.argmax_param.HasField("axis") or _axis(layer, p.argmax_param.axis, b0) >= 1
    return False


def draws_random(layer: Layer) -> bool:
    """True when the layer's forward draws random numbers (Dropout / stochastic pooling in TRAIN)."""
    return layer.draws_random()


def layer_mode(layer: Layer, bottom: Sequence[Blob], top: Sequence[Blob]) -> str:
    """"split", "serial" or "host" for this layer at the current shapes (see module docstring)."""
    if layer.is_loss or layer.type in _VIEW_OR_NOOP or not bottom or not top:
        return "host"
    shapes = [b.shape for b in bottom] + [t.shape for t in top]
    if any(len(s) == 0 for s in shapes):
        return "host"
    n = shapes[0][0]
    if n < 1 or any(s[0] != n for s in shapes):
        return "host"
    try:
        free = _batch_axis_free(layer, bottom)
    except (AttributeError, ValueError):
        free = False
    if not free:
        return "host"
    return "serial" if draws_random(layer) else "split"
