"""Caffe's Python layer: ``type: "Python"`` with ``python_param { module layer param_str }``.

The module is imported from ``sys.path`` only, as Caffe does (``PYTHONPATH`` works; the directory
of the prototxt is not searched), the class ``layer`` is looked up in it and instantiated with the
``LayerParameter``.

Security: a prototxt with a Python layer imports and runs code. ``Config(python_layers=False)``,
``CCT_PYTHON_LAYERS=0`` or ``cct ... --no_python_layers`` refuse such layers before any import
(use it for nets from untrusted sources). The user class subclasses :class:`PythonLayer`
(pycaffe's ``caffe.Layer``) and implements pycaffe's contract::

    setup(bottom, top)          # once; read self.param_str, self.phase; self.blobs.add_blob(*shape)
    reshape(bottom, top)        # every pass, before forward
    forward(bottom, top)        # write top[i].data[...]
    backward(top, propagate_down, bottom)   # write bottom[i].diff[...]

``bottom``/``top`` are lists of pycaffe-like blobs (``.data``, ``.diff``, ``.reshape(*shape)``,
``.shape``, ``.count``, ``.num``, ``.channels``, ``.height``, ``.width``); on the GPU they hand
out host (numpy) copies that are written back after each call.
"""
from __future__ import annotations

import importlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from ..blob import Blob
from ..config import current
from ..device.driver import Device, HostDevice
from ..proto import caffe_pb2
from .base import Layer, register


class PyBlob:
    """A pycaffe-style view of a cct Blob: ``reshape`` takes ``*dims`` or one sequence."""

    __slots__ = ("_blob", "_host")

    def __init__(self, blob: Blob):
        self._blob = blob
        self._host: dict[str, np.ndarray] = {}

    @property
    def blob(self) -> Blob:
        """The underlying cct Blob."""
        return self._blob

    def _array(self, which: str):
        arr = getattr(self._blob, which)
        device = self._blob.device
        if not device.is_gpu:
            return arr
        host = self._host.get(which)
        if host is None:
            host = device.download(arr)
            self._host[which] = host
        return host

    @property
    def data(self):
        """The data array (write in place: ``top[0].data[...] = x``)."""
        return self._array("data")

    @property
    def diff(self):
        """The diff array (write in place: ``bottom[0].diff[...] = g``)."""
        return self._array("diff")

    def flush(self) -> None:
        """Copy host copies (GPU blobs only) back into the blob."""
        for which, host in self._host.items():
            arr = getattr(self._blob, which)
            if arr.shape == host.shape:
                self._blob.device.upload(host, out=arr)
        self._host.clear()

    def reshape(self, *shape: Any) -> None:
        """pycaffe's ``blob.reshape(n, c, h, w)``; a single sequence is accepted too."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list, np.ndarray)):
            shape = tuple(shape[0])
        self.flush()
        self._blob.reshape(tuple(int(d) for d in shape))

    @property
    def shape(self) -> tuple[int, ...]:
        return self._blob.shape

    @property
    def count(self) -> int:
        return self._blob.count

    @property
    def num(self) -> int:
        return self._blob.num

    @property
    def channels(self) -> int:
        return self._blob.channels

    @property
    def height(self) -> int:
        return self._blob.height

    @property
    def width(self) -> int:
        return self._blob.width

    def __repr__(self) -> str:
        return f"<PyBlob {self._blob.name!r} shape={list(self._blob.shape)}>"


class BlobVec:
    """pycaffe's ``layer.blobs``: a list-like over the layer's parameter blobs, with ``add_blob``."""

    def __init__(self, owner: PythonLayerWrapper | None = None):
        self._owner = owner
        self._store: list[Blob] = owner.blobs if owner is not None else []

    def _wrap(self, blob: Blob) -> PyBlob:
        if self._owner is not None:
            return self._owner.pyblob(blob)
        return PyBlob(blob)

    @staticmethod
    def _unwrap(item: Any) -> Blob:
        if isinstance(item, PyBlob):
            return item.blob
        if isinstance(item, Blob):
            return item
        raise TypeError(f"layer blobs must be Blobs, got {type(item).__name__}")

    def add_blob(self, *shape: Any, **kwargs: Any) -> None:
        """Append a new zero-filled blob of ``shape`` (pycaffe's ``BlobVec.add_blob``)."""
        if kwargs:
            raise TypeError("BlobVec.add_blob takes no kwargs")
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        dtype, device = (self._owner.blob_dtype, self._owner.blob_device) if self._owner else (np.float32, None)
        name = self._owner.name if self._owner else ""
        self._store.append(Blob(tuple(int(d) for d in shape), dtype=dtype, device=device, name=name))

    def append(self, item: Any) -> None:
        self._store.append(self._unwrap(item))

    def __len__(self) -> int:
        return len(self._store)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._wrap(b) for b in self._store[i]]
        return self._wrap(self._store[i])

    def __setitem__(self, i: int, item: Any) -> None:
        self._store[i] = self._unwrap(item)

    def __delitem__(self, i) -> None:
        del self._store[i]

    def __iter__(self) -> Iterator[PyBlob]:
        return (self._wrap(b) for b in list(self._store))

    def clear(self) -> None:
        del self._store[:]

    def extend(self, items: Iterable[Any]) -> None:
        for it in items:
            self.append(it)

    def __repr__(self) -> str:
        return f"BlobVec({[b.shape for b in self._store]})"


