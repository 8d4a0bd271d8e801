"""Caffe's layer contract and the registry of layer types.

A layer is constructed from its ``LayerParameter``; the net then calls
``setup(bottom, top)`` once, and ``reshape`` + ``forward`` / ``backward`` per pass:

* ``layer_setup(bottom, top)``: read the layer's parameters, create ``self.blobs``
  (learnable parameters) with fillers, unless they were given in the prototxt.
* ``reshape(bottom, top)``: shape the tops (and internal buffers) from the bottoms.
* ``forward(bottom, top)``: compute ``top[i].data`` (write in place).
* ``backward(top, propagate_down, bottom)``: *overwrite* ``bottom[i].diff`` where
  ``propagate_down[i]`` and *accumulate* (``+=``) into ``self.blobs[j].diff`` where
  ``self.param_propagate_down[j]``.

Layers take their array module from the blobs (``xp = blob.xp``) and their dtype from
the bottom data, so the same code runs on numpy (float32 or float64) and CuPy.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from ..blob import Blob
from ..config import current
from ..device.random import CounterRandom, key_from_host
from ..errors import LayerError
from ..fillers import fill
from ..io.blobproto import blobproto_to_array
from ..io.fork_fields import explain_fork_layer_type
from ..proto import caffe_pb2

if TYPE_CHECKING:
    from ..device.deferred import DeviceChecks
    from ..device.driver import Device
    from ..random_source import RandomSource

log = logging.getLogger("cct")

_REGISTRY: dict[str, type[Layer]] = {}

# LayerParameter fields that belong to the layer contract itself, not to one layer type.
_GENERIC_FIELDS = {
    "name", "type", "bottom", "top", "phase", "loss_weight", "param", "blobs",
    "propagate_down", "include", "exclude",
}


def register(type_name: str):
    """Class decorator: register a Layer subclass under Caffe's type string."""

    def deco(cls):
        if type_name in _REGISTRY and _REGISTRY[type_name] is not cls:
            raise ValueError(f"layer type '{type_name}' registered twice")
        cls.type = type_name
        _REGISTRY[type_name] = cls
        return cls

    return deco


def layer_class(type_name: str) -> type[Layer]:
    """The class registered for ``type_name`` (KeyError if none)."""
    return _REGISTRY[type_name]


def layer_type_list() -> list[str]:
    """Sorted list of every registered layer type (pycaffe's ``layer_type_list``)."""
    return sorted(_REGISTRY)


def create_layer(param: caffe_pb2.LayerParameter) -> Layer:
    """Instantiate the layer for ``param.type``; unknown types name the layer and list the known ones."""
    cls = _REGISTRY.get(param.type)
    if cls is None:
        fork = explain_fork_layer_type(param.type)
        raise LayerError(
            param.name, param.type or "<empty>",
            f"unknown layer type '{param.type}'" + (f" ({fork})" if fork else "")
            + f". Registered types: {', '.join(layer_type_list())}",
        )
    return cls(param)


