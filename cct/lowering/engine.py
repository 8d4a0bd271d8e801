"""Lowering choice at net setup: the optimizer's pick per conv layer, wrapped for batching.

A Convolution/Deconvolution layer calls :func:`plan_lowering` when its geometry or batch size
changes (unless the user set ``layer.lowering`` by hand). The engine settings (:class:`EngineConfig`, part
of the :class:`cct.config.Config` a net is given):

* ``mode``: ``"cct"`` (cost-model choice, whole-batch lowering bounded by the memory budget) or
  ``"caffe"`` (Caffe-style: type 1, one image per GEMM, the baseline benchmarks compare against);
* ``partitions``: batch partitions run in parallel (int; ``"model"``, the default: the cost model
  picks per layer, pricing ``p`` partitions with the constants calibrated for ``threads / p`` BLAS
  threads; ``"auto"``: measured on the layer when it is planned, cached);
* ``overrides``: ``{"conv1": "type3", "*": "type1"}`` (also ``CCT_LOWERING=conv1=type3,...``);
* OpenBLAS's idle-worker spinning is shortened once per process (:func:`cct.blas.limit_openblas_spin`;
  ``CCT_BLAS_THREAD_TIMEOUT=off`` keeps it);
* ``calibrate``: measure this machine's constants if none are cached (``cct train``/``cct time`` do,
  unless ``CCT_CALIBRATE=0``; the Python API uses the cache, or a nominal model until ``cct calibrate``
  has run, so that building a net never stalls);
* ``tune``: run the strategies the cost model predicts within 30% of each other on the layer itself
  and keep the fastest (:mod:`cct.lowering.tune`; cached per machine). ``cct train``/``cct time`` do,
  unless ``CCT_TUNE=0``; the Python API does not by default.

A layer whose blobs live in a GPU's memory calls :func:`plan_device_lowering` instead: the host's cost
model does not price a GPU, so it runs type 1 over the whole batch, the overridden strategy, or with
``tune_device`` (``CCT_TUNE_DEVICE=1``; off by default) the strategy measured fastest on the GPU
itself, layer by layer. Off by default because a layer measured alone is not the layer in the net: on
an H100, FFT ran CaffeNet's conv2 29% faster than type 1 alone, yet made the whole training step
slower in every paired run (a resident net's step is bound by the host issuing kernels, and FFT issues
more of them; benchmarks/README.md).
"""
from __future__ import annotations

import logging
from typing import Any

from .. import blas
from ..config import EngineConfig, current, parse_overrides, update_default
from .base import LoweringStrategy, check_names, get_strategy
from .budget import memory_budget
from .calibrate import load_machine
from .gemm_ops import PASSES
from .geometry import ConvGeometry
from .optimizer import describe_plan, plan_convolution
from .partition import BatchedLowering
from .tune import device_cache, device_name, pick_on_device

log = logging.getLogger("cct")


def configure(mode: str | None = None, partitions: int | str | None = None,
              overrides: dict[str, str] | str | None = None, calibrate: bool | None = None,
              tune: bool | None = None, tune_device: bool | None = None) -> EngineConfig:
    """Change the engine settings of the process default configuration (nets built from now on
    outside a ``using_config`` block or an explicit ``config=``); returns the new settings."""
    changes = {k: v for k, v in (("mode", mode), ("partitions", partitions), ("overrides", overrides),
                                 ("calibrate", calibrate), ("tune", tune), ("tune_device", tune_device))
               if v is not None}
    return update_default(engine=changes).engine


def config() -> EngineConfig:
    """The engine settings in effect now (:func:`cct.config.current`)."""
    return current().engine


def override_for(layer_name: str, cfg: EngineConfig) -> str | None:
    """The strategy forced on conv layer ``layer_name``: ``cfg.overrides`` over ``CCT_LOWERING`` (per layer, else
    ``"*"``), or None; every name given is checked against the registered strategies."""
    overrides = {**parse_overrides(), **cfg.overrides}
    check_names(overrides.values())
    return overrides.get(layer_name, overrides.get("*"))


