"""The device driver: the one way cct talks to the memory an array lives in (CcT's ``DeviceDriver``).

A :class:`Device` is a place arrays live and kernels run: :class:`HostDevice` (numpy, the host's memory)
or :class:`CupyDevice` (one CUDA GPU through CuPy, an optional dependency: ``pip install cct[gpu]``). It
answers everything a layer, a net or the scheduler asks about memory:

* ``xp``: the array module layers are written against (one implementation per layer for numpy and CuPy);
* :func:`device_of` (``Device.locate``): where an array lives (THE answer to "is this on a GPU":
  ``device_of(a).is_gpu``); :func:`module_device`: the device an array module allocates on now;
* ``upload`` / ``download``: host -> device and device -> host copies (into ``out=`` when given; on a GPU on
  a CUDA ``stream`` when given, synchronous on the host); ``empty`` / ``zeros``: allocation in its memory;
* ``workspace``: a scratch array allocated once per owner (zeroed when created, if asked) and handed back on
  every later call (allocate at setup, reuse in the step); the workspaces belong to the Device object, so ask
  a lasting one (``blob.device``, ``net.device``), not a fresh ``device_of(array)``. :class:`Workspaces` is
  the one allocator of scratch memory: a Device's workspaces and the lowerings' per-thread, capacity-capped
  buffers (:class:`cct.lowering.direct_layout.Scratch`, ``SharedScratch``) are all pools of it;
* ``random_stream``: a device random stream (:class:`cct.device.random.CounterRandom`, Philox4x32-10) whose
  read position lives in this device's memory; the net's streams (:class:`~cct.device.random.NetRandom`) and
  a layer's own come from its device. :mod:`cct.device.random` takes its device as given (it asks it
  ``locate`` and ``runs_host_kernels``) and imports nothing of this module, so the imports go one way;
* :func:`host_kernels_usable` (``Device.runs_host_kernels``): whether cct's compiled host kernels
  (:mod:`cct.kernels`, numba) may run on arrays; false on a GPU's, where CuPy (and cuBLAS,
  :mod:`cct.device.cublas`) run instead.

A new device kind is a subclass with its ``kind``, ``xp``, copies and ``runs_host_kernels``, and a branch in
:func:`device_of` and :func:`module_device`.
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from .. import kernels
from ..errors import CctError
from .random import CounterRandom

try:  # CuPy is optional (``pip install cct[gpu]``).
    import cupy as _cupy  # type: ignore
except Exception:  # pragma: no cover - no GPU stack on CI machines
    _cupy = None


def _shape_tuple(shape: Sequence[int] | int) -> tuple[int, ...]:
    return (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(shape)


class Workspaces:
    """The allocator of scratch memory: one buffer per key, allocated on the first request (zeroed when
    created if ``zeroed``: callers that write the same elements every time keep what they never write at
    zero) and handed back on every later request; a request of another dtype, or another shape, replaces it
    (with ``grow``: a flat buffer reused while it holds enough elements, handed out as a view of the request's
    shape). With ``capacity`` only the newest ``capacity`` keys are kept (the least recently used dropped
    first). Thread-safe; a caller that wants a buffer per thread puts the thread in its key."""

    def __init__(self, capacity: int | None = None):
        self.capacity = capacity
        self._bufs: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """The number of buffers kept."""
        return len(self._bufs)

    def items(self) -> list[tuple[Hashable, Any]]:
        """``(key, buffer)`` of every buffer kept (a snapshot)."""
        with self._lock:
            return list(self._bufs.items())

    def take(self, device: Device, key: Hashable, shape: Sequence[int] | int, dtype=np.float32,
             zeroed: bool = False, grow: bool = False) -> tuple[Any, bool]:
        """``(buffer, created)``: the buffer of ``key`` in ``device``'s memory (see the class docstring) and
        whether this request allocated it."""
        shape, dtype = _shape_tuple(shape), np.dtype(dtype)
        count = math.prod(shape) if grow else 0
        with self._lock:
            buf = self._bufs.get(key)
            created = buf is None or buf.dtype != dtype or (buf.size < count if grow else buf.shape != shape)
            if created:
                self._bufs.pop(key, None)  # the old buffer goes before the new one is allocated
                buf = None
                alloc_shape = (count,) if grow else shape
                buf = device.zeros(alloc_shape, dtype) if zeroed else device.empty(alloc_shape, dtype)
                self._bufs[key] = buf
                while self.capacity is not None and len(self._bufs) > self.capacity:
                    self._bufs.popitem(last=False)
            else:
                self._bufs.move_to_end(key)  # the most recently used
        return (buf[:count].reshape(shape) if grow else buf), created

    def get(self, device: Device, key: Hashable, shape: Sequence[int] | int, dtype=np.float32,
            zeroed: bool = False, grow: bool = False) -> Any:
        """The buffer of ``key`` (:meth:`take` without the flag)."""
        return self.take(device, key, shape, dtype, zeroed, grow)[0]


class Device:
    """A place arrays live: its array module, copies in and out, allocation, scratch and kernel choice.

    Two devices are equal when they are the same kind and index (``device_of`` hands out new objects)."""

    kind: str = ""
    is_gpu: bool = False
    index: int = 0
    _workspaces: Workspaces | None = None  # made by the first workspace() call (device_of is cheap)

    def __init__(self, index: int = 0):
        self.index = int(index)

    @property
    def name(self) -> str:
        """``host`` or ``gpu:<index>``."""
        return f"{self.kind}:{self.index}" if self.is_gpu else self.kind

    @property
    def xp(self):
        """The array module of this device's arrays (numpy or cupy)."""
        raise NotImplementedError

    # -- allocation ------------------------------------------------------------------------------
    def empty(self, shape: Sequence[int] | int, dtype=np.float32):
        """An uninitialised array in this device's memory."""
        return self.xp.empty(shape, dtype=dtype)

    def zeros(self, shape: Sequence[int] | int, dtype=np.float32):
        """A zeroed array in this device's memory."""
        return self.xp.zeros(shape, dtype=dtype)

    def workspace(self, owner_key: Hashable, shape: Sequence[int] | int, dtype=np.float32, zeroed: bool = False):
        """Scratch of ``shape``/``dtype`` for ``owner_key``: allocated on the first call (and when the owner
        asks for another shape or dtype, i.e. after a reshape; zeroed then with ``zeroed``), the same array on
        every later call (this device's :class:`Workspaces`)."""
        if self._workspaces is None:
            self._workspaces = Workspaces()
        return self._workspaces.get(self, owner_key, shape, dtype, zeroed=zeroed)

    # -- random numbers and kernels ----------------------------------------------------------------
    def random_stream(self, key: tuple[int, int], stream: int) -> CounterRandom:
        """Philox4x32-10 stream ``stream`` under ``key``, its read position in this device's memory
        (:class:`cct.device.random.CounterRandom`: the same bits on every device)."""
        return CounterRandom(key, stream, self)

    def locate(self, array: Any) -> Device:
        """The device whose memory holds ``array`` (:func:`device_of`)."""
        return device_of(array)

    def runs_host_kernels(self, *arrays: Any, contiguous: bool = False) -> bool:
        """Whether this device's work on ``arrays`` may run cct's compiled host kernels
        (:func:`host_kernels_usable` on the host; never on a GPU)."""
        return False

    # -- copies ----------------------------------------------------------------------------------
    def upload(self, host: Any, out: Any = None, stream: Any = None):
        """A copy of the host array ``host`` in this device's memory (into ``out``, same shape, when given)."""
        raise NotImplementedError

    def download(self, array: Any, out: np.ndarray | None = None, stream: Any = None) -> np.ndarray:
        """``array`` (this device's) in host memory as numpy (into ``out`` when given)."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait for the work queued on this device (nothing to wait for on the host)."""

    def free_bytes(self) -> int | None:
        """Bytes this device can still allocate (a GPU: the driver's free memory plus what CuPy's pool holds
        unused); None on the host, whose budget is :attr:`cct.config.Config.memory_budget`."""
        return None

    def use(self) -> None:
        """Make this device the current one of the calling thread (a GPU's CuPy device; no-op on the host)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and (other.kind, other.index) == (self.kind, self.index)

    def __hash__(self) -> int:
        return hash((self.kind, self.index))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class HostDevice(Device):
    """The host: numpy arrays in the process's memory; uploads and downloads are plain copies."""

    kind = "host"

    def __init__(self):
        pass  # index 0, no workspace until one is asked for: device_of makes one per call

    @property
    def xp(self):
        return np

    def upload(self, host: Any, out: Any = None, stream: Any = None):
        if out is None:
            return np.asarray(host)
        np.copyto(out, host, casting="unsafe")
        return out

    def download(self, array: Any, out: np.ndarray | None = None, stream: Any = None) -> np.ndarray:
        if out is None:
            return np.asarray(array)
        np.copyto(out, array, casting="unsafe")
        return out

    def runs_host_kernels(self, *arrays: Any, contiguous: bool = False) -> bool:
        return host_kernels_usable(*arrays, contiguous=contiguous)


