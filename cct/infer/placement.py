"""Where dense inference runs (ZNNi section VII): the host, a GPU holding the whole net, or GPU + host RAM.

:func:`gpu_config` is the configuration a net is built with to live on GPU ``index`` (as ``cct train --gpu``
builds one: a single resident device); :func:`target_of` names the mode a net and a device make.
"""
from __future__ import annotations

from ..config import Config, current
from ..device.driver import CupyDevice, Device
from ..errors import CctError
from ..runsetup import select_gpus
from ..scheduler import make_config


def gpu_config(index: int, base: Config | None = None) -> Config:
    """``base`` (default the current configuration) with GPU ``index`` as the one device a net lives on;
    a clean error when there is no such GPU (no CuPy, no device, a wrong id)."""
    select_gpus(str(int(index)))
    return (base if base is not None else current()).replace(devices=make_config(f"gpu:{int(index)}"))


def gpu_device(index: int) -> CupyDevice:
    """GPU ``index`` as a :class:`Device` (a clean error when there is none)."""
    select_gpus(str(int(index)))
    return CupyDevice(int(index))


def target_of(net_device: Device, device: Device | None, host_ram: bool) -> str:
    """The inference target of a net on ``net_device`` asked to run on ``device`` (None: the net's own):
    ``"gpu"`` for a net on a GPU, ``"gpu+host"`` with ``host_ram`` (a host net whose convolutions run on
    ``device`` in sub-layers), else ``"host"``; a clean error for the combinations that cannot run."""
    if net_device.is_gpu:
        if host_ram:
            raise CctError("GPU + host RAM keeps the activations in host memory: build the net on the host and "
                           "pass the GPU as device= (cct infer --gpu N --host_ram does)")
        if device is not None and device != net_device:
            raise CctError(f"the net lives on {net_device.name}, not on {device.name}")
        return "gpu"
    if host_ram:
        if device is None:
            raise CctError("GPU + host RAM needs the device the convolutions run on (device=)")
        return "gpu+host"
    if device is not None and device.is_gpu:
        raise CctError(f"the net lives in host memory: build it on {device.name} (config=cct.infer.gpu_config(N)) "
                       "to run it there, or pass host_ram=True to run its convolutions there in sub-layers")
    return "host"
