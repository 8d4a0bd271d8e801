"""Devices and the FLOPS-proportional data-parallel scheduler (CcT section 2.3).

``cct.set_devices(["cpu", "cpu:1"], shares="auto")`` picks the devices; :func:`attach`
installs a :class:`DataParallelExecutor` on a Net so that every batch-separable layer runs
split by batch over the devices (shares proportional to their measured FLOPS, or explicit,
per layer if wanted), with the partial gradients summed on a host thread overlapped with
the backward pass. :func:`device_query` lists the devices with their measured GFLOPS.
"""
from .config import (
                     DeviceConfig,
                     add_device_arguments,
                     attach,
                     detach,
                     device_query,
                     devices_from_args,
                     format_device_query,
                     get_devices,
                     make_config,
                     parse_devices,
                     parse_shares,
                     set_devices,
)
from .devices import CpuDevice, Device, GpuDevice, configure_thread_budgets, cpu_cores, gpu_count, peak_gflops
from .executor import DataParallelExecutor, ExecutorStats
from .probe import measure_gflops, probe
from .split import ShareTable, flops_share, layer_mode, normalize_shares, shares_to_counts

__all__ = [
    "DeviceConfig", "add_device_arguments", "attach", "detach", "device_query", "devices_from_args",
    "format_device_query", "get_devices", "make_config", "parse_devices", "parse_shares", "set_devices",
    "CpuDevice", "Device", "GpuDevice", "configure_thread_budgets", "cpu_cores", "gpu_count", "peak_gflops",
    "DataParallelExecutor", "ExecutorStats", "measure_gflops", "probe", "ShareTable", "flops_share",
    "layer_mode", "normalize_shares", "shares_to_counts",
]