class CupyDevice(Device):
    """CUDA GPU ``index`` through CuPy; uploads and downloads run on ``stream`` when one is given."""

    kind = "gpu"
    is_gpu = True

    def __init__(self, index: int = 0):
        if _cupy is None:
            raise CctError(f"GPU device gpu:{index} requested but CuPy is not installed (pip install cct[gpu])")
        super().__init__(index)

    @property
    def xp(self):
        return _cupy

    def empty(self, shape: Sequence[int] | int, dtype=np.float32):
        with _cupy.cuda.Device(self.index):
            return _cupy.empty(shape, dtype=dtype)

    def zeros(self, shape: Sequence[int] | int, dtype=np.float32):
        with _cupy.cuda.Device(self.index):
            return _cupy.zeros(shape, dtype=dtype)

    def upload(self, host: Any, out: Any = None, stream: Any = None):
        host = np.asarray(host)
        if out is None:
            out = self.empty(host.shape, host.dtype)
        if not (out.flags.c_contiguous and out.shape == host.shape):  # a strided or broadcast target
            out[...] = self.upload(host, stream=stream)
            return out
        out.set(np.require(host, dtype=out.dtype, requirements="C"), stream=stream)  # keeps a 0-d array 0-d
        return out

    def download(self, array: Any, out: np.ndarray | None = None, stream: Any = None) -> np.ndarray:
        if out is None:
            return array.get(stream=stream)
        if out.flags.c_contiguous and out.dtype == array.dtype and out.shape == array.shape:
            array.get(stream=stream, out=out)
        else:
            np.copyto(out, array.get(stream=stream), casting="unsafe")
        return out

    def synchronize(self) -> None:
        _cupy.cuda.Device(self.index).synchronize()

    def free_bytes(self) -> int | None:
        with _cupy.cuda.Device(self.index):
            free, _total = _cupy.cuda.runtime.memGetInfo()
            return int(free) + int(_cupy.get_default_memory_pool().free_bytes())

    def use(self) -> None:
        _cupy.cuda.Device(self.index).use()