class PythonLayer:
    """Base class of user Python layers (pycaffe's ``caffe.Layer``).

    Attributes set before ``setup``: ``param_str`` (str), ``phase`` (0 = TRAIN, 1 = TEST),
    ``blobs`` (:class:`BlobVec`), ``layer_param`` (the LayerParameter), ``type`` ("Python").
    """

    type = "Python"

    def __init__(self, param: caffe_pb2.LayerParameter | None = None):
        self.layer_param = param
        self.param_str = param.python_param.param_str if param is not None else ""
        self.phase = int(param.phase) if param is not None else caffe_pb2.TRAIN

    @property
    def blobs(self) -> BlobVec:
        bv = self.__dict__.get("_cct_blobs")
        if bv is None:
            bv = BlobVec()
            self.__dict__["_cct_blobs"] = bv
        return bv

    @blobs.setter
    def blobs(self, items: Iterable[Any]) -> None:
        bv = self.blobs
        if items is bv:
            return
        items = list(items)
        bv.clear()
        bv.extend(items)

    def setup(self, bottom: Sequence[PyBlob], top: Sequence[PyBlob]) -> None:
        """One-time setup. Default: nothing."""

    def reshape(self, bottom: Sequence[PyBlob], top: Sequence[PyBlob]) -> None:
        """Shape the tops. Default: nothing."""

    def forward(self, bottom: Sequence[PyBlob], top: Sequence[PyBlob]) -> None:
        raise NotImplementedError(f"Python layer class {type(self).__name__} does not define forward()")

    def backward(self, top: Sequence[PyBlob], propagate_down: Sequence[bool], bottom: Sequence[PyBlob]) -> None:
        raise NotImplementedError(f"Python layer class {type(self).__name__} does not define backward()")


@register("Python")
class PythonLayerWrapper(Layer):
    """The cct layer behind ``type: "Python"``: imports the user class and forwards the contract to it."""

    capturable = False
    capture_blocker = "runs user Python code on host copies of its blobs"

    param_fields = ("python_param",)

    def __init__(self, param: caffe_pb2.LayerParameter):
        super().__init__(param)
        pp = param.python_param
        if not current().python_layers:
            raise self.error(f"Python layers are disabled (--no_python_layers / CCT_PYTHON_LAYERS=0 / "
                             f"Config(python_layers=False)); this layer would import and run "
                             f"'{pp.module}.{pp.layer}'")
        if not pp.module or not pp.layer:
            raise self.error("python_param needs both 'module' and 'layer'")
        try:
            module = importlib.import_module(pp.module)
        except ImportError as e:
            raise self.error(f"cannot import python_param.module '{pp.module}': {e} (modules are imported "
                             f"from sys.path only, as in Caffe: add the module's directory to PYTHONPATH)") from e
        except Exception as e:
            raise self.error(f"importing python_param.module '{pp.module}' failed: "
                             f"{type(e).__name__}: {e}") from e
        cls = getattr(module, pp.layer, None)
        if cls is None:
            where = getattr(module, "__file__", pp.module)
            raise self.error(f"module '{pp.module}' ({where}) has no attribute '{pp.layer}' "
                             f"(python_param.layer)")
        self.user = cls(param)
        if not isinstance(self.user, PythonLayer):
            missing = [m for m in ("setup", "reshape", "forward") if not callable(getattr(self.user, m, None))]
            if missing:
                raise self.error(f"python_param.layer '{pp.module}.{pp.layer}' must subclass caffe.Layer "
                                 f"(cct.layers.python_layer.PythonLayer); it lacks {', '.join(missing)}")
        self._pyblobs: dict[int, PyBlob] = {}
        self.blob_dtype = np.dtype(np.float32)
        self.blob_device: Device = HostDevice()
        self.share_in_parallel = bool(pp.share_in_parallel)

    # -- adapters ------------------------------------------------------------------------
    def pyblob(self, blob: Blob) -> PyBlob:
        """The (cached) pycaffe-like view of ``blob``."""
        pb = self._pyblobs.get(id(blob))
        if pb is None or pb.blob is not blob:
            pb = PyBlob(blob)
            self._pyblobs[id(blob)] = pb
        return pb

    def _wrap(self, blobs: Sequence[Blob]) -> list[PyBlob]:
        return [self.pyblob(b) for b in blobs]

    def _call(self, method: str, *args) -> None:
        try:
            getattr(self.user, method)(*args)
        finally:
            for pb in self._pyblobs.values():
                pb.flush()

    # -- the contract --------------------------------------------------------------------
    def layer_setup(self, bottom, top):
        like = bottom[0] if bottom else (top[0] if top else None)
        if like is not None:
            self.blob_dtype, self.blob_device = like.dtype, like.device
        u = self.user
        vec = BlobVec(self)
        if isinstance(u, PythonLayer):
            early = u.__dict__.get("_cct_blobs")
            if early is not None and early._owner is None:  # blobs added in the user's __init__
                vec.extend(early._store)
            u.__dict__["_cct_blobs"] = vec
        else:
            u.blobs = vec
        u.param_str = self.param.python_param.param_str
        u.phase = int(self.phase)
        self._call("setup", self._wrap(bottom), self._wrap(top))

    def reshape(self, bottom, top):
        self._call("reshape", self._wrap(bottom), self._wrap(top))

    def forward(self, bottom, top):
        self._call("forward", self._wrap(bottom), self._wrap(top))

    def backward(self, top, propagate_down, bottom):
        self._call("backward", self._wrap(top), [bool(p) for p in propagate_down], self._wrap(bottom))


__all__ = ["BlobVec", "PyBlob", "PythonLayer", "PythonLayerWrapper"]
