"""Input layers without a data source: Input, DummyData, MemoryData (as BVLC Caffe 1.0)."""
from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from ..blob import Blob
from ..errors import CctError
from ..fillers import FILLER_TYPES, fill
from ..proto import caffe_pb2
from .base import Layer, register

log = logging.getLogger("cct")


def _shape_of(layer: Layer, shape: caffe_pb2.BlobShape, what: str) -> tuple[int, ...]:
    dims = tuple(int(d) for d in shape.dim)
    if any(d < 0 for d in dims):
        raise layer.error(f"{what}: negative dimension in shape {list(dims)}")
    return dims


@register("Input")
class InputLayer(Layer):
    """Net inputs: ``input_param.shape`` once per top, once for all tops, or not at all.

    The tops keep whatever shape they are given later (pycaffe's ``blob.reshape``): reshape is
    a no-op, as in Caffe. No backward.
    """

    feeds_from_host = True

    param_fields = ("input_param",)
    exact_num_bottom = 0
    min_num_top = 1

    def layer_setup(self, bottom, top):
        shapes = self.param.input_param.shape
        n_shape, n_top = len(shapes), len(top)
        if n_shape not in (0, 1, n_top):
            raise self.error(f"must specify 'shape' once, once per top blob, or not at all: "
                             f"{n_top} tops vs. {n_shape} shapes")
        if n_shape:
            for i, t in enumerate(top):
                t.reshape(_shape_of(self, shapes[0 if n_shape == 1 else i], "input_param"))

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        pass

    def backward(self, top, propagate_down, bottom):
        pass


@register("DummyData")
class DummyDataLayer(Layer):
    """Tops of fixed shape filled by ``data_filler`` (0 fillers: constant 0; 1: for all; N: one each).

    Constant fillers fill once at setup; other fillers refill every forward pass (Caffe's refill_).
    """

    feeds_from_host = True

    param_fields = ("dummy_data_param",)
    exact_num_bottom = 0
    min_num_top = 1

    def layer_setup(self, bottom, top):
        p = self.param.dummy_data_param
        n_top = len(top)
        n_fill = len(p.data_filler)
        if n_fill not in (0, 1, n_top):
            raise self.error(f"number of data fillers must be 0, 1 or equal to the number of tops: "
                             f"{n_top}; you specified {n_fill} data fillers")
        legacy = bool(len(p.num) or len(p.channels) or len(p.height) or len(p.width))
        shapes: list[tuple[int, ...]] = []
        if legacy:
            if len(p.shape):
                raise self.error("both shape and legacy fields (num/channels/height/width) were specified")
            for field in ("num", "channels", "height", "width"):
                k = len(getattr(p, field))
                if k not in (1, n_top):
                    raise self.error(f"must specify '{field}' once, or once per top blob ({n_top}); "
                                     f"specified {k}")
            for i in range(n_top):
                shapes.append(tuple(int(getattr(p, f)[0 if len(getattr(p, f)) == 1 else i])
                                    for f in ("num", "channels", "height", "width")))
        else:
            if len(p.shape) not in (1, n_top):
                raise self.error(f"must specify 'shape' once, or once per top blob ({n_top}); "
                                 f"specified {len(p.shape)}")
            for i in range(n_top):
                shapes.append(_shape_of(self, p.shape[0 if len(p.shape) == 1 else i], "dummy_data_param"))
        if n_fill == 0:
            fillers = [caffe_pb2.FillerParameter(type="constant", value=0)]
        else:
            fillers = list(p.data_filler)
        for f in fillers:
            if f.type not in FILLER_TYPES:
                raise self.error(f"unknown filler type '{f.type}' (known: {', '.join(FILLER_TYPES)})")
        self.fillers = fillers
        self.refill = [f.type != "constant" for f in fillers]
        for t, shape in zip(top, shapes):
            t.reshape(shape)
        # Fill the constant tops once now; the others are refilled at every forward.
        self._fill(top, constant=True)

    def _fill(self, top: Sequence[Blob], constant: bool) -> None:
        for i, t in enumerate(top):
            k = i if len(self.fillers) > 1 else 0
            if self.refill[k] != constant:
                try:
                    fill(t, self.fillers[k], self.host_random().generator)
                except CctError as e:
                    raise self.error(str(e)) from None

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        self._fill(top, constant=False)

    def backward(self, top, propagate_down, bottom):
        pass


def _transform_is_trivial(tp: caffe_pb2.TransformationParameter) -> bool:
    return (tp.scale == 1 and not tp.mirror and tp.crop_size == 0 and not tp.mean_file
            and len(tp.mean_value) == 0 and not tp.force_color and not tp.force_gray)