def device_of(array: Any) -> Device:
    """The device whose memory holds ``array``: a :class:`CupyDevice` for a CuPy array, else the host
    (numpy arrays, memmaps, views, scalars and lists)."""
    if _cupy is not None and isinstance(array, _cupy.ndarray):
        return CupyDevice(array.device.id)
    return HostDevice()


def module_device(xp: Any) -> Device:
    """The device the array module ``xp`` allocates on now: the host for numpy, the current GPU for cupy."""
    if _cupy is not None and xp is _cupy:
        return CupyDevice(_cupy.cuda.runtime.getDevice())
    return HostDevice()


def array_module(*arrays: Any):
    """cupy if any argument is a CuPy array, else numpy (Chainer's ``get_array_module``; on every GEMM, so
    it asks the array types directly rather than making a Device per array)."""
    if _cupy is not None:
        for a in arrays:
            if isinstance(a, _cupy.ndarray):
                return _cupy
    return np


def to_host(array: Any) -> np.ndarray:
    """``array`` (on any device) in host memory as numpy."""
    return device_of(array).download(array)


def array_address(array: Any) -> int:
    """Address of an array's first element (device or host memory)."""
    if device_of(array).is_gpu:
        return int(array.data.ptr)
    return int(array.__array_interface__["data"][0])


def host_kernels_usable(*arrays: Any, contiguous: bool = False) -> bool:
    """Whether cct's compiled host kernels (:mod:`cct.kernels`, numba) may run on ``arrays``: the kernels are
    enabled and every array is a host (numpy) float32/float64 array of one dtype (and, with ``contiguous``,
    C-contiguous: the layers' blobs are; anything else takes the ``xp`` path rather than compiling another
    variant). Never on a GPU's arrays: CuPy runs those."""
    if not arrays or not kernels.enabled():
        return False
    dt = None
    for a in arrays:
        if not isinstance(a, np.ndarray) or a.dtype not in kernels.FLOATS:  # numba takes numpy arrays only
            return False
        if contiguous and not a.flags.c_contiguous:
            return False
        if dt is None:
            dt = a.dtype
        elif a.dtype != dt:
            return False
    return True


def gpu_count() -> int:
    """Number of GPUs CuPy sees (0 without CuPy or without a GPU)."""
    if _cupy is None:
        return 0
    try:
        return int(_cupy.cuda.runtime.getDeviceCount())
    except Exception:  # pragma: no cover - CuPy without a driver
        return 0


def cupy_available() -> bool:
    """True when CuPy imports and sees at least one GPU."""
    return gpu_count() > 0