def plan_lowering(layer_name: str, geom: ConvGeometry, batch: int,
                  config: EngineConfig | None = None, passes: tuple[str, ...] | None = None) -> LoweringStrategy:
    """The strategy a conv layer should run for ``geom`` at ``batch`` images under ``config`` (None: the
    current configuration's engine settings): the optimizer's :class:`~cct.lowering.optimizer.Plan`
    (strategy per pass, ``b_p``, partitions, checked against the memory budget) wrapped in the
    :class:`~cct.lowering.partition.BatchedLowering` that executes it; logs the plan report. ``passes``:
    the passes the layer runs (default all three; a layer whose bottom needs no gradient leaves out
    ``bwd_data``), the ones the plan is priced on."""
    cfg = config if config is not None else current().engine
    blas.limit_openblas_spin()  # once per process: idle OpenBLAS workers must not spin for ~0.1 s
    if cfg.mode == "caffe":
        log.info("%s: lowering type 1, one image per GEMM (Caffe-style mode)", layer_name)
        return BatchedLowering(get_strategy("type1"), batch_partition="caffe", partitions=1)
    forced = override_for(layer_name, cfg)
    machine = load_machine(measure_if_missing=cfg.calibrate)
    if cfg.calibrate and cfg.partitions == "model" and machine.threads > 1:
        # constants for two partitions too (more partitions are only considered once calibrated)
        load_machine(measure_if_missing=True, threads=machine.threads // 2)
    budget = lowering_budget(current())
    plan = plan_convolution(geom, batch, machine, override=forced,
                            budget=budget, partitions=cfg.partitions, passes=passes or PASSES,
                            tune=cfg.tune and not getattr(machine, "nominal", False))
    report = describe_plan(layer_name, plan)
    lowering = BatchedLowering(plan.strategy(), batch_partition=plan.b_p, partitions=plan.partitions,
                               budget=plan.budget, chosen_plan=plan, plan_report=report)
    log.info("%s", report)
    return lowering


def plan_device_lowering(layer_name: str, geom: ConvGeometry, batch: int, xp: object,
                         config: EngineConfig | None = None,
                         passes: tuple[str, ...] | None = None) -> LoweringStrategy:
    """The strategy of a conv layer whose blobs live in the memory of ``xp``'s current device (a GPU),
    run over the whole batch: the override for the layer if any (``mode`` "caffe": type 1), else with
    ``tune_device`` the fastest measured there (:func:`cct.lowering.tune.pick_on_device`, cached per GPU
    model), else type 1; logs the choice."""
    cfg = config if config is not None else current().engine
    forced = override_for(layer_name, cfg)
    measured: dict[str, float] = {}
    if cfg.mode == "caffe":
        name, why = "type1", "Caffe-style mode"
    elif forced:
        name, why = forced, "override"
    elif cfg.tune_device:
        name, measured = pick_on_device(geom, batch, passes or PASSES, xp, cache=device_cache(xp))
        why = "measured on " + device_name(xp)
    else:
        name, why = "type1", "default"
    times = "".join(f" {n} {t * 1e3:.3g} ms" for n, t in sorted(measured.items(), key=lambda kv: kv[1]))
    report = (f"{layer_name}: {name} over the whole batch of {batch} in device memory ({why})"
              + (f" [measured{times}]" if times else ""))
    lowering = BatchedLowering(get_strategy(name), batch_partition=max(1, batch), partitions=1, plan_report=report)
    log.info("%s", report)
    return lowering


def lowering_budget(cfg: Any) -> int:
    """Bytes one conv pass's temporary buffers may use under the :class:`cct.config.Config` ``cfg``:
    ``$CCT_LOWERING_MEMORY``, else a quarter of the available RAM, at most a quarter of the config's
    ``memory_budget`` (:func:`cct.lowering.budget.memory_budget`)."""
    return memory_budget(None, getattr(cfg, "memory_budget", None))
