"""Dense sliding-window inference of 2-D and 3-D ConvNets (ZNNi): ``cct infer`` and :class:`DenseInference`.

Modules, one job each: :mod:`.geometry` (field of view, size rules, which nets can be made dense),
:mod:`.fragments` (max-pooling fragments), :mod:`.dense` (one patch through the net), :mod:`.tiling`
(overlap-save tiles, padding), :mod:`.plan` (patch and MPF under the memory budget), :mod:`.volume_io`
(HDF5/.npy/TIFF volumes, resumable outputs), :mod:`.pipeline` (:class:`DenseInference`), :mod:`.cli`
(``cct infer``), :mod:`.naive` (the per-window reference), :mod:`.znni_nets` and :mod:`.example`; on a
GPU (ZNNi section VII) :mod:`.placement` (GPU-only, GPU + host RAM or CPU-GPU: which one, the net's copy on
a device) and :mod:`.hostsplit` (GPU + host RAM's convolution sub-layers); :mod:`.stages` runs both the CPU
pipeline and the CPU-GPU one.
"""
from .geometry import NotDensifiableError, field_of_view
from .pipeline import DenseInference
from .placement import gpu_config, gpu_device

__all__ = ["DenseInference", "NotDensifiableError", "field_of_view", "gpu_config", "gpu_device"]