@register("MemoryData")
class MemoryDataLayer(Layer):
    """Serves batches from arrays handed over with ``set_input_arrays`` / ``reset`` (pycaffe's API).

    Tops: data (N, C, H, W) and labels, (N,) after setup and (N, 1, 1, 1) after each forward, as
    Caffe reshapes them. Each forward serves the next ``batch_size`` rows and wraps around.
    ``transform_param`` is not applied to arrays (Caffe ignores it on Reset): a non-trivial one is an error.
    """

    feeds_from_host = True

    param_fields = ("memory_data_param", "transform_param")
    exact_num_bottom = 0
    exact_num_top = 2

    def __init__(self, param: caffe_pb2.LayerParameter):
        super().__init__(param)
        if param.HasField("transform_param") and not _transform_is_trivial(param.transform_param):
            raise self.unsupported("transform_param on MemoryData (Caffe does not transform arrays "
                                   "given with Reset/set_input_arrays)")
        p = param.memory_data_param
        self.batch_size = int(p.batch_size)
        self.channels = int(p.channels)
        self.height = int(p.height)
        self.width = int(p.width)
        self.size = self.channels * self.height * self.width
        if self.batch_size * self.size <= 0:
            raise self.error("batch_size, channels, height, and width must be specified and positive "
                             "in memory_data_param")
        self._data: np.ndarray | None = None
        self._labels: np.ndarray | None = None
        self.n = 0
        self.pos = 0
        self.dtype = np.dtype(np.float32)

    def layer_setup(self, bottom, top):
        top[0].reshape((self.batch_size, self.channels, self.height, self.width))
        top[1].reshape((self.batch_size,))
        self.dtype = top[0].dtype

    # -- pycaffe / Caffe API ------------------------------------------------------------
    def set_input_arrays(self, data: np.ndarray, labels: np.ndarray) -> None:
        """pycaffe's ``Net.set_input_arrays``: data (n, C, H, W), labels (n,) or (n, 1, 1, 1), float32.

        n must be a multiple of batch_size. The arrays are referenced, not copied (as in Caffe).
        """
        if not isinstance(data, np.ndarray) or not isinstance(labels, np.ndarray):
            raise self.error("set_input_arrays needs numpy arrays")
        if labels.ndim == 1:
            labels = np.ascontiguousarray(labels[:, None, None, None])
        for arr, name, (c, h, w) in ((data, "data array", (self.channels, self.height, self.width)),
                                     (labels, "labels array", (1, 1, 1))):
            if not arr.flags.c_contiguous:
                raise self.error(f"{name} must be C contiguous")
            if arr.ndim != 4:
                raise self.error(f"{name} must be 4-d, got shape {arr.shape}")
            if arr.dtype != np.float32 and arr.dtype != self.dtype:
                raise self.error(f"{name} must be float32, got {arr.dtype}")
            if arr.shape[1] != c:
                raise self.error(f"{name} has wrong number of channels ({arr.shape[1]}, expected {c})")
            if arr.shape[2] != h:
                raise self.error(f"{name} has wrong height ({arr.shape[2]}, expected {h})")
            if arr.shape[3] != w:
                raise self.error(f"{name} has wrong width ({arr.shape[3]}, expected {w})")
        if data.shape[0] != labels.shape[0]:
            raise self.error(f"data and labels must have the same first dimension "
                             f"({data.shape[0]} vs {labels.shape[0]})")
        if data.shape[0] % self.batch_size != 0:
            raise self.error(f"first dimensions of input arrays must be a multiple of batch size "
                             f"({data.shape[0]} rows, batch_size {self.batch_size})")
        self.reset(data, labels, data.shape[0])

    def reset(self, data: np.ndarray, labels: np.ndarray, n: int) -> None:
        """Caffe's ``MemoryDataLayer::Reset``: serve the first ``n`` rows of data/labels from row 0."""
        if data is None or labels is None:
            raise self.error("reset needs both data and labels")
        n = int(n)
        if n <= 0 or n % self.batch_size != 0:
            raise self.error(f"n must be a multiple of batch size (n = {n}, batch_size {self.batch_size})")
        data = np.asarray(data)
        labels = np.asarray(labels)
        if data.size < n * self.size or labels.size < n:
            raise self.error(f"reset: {n} rows need {n * self.size} data values and {n} labels, "
                             f"got {data.size} and {labels.size}")
        if self.param.HasField("transform_param"):
            log.warning("%s layer '%s' does not transform array data on reset()", self.type, self.name)
        self._data = data
        self._labels = labels
        self.n = n
        self.pos = 0

    def set_batch_size(self, new_size: int) -> None:
        """Caffe's ``set_batch_size`` (the next forward serves batches of the new size)."""
        new_size = int(new_size)
        if new_size <= 0:
            raise self.error(f"batch_size must be positive, got {new_size}")
        if self._data is not None and self.n % new_size != 0:
            raise self.error(f"batch size {new_size} does not divide the {self.n} rows given to reset()")
        self.batch_size = new_size

    # -- the contract --------------------------------------------------------------------
    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        if self._data is None:
            raise self.error("MemoryData needs to be initialized by calling reset() / set_input_arrays()")
        b = self.batch_size
        top[0].reshape((b, self.channels, self.height, self.width))
        top[1].reshape((b, 1, 1, 1))
        rows = self._data.reshape(-1)[self.pos * self.size:(self.pos + b) * self.size]
        labs = self._labels.reshape(-1)[self.pos:self.pos + b]
        xp = top[0].xp
        top[0].data[...] = xp.asarray(rows.reshape(top[0].shape), dtype=top[0].dtype)
        top[1].data[...] = xp.asarray(labs.reshape(top[1].shape), dtype=top[1].dtype)
        self.pos = (self.pos + b) % self.n

    def backward(self, top, propagate_down, bottom):
        pass
