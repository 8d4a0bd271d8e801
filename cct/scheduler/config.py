"""Device configuration: ``--devices`` / ``--share`` parsing, ``cct.set_devices``, ``attach``.

Device specs (comma separated on the command line)::

    cpu                         one CPU device (cpu:0) with all cores as BLAS threads
    cpu:1                       CPU device 1 (each CPU device is its own worker thread)
    cpu:0:blas=mkl:threads=1    options: blas=openblas|mkl|auto, threads=N
    gpu  gpu:0                  a CUDA GPU through CuPy (error when there is none)
    auto                        every GPU if CuPy sees one, else the CPU (with a log line)

CPU devices without ``threads=`` share the cores evenly. Shares: ``auto`` (FLOPS-proportional
from the measured probe, CcT's heuristic), ``peak`` (proportional to the theoretical peaks) or
explicit fractions ``0.15,0.85`` summing to 1; per-layer overrides ``conv1=0.3,0.7``.
Errors are :class:`cct.CctError`, never silent fallbacks.
"""
from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import blas
from .. import config as config_mod
from ..errors import CctError
from ..proto import caffe_pb2
from .devices import (
    CpuDevice,
    Device,
    GpuDevice,
    ThreadBudget,
    configure_thread_budgets,
    cpu_cores,
    gpu_count,
    peak_gflops,
)
from .executor import DataParallelExecutor
from .probe import probe
from .split import ShareTable, normalize_shares

log = logging.getLogger("cct")

ShareSpec = str | Sequence[float]


# -- parsing ---------------------------------------------------------------------------------
def _parse_one(token: str) -> dict:
    token = token.strip()
    if not token:
        raise CctError("empty device spec (use e.g. cpu, cpu:1, cpu:0:blas=mkl:threads=1, gpu:0, auto)")
    parts = token.split(":")
    kind = parts[0].lower()
    if kind not in ("cpu", "gpu"):
        raise CctError(f"device '{token}': unknown kind '{parts[0]}' (use cpu, gpu or auto)")
    spec: dict[str, Any] = {"kind": kind, "index": 0, "blas": None, "threads": None, "text": token}
    rest = parts[1:]
    if rest and rest[0].isdigit():
        spec["index"] = int(rest[0])
        rest = rest[1:]
    for opt in rest:
        key, eq, val = opt.partition("=")
        if not eq:
            raise CctError(f"device '{token}': expected an index or key=value, got '{opt}'")
        key = key.strip().lower()
        if kind == "cpu" and key == "blas":
            spec["blas"] = val.strip().lower()
        elif kind == "cpu" and key == "threads":
            if not val.strip().isdigit() or int(val) < 1:
                raise CctError(f"device '{token}': threads must be a positive integer, got '{val}'")
            spec["threads"] = int(val)
        else:
            raise CctError(f"device '{token}': unknown option '{key}' for a {kind} device "
                           f"({'blas=, threads=' if kind == 'cpu' else 'none'})")
    return spec


