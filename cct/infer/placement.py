"""Where dense inference runs (ZNNi section VII): the host, a GPU holding the whole net, GPU + host RAM, or the
CPU-GPU pipeline.

:func:`gpu_config` is the configuration a net is built with to live on GPU ``index`` (as ``cct train --gpu``
builds one: a single resident device); :func:`target_of` names the mode a net and a device make;
:func:`copy_to_device` is the CPU-GPU pipeline's copy of a net on the device; :func:`gemm_speedup` measures,
once at setup, how much faster the device multiplies matrices than the host (the price of its stage).
"""
from __future__ import annotations

import time

import numpy as np

from ..config import Config, current
from ..device.driver import CupyDevice, Device, gpu_count, to_host
from ..errors import CctError
from ..scheduler import make_config


def check_gpu(index: int) -> int:
    """``index`` when there is such a GPU; a clean error naming ``--gpu`` otherwise (no CuPy, no device, a wrong
    id), as ``cct train --gpu`` gives."""
    count = gpu_count()
    if not count:
        raise CctError(f"--gpu={index} given but no GPU is available (CuPy is not installed or sees no CUDA "
                       "device); leave out --gpu to run on the CPU")
    if not 0 <= index < count:
        raise CctError(f"--gpu: there is no GPU {index} (this machine has {count})")
    return index


def gpu_config(index: int, base: Config | None = None) -> Config:
    """``base`` (default the current configuration) with GPU ``index`` as the one device a net lives on;
    a clean error when there is no such GPU (no CuPy, no device, a wrong id)."""
    index = check_gpu(int(index))
    return (base if base is not None else current()).replace(devices=make_config(f"gpu:{index}"))


def gpu_device(index: int) -> CupyDevice:
    """GPU ``index`` as a :class:`Device` (a clean error when there is none)."""
    return CupyDevice(check_gpu(int(index)))


def target_of(net_device: Device, device: Device | None, host_ram: bool, pipelined: bool = False) -> str:
    """The inference target of a net on ``net_device`` asked to run on ``device`` (None: the net's own):
    ``"gpu"`` for a net on a GPU, ``"gpu+host"`` with ``host_ram`` (a host net whose convolutions run on
    ``device`` in sub-layers), ``"cpu-gpu"`` for a host net, a ``device`` and a pipeline (its second stage
    there), else ``"host"``; a clean error for the combinations that cannot run."""
    if net_device.is_gpu:
        if host_ram:
            raise CctError("GPU + host RAM keeps the activations in host memory: build the net on the host and "
                           "pass the GPU as device= (cct infer --gpu N --host_ram does)")
        if device is not None and device != net_device:
            raise CctError(f"the net lives on {net_device.name}, not on {device.name}")
        if pipelined:
            raise CctError("the CPU-GPU pipeline runs its first stage on the host: build the net on the host and "
                           "pass the GPU as device= (cct infer --gpu N --pipeline auto does)")
        return "gpu"
    if host_ram:
        if device is None:
            raise CctError("GPU + host RAM needs the device the convolutions run on (device=)")
        if pipelined:
            raise CctError("GPU + host RAM and the CPU-GPU pipeline are two different modes: choose one")
        return "gpu+host"
    if device is not None and pipelined:
        return "cpu-gpu"
    if device is not None and device.is_gpu:
        raise CctError(f"the net lives in host memory: build it on {device.name} (config=cct.infer.gpu_config(N)) "
                       "to run it there, or pass host_ram=True to run its convolutions there in sub-layers")
    return "host"


def copy_to_device(net, device: Device):
    """A copy of the host ``net`` (same layers and weights) built on ``device`` (on the host: a second host net,
    the CPU stand-in the tests run)."""
    config = gpu_config(device.index, net.config) if device.is_gpu else net.config
    out = type(net)(net.param, net.phase, dtype=net.dtype, config=config)
    for name, blobs in net.params.items():
        for src, dst in zip(blobs, out.params[name]):
            out.device.upload(to_host(src.data), out=dst.data)
    return out


def gemm_speedup(device: Device, size: int = 1024, rounds: int = 3) -> float:
    """How many times faster ``device`` multiplies two ``size x size`` float32 matrices than the host (the
    median of ``rounds`` after a warm-up on each); exactly 1 for the host itself, without measuring."""
    if not device.is_gpu:
        return 1.0
    a = np.random.default_rng(0).standard_normal((size, size)).astype(np.float32)

    def median_seconds(xp, x) -> float:
        times = []
        for _ in range(rounds + 1):
            device.synchronize()
            t0 = time.perf_counter()
            xp.matmul(x, x)
            device.synchronize()
            times.append(time.perf_counter() - t0)
        return sorted(times[1:])[rounds // 2]

    return median_seconds(np, a) / max(median_seconds(device.xp, device.upload(a)), 1e-9)