class Layer:
    """Base class of every cct layer (see module docstring for the contract)."""

    type: ClassVar[str] = ""
    # LayerParameter.*_param fields this layer reads; any other set field is reported.
    param_fields: ClassVar[tuple[str, ...]] = ()
    # Blob-count constraints (Caffe's ExactNumBottomBlobs and friends); -1 = none.
    exact_num_bottom: ClassVar[int] = -1
    min_num_bottom: ClassVar[int] = -1
    max_num_bottom: ClassVar[int] = -1
    exact_num_top: ClassVar[int] = -1
    min_num_top: ClassVar[int] = -1
    max_num_top: ClassVar[int] = -1
    equal_num_bottom_top: ClassVar[bool] = False
    # Loss layers give top[0] an implicit loss weight of 1.
    is_loss: ClassVar[bool] = False
    # Data layers: fill their tops from the host each forward; a CUDA graph of the step starts after them.
    feeds_from_host: ClassVar[bool] = False
    # False for layers that cannot run inside a CUDA graph (host code between kernels); ``capture_blocker`` says why.
    capturable: ClassVar[bool] = True
    capture_blocker: ClassVar[str] = ""
    # The net's checks on device data (label ranges): set by the Net before setup; None (a layer run
    # on its own) checks immediately, as a numpy net does.
    checks: DeviceChecks | None = None
    # The net's host random source (fillers, shuffles, crops): set by the Net before setup; None (a layer
    # set up on its own) draws from the current configuration's (see host_random).
    random_source: RandomSource | None = None

    def __init__(self, param: caffe_pb2.LayerParameter):
        self.param = param
        self.name = param.name
        self.phase = param.phase
        self.blobs: list[Blob] = []
        self.param_propagate_down: list[bool] = []
        # the layer's random stream when it draws (see draws_random): its net hands it one before setup
        self.random: CounterRandom | None = None
        self._check_param_fields()
        for blob_proto in param.blobs:
            self.blobs.append(blob_from_proto_shape(blob_proto, name=f"{self.name}"))

    # -- helpers ---------------------------------------------------------------
    def error(self, message: str) -> LayerError:
        """A LayerError naming this layer (``raise self.error(...)``)."""
        return LayerError(self.name, self.type, message)

    def unsupported(self, what: str) -> LayerError:
        return self.error(f"unsupported option: {what}")

    def _check_param_fields(self) -> None:
        allowed = set(self.param_fields) | _GENERIC_FIELDS
        for field, _ in self.param.ListFields():
            if field.name not in allowed:
                log.warning("layer '%s' (type %s) ignores %s: that parameter belongs to another layer type",
                            self.name, self.type, field.name)

    def check_blob_counts(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        nb, nt = len(bottom), len(top)

        def bad(kind, rel, n, actual):
            return self.error(f"takes {rel} {n} {kind} blob(s), got {actual}")

        if self.exact_num_bottom >= 0 and nb != self.exact_num_bottom:
            raise bad("bottom", "exactly", self.exact_num_bottom, nb)
        if self.min_num_bottom >= 0 and nb < self.min_num_bottom:
            raise bad("bottom", "at least", self.min_num_bottom, nb)
        if self.max_num_bottom >= 0 and nb > self.max_num_bottom:
            raise bad("bottom", "at most", self.max_num_bottom, nb)
        if self.exact_num_top >= 0 and nt != self.exact_num_top:
            raise bad("top", "exactly", self.exact_num_top, nt)
        if self.min_num_top >= 0 and nt < self.min_num_top:
            raise bad("top", "at least", self.min_num_top, nt)
        if self.max_num_top >= 0 and nt > self.max_num_top:
            raise bad("top", "at most", self.max_num_top, nt)
        if self.equal_num_bottom_top and nb != nt:
            raise self.error(f"needs as many tops as bottoms, got {nb} bottom(s) and {nt} top(s)")

    def make_param(self, shape: Sequence[int], filler: caffe_pb2.FillerParameter | None,
                   like: Blob | None = None) -> Blob:
        """A new learnable blob of ``shape`` filled by ``filler`` (dtype and device of ``like``)."""
        dtype = like.dtype if like is not None else np.float32
        # a new blob is zeros already: Caffe's default constant-0 filler is a no-op
        blob = Blob(shape, dtype=dtype, device=like.device if like is not None else None, name=self.name)
        if filler is not None and not (filler.type == "constant" and filler.value == 0):
            fill(blob, filler, self.host_random().generator)
        return blob

    def params_given(self, expected: int) -> bool:
        """True if the prototxt/caffemodel already supplied ``expected`` param blobs."""
        if self.blobs:
            if len(self.blobs) != expected:
                raise self.error(f"expected {expected} parameter blob(s), {len(self.blobs)} were given")
            return True
        return False

    def draws_random(self) -> bool:
        """Whether forward draws random numbers (Dropout, stochastic pooling in TRAIN); the net then hands
        the layer its own stream as ``self.random`` before setup."""
        return False

    def host_random(self) -> RandomSource:
        """The host random source this layer draws from: its net's, else (a layer set up on its own) the
        current configuration's (:func:`cct.config.current`)."""
        return self.random_source if self.random_source is not None else current().random

    def random_stream(self, device: Device) -> CounterRandom:
        """The layer's random stream: the one its net handed it, else (a layer set up on its own) a new
        one (stream 0) of ``device`` (its bottom's) keyed from the layer's host random source."""
        if self.random is None:
            self.random = device.random_stream(key_from_host(self.host_random().generator), 0)
        return self.random

    # -- the contract ------------------------------------------------------------
    def setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        """Check blob counts, run ``layer_setup``, then ``reshape`` (Caffe's Layer::SetUp)."""
        self.check_blob_counts(bottom, top)
        self.layer_setup(bottom, top)
        if len(self.param_propagate_down) < len(self.blobs):
            self.param_propagate_down += [True] * (len(self.blobs) - len(self.param_propagate_down))
        self.reshape(bottom, top)

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        """One-time setup (parameters, fillers). Default: nothing."""

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        raise NotImplementedError

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        raise NotImplementedError

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        """Default: the layer cannot backpropagate (fine while no bottom needs it)."""
        if any(propagate_down):
            raise self.error("has no backward pass")

    def allow_force_backward(self, bottom_index: int) -> bool:
        """Whether force_backward may ask for the gradient of this bottom (False for labels, indices)."""
        return True

    def loss_weight(self, top_index: int) -> float:
        """Loss weight of a top: the prototxt's ``loss_weight`` or the layer's implicit one."""
        if self.param.loss_weight:
            if top_index < len(self.param.loss_weight):
                return float(self.param.loss_weight[top_index])
            return 0.0
        return 1.0 if (self.is_loss and top_index == 0) else 0.0

    def __repr__(self) -> str:
        return f"<{self.type} layer '{self.name}'>"


def blob_from_proto_shape(proto: caffe_pb2.BlobProto, name: str = "") -> Blob:
    """A Blob with the shape and values of a BlobProto (data only)."""
    arr = blobproto_to_array(proto)
    blob = Blob(arr.shape, name=name)
    blob.data[...] = arr
    return blob
