"""Lowering choice at net setup: the optimizer's pick per conv layer, wrapped for batching.

A Convolution/Deconvolution layer calls :func:`plan_lowering` when its geometry or batch size
changes (unless the user set ``layer.lowering`` by hand). The engine-wide settings live here:

* ``mode``: ``"cct"`` (cost-model choice, whole-batch lowering bounded by the memory budget) or
  ``"caffe"`` (Caffe-style: type 1, one image per GEMM, the baseline benchmarks compare against);
* ``partitions``: batch partitions run in parallel (int; ``"model"``, the default: the cost model
  picks per layer, pricing ``p`` partitions with the constants calibrated for ``threads / p`` BLAS
  threads; ``"auto"``: measured on the first call and cached);
* ``overrides``: ``{"conv1": "type3", "*": "type1"}`` (also ``CCT_LOWERING=conv1=type3,...``);
* OpenBLAS's idle-worker spinning is shortened once per process (:func:`cct.blas.limit_openblas_spin`;
  ``CCT_BLAS_THREAD_TIMEOUT=off`` keeps it);
* ``calibrate``: measure this machine's constants if none are cached (``cct train``/``cct time`` do,
  unless ``CCT_CALIBRATE=0``; the Python API uses the cache, or a nominal model until ``cct calibrate``
  has run, so that building a net never stalls).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from .base import LoweringStrategy, get_strategy
from .geometry import ConvGeometry

log = logging.getLogger("cct")

MODES = ("cct", "caffe")


@dataclass
class EngineConfig:
    """Engine-wide lowering settings (see module docstring)."""

    mode: str = "cct"
    partitions: int | str = "model"
    overrides: dict[str, str] = field(default_factory=dict)
    calibrate: bool = os.environ.get("CCT_CALIBRATE", "0").lower() in ("1", "true", "yes")


_config = EngineConfig()


def configure(mode: str | None = None, partitions: int | str | None = None,
              overrides: dict[str, str] | str | None = None, calibrate: bool | None = None) -> EngineConfig:
    """Change the engine settings used by nets built from now on; returns the settings."""
    from .optimizer import parse_overrides

    if mode is not None:
        if mode not in MODES:
            raise ValueError(f"unknown lowering mode '{mode}' (use one of {', '.join(MODES)})")
        _config.mode = mode
    if partitions is not None:
        if not (partitions in ("auto", "model") or (isinstance(partitions, int) and partitions >= 1)):
            raise ValueError(f"partitions must be 'auto', 'model' or a positive int, got {partitions!r}")
        _config.partitions = partitions
    if overrides is not None:
        parsed = parse_overrides(overrides) if isinstance(overrides, str) else dict(overrides)
        for name in parsed.values():
            get_strategy(name)  # unknown names fail here, naming the known ones
        _config.overrides = parsed
    if calibrate is not None:
        _config.calibrate = bool(calibrate)
    return _config


def config() -> EngineConfig:
    """The current engine settings."""
    return _config


def plan_lowering(layer_name: str, geom: ConvGeometry, batch: int) -> LoweringStrategy:
    """The lowering a conv layer should run for ``geom`` at ``batch`` images; logs the choice."""
    from .. import blas
    from .calibrate import load_machine
    from .optimizer import lowering_for_layer, parse_overrides
    from .partition import BatchedLowering

    blas.limit_openblas_spin()  # once per process: idle OpenBLAS workers must not spin for ~0.1 s
    if _config.mode == "caffe":
        log.info("%s: lowering type 1, one image per GEMM (Caffe-style mode)", layer_name)
        return BatchedLowering(get_strategy("type1"), batch_partition="caffe", partitions=1)
    overrides = dict(parse_overrides())  # CCT_LOWERING from the environment
    overrides.update(_config.overrides)
    machine = load_machine(measure_if_missing=_config.calibrate)
    if _config.calibrate and _config.partitions == "model" and machine.threads > 1:
        # constants for two partitions too (more partitions are only considered once calibrated)
        load_machine(measure_if_missing=True, threads=machine.threads // 2)
    strategy, _plan, line = lowering_for_layer(layer_name, geom, batch, machine=machine, overrides=overrides)
    lowering = BatchedLowering(strategy, batch_partition="auto", partitions=_config.partitions)
    try:
        from .partition import describe

        line += f" [{describe(lowering, geom, batch)}]"
    except Exception:  # noqa: BLE001 - the log line must never break net setup
        pass
    log.info("%s", line)
    return lowering