def parse_devices(spec: str | Sequence[str]) -> list[Device]:
    """Devices from ``"cpu,cpu:1"`` or ``["cpu", "gpu:0"]`` (see module docstring)."""
    tokens = [t for t in spec.split(",")] if isinstance(spec, str) else list(spec)
    if not tokens:
        raise CctError("no devices given")
    specs: list[dict] = []
    for t in tokens:
        if t.strip().lower() == "auto":
            n = gpu_count()
            if n:
                specs += [_parse_one(f"gpu:{i}") for i in range(n)]
            else:
                log.info("devices auto: no GPU (CuPy missing or no device visible); using the CPU")
                specs.append(_parse_one("cpu"))
        else:
            specs.append(_parse_one(t))
    seen = set()
    for s in specs:
        key = (s["kind"], s["index"])
        if key in seen:
            raise CctError(f"device {s['kind']}:{s['index']} given twice")
        seen.add(key)
    n_cpu = sum(s["kind"] == "cpu" for s in specs)
    default_threads = max(1, cpu_cores() // max(1, n_cpu))
    devices: list[Device] = []
    for s in specs:
        if s["kind"] == "cpu":
            devices.append(CpuDevice(s["index"], s["threads"] or default_threads, s["blas"]))
        else:
            devices.append(GpuDevice(s["index"]))
    return devices


def _floats(text: str, what: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise CctError(f"{what}: expected comma-separated numbers, got '{text}'") from None


def parse_shares(values: str | Sequence[str] | None) -> tuple[ShareSpec, dict[str, list[float]]]:
    """``--share`` values -> (default: "auto" | "peak" | [fractions], {layer: [fractions]}).

    Each value is ``auto``, ``peak``, ``0.15,0.85`` or ``LAYER=0.3,0.7``; several may be given
    (a list, or ``;``-separated); at most one default.
    """
    if values is None:
        return "auto", {}
    items: list[str] = []
    for v in [values] if isinstance(values, str) else values:
        items += [x.strip() for x in v.split(";") if x.strip()]
    default: ShareSpec | None = None
    layers: dict[str, list[float]] = {}
    for it in items:
        name, eq, rest = it.partition("=")
        if eq:
            name = name.strip()
            if not name:
                raise CctError(f"--share '{it}': empty layer name")
            if name in layers:
                raise CctError(f"--share: layer '{name}' given twice")
            layers[name] = _floats(rest, f"--share {name}")
            continue
        if default is not None:
            raise CctError(f"--share: more than one default share ('{default}' and '{it}')")
        default = it.lower() if it.lower() in ("auto", "peak") else _floats(it, "--share")
    return (default if default is not None else "auto"), layers


# -- configuration ---------------------------------------------------------------------------
@dataclass
class DeviceConfig:
    """A set of devices with their resolved shares (what ``set_devices`` / ``--devices`` give)."""

    devices: list[Device]
    shares: list[float]
    layer_shares: dict[str, list[float]] = field(default_factory=dict)
    gflops: list[float] | None = None  # measured rates when shares == "auto"
    budget: ThreadBudget | None = None
    share_source: str = "explicit"
    model_parallel: str = "auto"  # InnerProduct by output channels: auto | always | never
    overlap: bool = True  # aggregate gradients on a host thread during backward (False: inline)

    def share_table(self) -> ShareTable:
        return ShareTable(self.shares, self.layer_shares)

    def resident_device(self) -> Device | None:
        """The device a net lives on whole when there is a single device with its own memory (one GPU):
        blobs and parameters are allocated there and no batch is split or copied per layer."""
        if len(self.devices) == 1 and self.devices[0].memory.is_gpu:
            return self.devices[0]
        return None

    def attach(self, net: Any, strict: bool = True) -> DataParallelExecutor:
        """Install a :class:`DataParallelExecutor` on ``net`` (replacing any previous one)."""
        detach(net)
        ex = DataParallelExecutor(net, self.devices, self.share_table(), budget=self.budget, strict=strict,
                                  model_parallel=self.model_parallel, overlap=self.overlap)
        net.executor = ex
        return ex

    def close(self) -> None:
        """Restore the BLAS thread limits and stop the device workers."""
        if self.budget is not None:
            self.budget.restore()
            self.budget = None
        for d in self.devices:
            d.close()

    def describe(self) -> str:
        parts = [f"{d.signature()} {s:.3f}" for d, s in zip(self.devices, self.shares)]
        return f"devices ({self.share_source} shares): " + ", ".join(parts)


def resolve_shares(devices: Sequence[Device], shares: ShareSpec) -> tuple[list[float], list[float] | None, str]:
    """(fractions, measured GFLOPS or None, source) for ``auto`` / ``peak`` / explicit shares."""
    n = len(devices)
    if isinstance(shares, str):
        what = shares.strip().lower()
        if what == "auto":
            if n == 1:
                return [1.0], None, "single device"
            g = probe(devices)
            total = sum(g)
            if total <= 0:
                raise CctError(f"FLOPS probe measured no throughput on {[d.name for d in devices]}")
            return [x / total for x in g], g, "auto (measured GFLOPS)"
        if what == "peak":
            peaks = [peak_gflops(d) for d in devices]
            if any(p is None for p in peaks):
                raise CctError(f"shares 'peak': theoretical peak unknown for "
                               f"{[d.name for d, p in zip(devices, peaks) if p is None]}; use auto")
            total = sum(peaks)
            return [p / total for p in peaks], None, "peak (theoretical GFLOPS)"
        raise CctError(f"unknown shares '{shares}' (use auto, peak or fractions such as 0.15,0.85)")
    return normalize_shares(shares, n), None, "explicit"


def make_config(devices: str | Sequence[str] | Sequence[Device], shares: ShareSpec = "auto",
                layer_shares: Mapping[str, Sequence[float]] | None = None) -> DeviceConfig:
    """Build devices (from specs or Device objects), apply thread budgets and resolve shares."""
    if isinstance(devices, str) or (devices and not isinstance(list(devices)[0], Device)):
        devs = parse_devices(devices)  # type: ignore[arg-type]
    else:
        devs = list(devices)  # type: ignore[arg-type]
    if not devs:
        raise CctError("no devices given")
    budget = configure_thread_budgets(devs)
    try:
        fr, g, source = resolve_shares(devs, shares)
        ls = {k: normalize_shares(v, len(devs), f"shares of layer '{k}'") for k, v in (layer_shares or {}).items()}
    except BaseException:
        budget.restore()
        raise
    cfg = DeviceConfig(devs, fr, ls, g, budget, source)
    log.info("%s", cfg.describe())
    return cfg


def set_devices(devices: str | Sequence[str] | Sequence[Device] | DeviceConfig | None, shares: ShareSpec = "auto",
                layer_shares: Mapping[str, Sequence[float]] | None = None) -> DeviceConfig | None:
    """Select the devices of the process default configuration (``cct.set_devices(["cpu", "cpu:1"],
    shares="auto")``); a thin wrapper over :func:`cct.config.update_default`.

    ``shares``: "auto" (measured FLOPS), "peak", or one fraction per device summing to 1;
    ``layer_shares``: layer name -> fractions. ``None`` goes back to the plain single-device
    path. Nets built afterwards without a config of their own get the executor; the previous
    default devices are closed. Returns the new device configuration.
    """
    previous = config_mod.default().devices
    if previous is not None and previous is not devices:
        previous.close()
    cfg = None
    if devices is not None:
        cfg = devices if isinstance(devices, DeviceConfig) else make_config(devices, shares, layer_shares)
    config_mod.update_default(devices=cfg)
    return cfg


def get_devices() -> DeviceConfig | None:
    """The devices of the configuration in effect (:func:`cct.config.current`; None: plain
    single-device execution)."""
    return config_mod.current().devices


def attach(net: Any, devices: str | Sequence[str] | Sequence[Device] | DeviceConfig | None = None,
           shares: ShareSpec | None = None, layer_shares: Mapping[str, Sequence[float]] | None = None,
           strict: bool = True) -> DataParallelExecutor | None:
    """Install the data-parallel executor on ``net``.

    ``devices`` None: the devices of the net's own configuration, else those of
    :func:`cct.config.current` (returns None and leaves the net alone when there are none).
    ``strict=False`` tolerates per-layer shares naming layers the net lacks (a TEST net without
    TRAIN-only layers).
    """
    if isinstance(devices, DeviceConfig):
        cfg = devices
    elif devices is None:
        own = getattr(net, "config", None)
        cfg = own.devices if own is not None and own.devices is not None else get_devices()
        if cfg is None:
            return None
        if shares is not None or layer_shares is not None:
            fr, g, source = resolve_shares(cfg.devices, shares) if shares is not None else (
                cfg.shares, cfg.gflops, cfg.share_source)
            ls = cfg.layer_shares if layer_shares is None else {
                k: normalize_shares(v, len(cfg.devices), f"shares of layer '{k}'") for k, v in layer_shares.items()}
            cfg = DeviceConfig(cfg.devices, fr, ls, g, cfg.budget, source, cfg.model_parallel, cfg.overlap)
    else:
        cfg = make_config(devices, shares or "auto", layer_shares)
        try:
            ex = cfg.attach(net, strict=strict)
        except BaseException:
            cfg.close()
            raise
        ex.owned_config = cfg  # detach() closes its devices and restores the thread limits
        return ex
    return cfg.attach(net, strict=strict)


def detach(net: Any) -> None:
    """Remove the executor from ``net`` (waiting for its pending aggregation)."""
    ex = getattr(net, "executor", None)
    if isinstance(ex, DataParallelExecutor):
        ex.close()
        owned = getattr(ex, "owned_config", None)
        if owned is not None:
            owned.close()
    net.executor = None


# -- command line ------------------------------------------------------------------------------
def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--devices`` and ``--share`` to a ``cct`` subcommand parser."""
    parser.add_argument("--devices", default=None, metavar="SPEC",
                        help="devices to split each batch over, e.g. 'cpu', 'cpu,cpu:1', "
                             "'cpu:0:blas=openblas:threads=1,cpu:1:blas=mkl:threads=1', 'gpu:0,cpu', 'auto'")
    parser.add_argument("--share", action="append", default=None, metavar="SHARES",
                        help="batch shares per device: 'auto' (measured FLOPS, default), 'peak', "
                             "'0.15,0.85' (must sum to 1), or per layer 'conv1=0.3,0.7' (repeatable)")
    parser.add_argument("--model_parallel", default="auto", choices=["auto", "always", "never"],
                        help="split InnerProduct layers across devices by output channels instead of by batch "
                             "(auto: when the layer has more outputs than the batch has images)")


def devices_from_args(args: argparse.Namespace, solver_param: caffe_pb2.SolverParameter | None = None
                      ) -> DeviceConfig | None:
    """The device configuration for a CLI run (None: plain single-device CPU execution).

    Priority: ``--devices``; then Caffe's ``--gpu 0,1|all`` (if the CLI defines it); then the solver's
    ``solver_mode: GPU`` + ``device_id``. An explicit GPU (``--devices gpu..``, ``--gpu``) without a
    GPU is an error; ``solver_mode: GPU`` in a solver file (the zoo's default) without a GPU falls
    back to the CPU with a warning.
    """
    share_values = getattr(args, "share", None)
    shares, layer_shares = parse_shares(share_values)
    cfg = _devices_from_args(args, solver_param, shares, layer_shares, share_values)
    if cfg is not None:
        cfg.model_parallel = getattr(args, "model_parallel", "auto")
    return cfg


def _devices_from_args(args, solver_param, shares, layer_shares, share_values) -> DeviceConfig | None:
    spec = getattr(args, "devices", None)
    if spec:
        return make_config(spec, shares, layer_shares)
    gpu = getattr(args, "gpu", None)
    if gpu:
        if str(gpu).strip().lower() == "all":
            n = gpu_count()
            if n == 0:
                raise CctError("--gpu all: no GPU is available (CuPy missing or no device visible)")
            spec = ",".join(f"gpu:{i}" for i in range(n))
        else:
            spec = ",".join(f"gpu:{int(x)}" for x in str(gpu).split(","))
        return make_config(spec, shares, layer_shares)
    if solver_param is not None:
        cfg = devices_for_solver_mode(solver_param, shares, layer_shares)
        if cfg is not None:
            return cfg
    if share_values:
        raise CctError("--share needs --devices (more than one device to split over)")
    return None


def devices_for_solver_mode(solver_param: caffe_pb2.SolverParameter, shares: ShareSpec = "auto",
                            layer_shares: Mapping[str, Sequence[float]] | None = None) -> DeviceConfig | None:
    """Caffe's ``solver_mode: GPU`` + ``device_id`` (None for CPU mode, or GPU mode with no GPU:
    then a warning, since upstream solver files say GPU by default)."""
    if solver_param.solver_mode != caffe_pb2.SolverParameter.GPU:
        return None
    if gpu_count() == 0:
        log.warning("solver_mode: GPU but no GPU is available (CuPy missing or no device visible); "
                    "training on the CPU")
        return None
    return make_config(f"gpu:{solver_param.device_id}", shares, layer_shares)


# -- device_query ------------------------------------------------------------------------------
def device_query(measure: bool = True, force: bool = False) -> list[dict]:
    """Every device cct can use: name, kind, BLAS backend/kernel, threads, GFLOPS (measured, peak), memory.

    CPU: one entry per BLAS backend available (all cores); GPU: one per visible GPU. Measured
    GFLOPS come from the cached probe (``force`` re-measures).
    """
    devs: list[Device] = []
    threads = cpu_cores()
    for name in blas.BACKENDS:
        if name == "mkl" and not blas.mkl_available():
            continue
        try:
            devs.append(CpuDevice(0, threads, name, query_only=True))
        except CctError as e:
            log.info("device_query: cpu with %s unavailable: %s", name, e)
    for i in range(gpu_count()):
        devs.append(GpuDevice(i))
    out = []
    for d in devs:
        info = d.info()
        info["peak_gflops"] = peak_gflops(d)
        info["gflops"] = None
        if measure:
            budget = configure_thread_budgets([d])
            try:
                info["gflops"] = probe([d], force=force)[0]
            finally:
                budget.restore()
        d.close()
        out.append(info)
    return out


def format_device_query(rows: Sequence[dict]) -> str:
    """Human-readable ``cct device_query`` output."""
    lines = []
    for r in rows:
        mem = r.get("memory_bytes")
        g = r.get("gflops")
        pk = r.get("peak_gflops")
        measured = f"{g:.1f} GFLOPS" if g else "-"
        peak = f"{pk:.0f} GFLOPS" if pk else "-"
        memory = f"{mem / 2**30:.1f} GiB" if mem else "-"
        lines.append(
            f"{r['name']:<7} {r['kind']:<4} blas={r.get('blas', '-')} kernel={r.get('kernel', '-')} "
            f"threads={r.get('threads')} measured={measured} peak={peak} memory={memory}"
            + (f" ({r['gpu_name']})" if r.get("gpu_name") else ""))
    return "\n".join(lines)
