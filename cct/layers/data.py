"""Data layers: ``Data`` (LMDB/LevelDB of Datum), ``ImageData`` (image list file), ``HDF5Data``.

Each layer reads ahead in a background thread (:class:`cct.data.prefetch.Prefetcher`, queue
depth ``data_param.prefetch``, default 4) so loading and transforming overlap compute;
``forward`` copies the next ready batch into the tops. Like Caffe's data layers they have no
bottoms, no backward, and never take a gradient.

Randomness (crops, mirrors, shuffles, ``rand_skip``) comes from two generators private to the
layer (one for the transforms, one for the record order, like Caffe's transformer and prefetch
RNGs), seeded by one draw of :func:`cct.rng.get_rng` at setup (only when the layer needs any), so
a run with a fixed ``random_seed`` is reproducible whatever the thread timing. As in Caffe,
``mirror: true`` flips at random in the TEST phase too; only the crop is centred in TEST.

Decoding of encoded records (JPEG/PNG) and image files runs on a small shared thread pool
(deterministic work, order kept); the transforms stay in record order on the prefetch thread.

Order of records (Caffe's): ``Data`` walks the database in key order and restarts from the
first key at the end ("Restarting data prefetching from start."); ``ImageData`` walks the list
(reshuffled at each pass with ``shuffle``); ``HDF5Data`` walks the rows of each listed file in
order and wraps around row by row, even inside a batch.

Sharding (distributed training, :meth:`PrefetchingDataLayer.set_shard`): every loader counts the
records it passes (``offset``, a counter of the layer's whole record stream that never wraps); a
layer sharded as rank r of N keeps only the records whose offset is r modulo N and steps over the
others, as Caffe's ``Skip()``. N ranks at batch b thus read, between them, exactly the records one
process reads at batch N*b, each once.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..backend import in_device_memory
from ..blob import Blob
from ..data.db import open_db, parse_datum
from ..data.prefetch import Prefetcher
from ..data.transformer import DataTransformer, read_image, read_numbered_image_list
from ..errors import CctError
from ..proto import caffe_pb2
from ..rng import get_rng
from .base import Layer, register

log = logging.getLogger("cct")

_LEGACY_TRANSFORM_FIELDS = ("scale", "mean_file", "crop_size", "mirror")
_RESTART_MSG = "Restarting data prefetching from start."


def _copy_to_blob(blob: Blob, arr: np.ndarray) -> None:
    """Reshape ``blob`` to ``arr.shape`` and copy ``arr`` into its data (numpy or cupy)."""
    blob.reshape(arr.shape)
    if in_device_memory(blob.data):  # host -> device copy
        blob.data.set(np.ascontiguousarray(arr, dtype=blob.dtype))
    else:
        np.copyto(blob.data, arr, casting="unsafe")


def child_rngs(needed: bool) -> tuple[np.random.Generator | None, np.random.Generator | None]:
    """(transform generator, order generator) for a layer, seeded by one draw of cct's global rng.

    Two streams, as Caffe's transformer RNG and prefetch (shuffle) RNG: the record order does not
    depend on how many draws the transforms make. No draw at all when the layer needs none.
    """
    if not needed:
        return None, None
    ss = np.random.SeedSequence(int(get_rng().integers(0, 2**63 - 1)))
    a, b = ss.spawn(2)
    return np.random.default_rng(a), np.random.default_rng(b)


def rng_state(rng: np.random.Generator | None) -> dict | None:
    """The state of a layer's generator (None for none), for a data read state."""
    return None if rng is None else rng.bit_generator.state


def set_rng_state(rng: np.random.Generator | None, state: dict | None) -> None:
    """Restore a state from :func:`rng_state` (nothing when either is None)."""
    if rng is not None and state is not None:
        rng.bit_generator.state = state


def keeps(shard: tuple[int, int, int], offset: int) -> bool:
    """Whether a loader sharded as ``(start, count, period)`` keeps the record at stream ``offset``."""
    start, count, period = shard
    return start <= offset % period < start + count


def _rank_rng(rng: np.random.Generator | None, rank: int) -> None:
    """Give rank ``rank`` > 0 a transform stream of its own, derived from the shared one (rank 0 keeps
    the shared stream, so one rank reproduces a single process)."""
    if rng is not None and rank > 0:
        seed = int(rng.bit_generator.random_raw())
        rng.bit_generator.state = np.random.default_rng([seed, rank]).bit_generator.state


def _resolve_listed(path: str, list_file: str) -> str:
    """A path from a list file: as given (relative to the cwd, as Caffe), else relative to the list file."""
    if os.path.isabs(path) or os.path.exists(path):
        return path
    alt = os.path.join(os.path.dirname(os.path.abspath(list_file)), path)
    return alt if os.path.exists(alt) else path


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def map_ordered(fn, items: list, parallel: bool = True) -> list:
    """``[fn(x) for x in items]``, on a shared thread pool for image decoding (order and errors kept)."""
    global _POOL
    workers = min(8, os.cpu_count() or 1)
    if not parallel or len(items) < 2 or workers < 2:
        return [fn(x) for x in items]
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cct-decode")
    return list(_POOL.map(fn, items))


def _shutdown(prefetcher: Prefetcher, loader: Any) -> None:
    prefetcher.close()
    if not prefetcher.thread_alive and hasattr(loader, "close"):
        loader.close()


class PrefetchingDataLayer(Layer):
    """Shared machinery: prefetch thread, top copy, no backward."""

    exact_num_bottom = 0
    feeds_from_host = True

    _prefetcher: Prefetcher | None = None
    #: wall-clock seconds spent in forward (waiting for the prefetch thread + copying), for phase timers
    forward_seconds: float = 0.0

    def _transform_param(self, legacy: Any, section: str) -> caffe_pb2.TransformationParameter:
        """``transform_param`` with any legacy fields of ``section`` (data_param...) moved into it."""
        tp = caffe_pb2.TransformationParameter()
        tp.CopyFrom(self.param.transform_param)
        for f in _LEGACY_TRANSFORM_FIELDS:
            if legacy.HasField(f):
                if tp.HasField(f):
                    raise self.error(f"{section}.{f} (legacy) and transform_param.{f} are both set")
                setattr(tp, f, getattr(legacy, f))
                log.warning("layer '%s': legacy %s.%s moved to transform_param", self.name, section, f)
        return tp

    def _start(self, loader: Any, depth: int) -> None:
        self._loader = loader
        self._depth = max(1, int(depth))
        # The read state of the batch the next forward hands out (for exact resume from a snapshot).
        self._read_state = loader.state()
        self._launch()

    def _launch(self) -> None:
        loader = self._loader

        def produce(buf):
            arrays = loader.load(buf)
            return arrays, loader.state()

        self._prefetcher = Prefetcher(produce, depth=self._depth, name=f"cct-data-{self.name}")
        self._finalizer = weakref.finalize(self, _shutdown, self._prefetcher, loader)

    def get_read_state(self) -> dict:
        """Where the next forward reads from (record position, stream offset, random generator states)."""
        return self._read_state

    @property
    def shard(self) -> tuple[int, int, int]:
        """``(start, count, period)``: this layer keeps the records whose stream offset modulo
        ``period`` lies in ``[start, start + count)`` (``(rank, 1, N)``: Caffe's ``Skip()``)."""
        return getattr(self._loader, "shard", (0, 1, 1))

    def set_shard(self, rank: int, size: int, state: dict | None = None,
                  block: tuple[int, int] | None = None) -> None:
        """Read only records ``rank, rank + size, rank + 2*size, ...`` of the stream (Caffe's ``Skip()``
        with ``size`` solvers). ``state`` (a read state, e.g. rank 0's, the same on every rank) is
        where to continue from (default: this layer's own); ranks > 0 then draw their transforms
        (crop, mirror) from a stream of their own. Drops prefetched batches.

        ``block=(start, count)``: unequal shares instead: of every ``size`` consecutive records keep
        ``count`` from ``start`` on, and read batches of ``count`` (a rank's share of a global batch
        of ``size``)."""
        if self._prefetcher is None:
            raise self.error("set_shard before setup")
        if block is None and not (0 <= int(rank) < int(size)):
            raise self.error(f"shard rank {rank} is not in 0..{int(size) - 1}")
        if block is not None and not (0 <= block[0] and 1 <= block[1] and block[0] + block[1] <= size):
            raise self.error(f"shard block {block} does not fit in {size} records")
        self._prefetcher.close()
        self._finalizer.detach()
        try:
            self._loader.set_state(self._read_state if state is None else state)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise self.error(f"cannot restore the data read state: {e}") from None
        if hasattr(self._loader, "shard"):
            if block is None:
                self._loader.shard = (int(rank), 1, int(size))
            else:
                self._loader.shard = (int(block[0]), int(block[1]), int(size))
                self._loader.batch_size = int(block[1])
        else:  # a layer that samples at random (WindowData): each rank draws samples of its own
            _rank_rng(getattr(self._loader, "rng", None), int(rank))
        _rank_rng(getattr(getattr(self._loader, "transformer", None), "rng", None), int(rank))
        self._read_state = self._loader.state()
        self._launch()

    def set_read_state(self, state: dict) -> None:
        """Continue reading from a state returned by ``get_read_state`` (drops prefetched batches)."""
        if self._prefetcher is None:
            raise self.error("set_read_state before setup")
        self._prefetcher.close()
        self._finalizer.detach()
        try:
            self._loader.set_state(state)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise self.error(f"cannot restore the data read state: {e}") from None
        self._read_state = self._loader.state()
        self._launch()

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        """Tops are shaped at setup and by each forward (to the batch loaded)."""

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        """Copy the next prefetched batch into the tops."""
        if self._prefetcher is None:
            raise self.error("forward before setup")
        start = time.perf_counter()
        try:
            self._forward_batch(top)
        finally:
            self.forward_seconds += time.perf_counter() - start

    def _forward_batch(self, top: Sequence[Blob]) -> None:
        try:
            batch, self._read_state = self._prefetcher.get()
        except CctError as e:
            msg = str(e)
            if msg.startswith(f"layer '{self.name}'"):
                raise
            raise self.error(msg) from None
        for blob, arr in zip(top, batch):
            _copy_to_blob(blob, arr)
        self._prefetcher.recycle(batch)

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        """Data layers have no backward."""

    def allow_force_backward(self, bottom_index: int) -> bool:
        return False

    def close(self) -> None:
        """Stop the prefetch thread and release the source (also done when the layer is garbage collected)."""
        if self._prefetcher is not None:
            self._finalizer()


# --------------------------------------------------------------------------------------------
# Data: LMDB / LevelDB of Datum records
# --------------------------------------------------------------------------------------------
class _DBLoader:
    """Walks a database cursor in key order, wrapping at the end; builds transformed batches."""

    def __init__(self, db, transformer: DataTransformer, batch_size: int, dtypes: list, skip: int):
        self.db = db
        self.path = db.path
        self.cursor = db.cursor()
        self.transformer = transformer
        self.batch_size = batch_size
        self.dtypes = dtypes
        self.pos = 0  # records read since the first key, modulo the database size
        self.offset = 0
        for _ in range(skip % max(1, len(db))):  # wrapping past the end = starting over
            self.next()
        self.offset = 0  # records passed since setup (never wraps): the sharding counter
        self.shard = (0, 1, 1)

    def state(self) -> dict:
        return {"pos": self.pos, "offset": self.offset, "transform_rng": rng_state(self.transformer.rng)}

    def set_state(self, state: dict) -> None:
        self.cursor.seek_to_first()
        self.pos = 0
        for _ in range(int(state["pos"]) % max(1, len(self.db))):
            self.next()
        self.offset = int(state.get("offset", 0))
        set_rng_state(self.transformer.rng, state["transform_rng"])

    def close(self) -> None:
        self.cursor.close()
        self.db.close()

    def next(self) -> None:
        self.cursor.next()
        self.pos += 1
        self.offset += 1
        if not self.cursor.valid:
            log.info(_RESTART_MSG)
            self.cursor.seek_to_first()
            self.pos = 0

    def _array(self, key: bytes, datum: caffe_pb2.Datum) -> np.ndarray:
        try:
            return self.transformer.datum_array(datum)
        except CctError as e:
            raise CctError(f"record '{key.decode('utf-8', 'replace')}' in '{self.path}': {e}") from None

    def current(self) -> tuple[bytes, np.ndarray, int]:
        """The record under the cursor: (key, CxHxW pixels, label)."""
        key = self.cursor.key
        datum = parse_datum(self.cursor.value, key, self.path)
        return key, self._array(key, datum), datum.label

    def load(self, buf: list[np.ndarray] | None) -> list[np.ndarray]:
        bs = self.batch_size
        records = []
        for _ in range(bs):  # read the batch's records in key order
            while not keeps(self.shard, self.offset):  # another rank's record (Caffe's Skip)
                self.next()
            key = self.cursor.key
            records.append((key, parse_datum(self.cursor.value, key, self.path)))
            self.next()
        # decoding (JPEG/PNG) is deterministic and releases the GIL: spread it over threads
        arrays = map_ordered(lambda kd: self._array(*kd), records, parallel=records[0][1].encoded)
        try:
            shape = (bs,) + self.transformer.infer_shape(arrays[0])
            data = buf[0] if buf is not None and buf[0].shape == shape else np.empty(shape, self.dtypes[0])
            batched = self.transformer.transform_batch(arrays, data)  # deterministic: one sweep per batch
        except CctError as e:
            raise CctError(f"record '{records[0][0].decode('utf-8', 'replace')}' in '{self.path}': {e}") from None
        if batched:
            if len(self.dtypes) == 1:
                return [data]
            labels = buf[1] if buf is not None else np.empty((bs,), self.dtypes[1])
            labels[...] = [datum.label for _, datum in records]
            return [data, labels]
        data = labels = None
        for i, ((key, datum), arr) in enumerate(zip(records, arrays)):
            try:
                if i == 0:  # the first record of each batch sets its shape (Caffe)
                    shape = (bs,) + self.transformer.infer_shape(arr)
                    data = buf[0] if buf is not None and buf[0].shape == shape else np.empty(shape, self.dtypes[0])
                    if len(self.dtypes) > 1:
                        labels = buf[1] if buf is not None else np.empty((bs,), self.dtypes[1])
                self.transformer.transform(arr, data[i])  # random draws stay in record order
            except CctError as e:
                raise CctError(f"record '{key.decode('utf-8', 'replace')}' in '{self.path}': {e}") from None
            if labels is not None:
                labels[i] = datum.label
        return [data] if labels is None else [data, labels]


@register("Data")
class Data(PrefetchingDataLayer):
    """Caffe's Data layer: batches of Datum records from an LMDB or LevelDB (tops: data, [label])."""

    param_fields = ("data_param", "transform_param")
    min_num_top = 1
    max_num_top = 2

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        dp = self.param.data_param
        if not dp.source:
            raise self.error("data_param.source is not set")
        if dp.batch_size <= 0:
            raise self.error("data_param.batch_size must be positive")
        tp = self._transform_param(dp, "data_param")
        if dp.HasField("force_encoded_color") and dp.force_encoded_color:
            tp.force_color = True
        if tp.force_color and tp.force_gray:
            raise self.error("cannot set both force_color and force_gray")
        needs_rng = bool(dp.rand_skip) or tp.mirror or (self.phase == caffe_pb2.TRAIN and tp.crop_size > 0)
        t_rng, rng = child_rngs(needs_rng)
        try:
            transformer = DataTransformer(tp, self.phase, rng=t_rng)
            db = open_db(dp.source, dp.backend)
        except CctError as e:
            raise self.error(str(e)) from None
        skip = 0
        if dp.rand_skip:
            skip = int(rng.integers(dp.rand_skip))
            log.info("Skipping first %d data points.", skip)
        dtypes = [top[0].dtype] + ([top[1].dtype] if len(top) > 1 else [])
        loader = _DBLoader(db, transformer, int(dp.batch_size), dtypes, skip)
        try:
            _, first, _ = loader.current()
            shape = (int(dp.batch_size),) + transformer.infer_shape(first)
        except CctError as e:
            loader.close()
            raise self.error(str(e)) from None
        top[0].reshape(shape)
        log.info("output data size: %s", ",".join(str(d) for d in shape))
        if len(top) > 1:
            top[1].reshape((int(dp.batch_size),))
        self._start(loader, dp.prefetch)


# --------------------------------------------------------------------------------------------
# ImageData: a list file of "path label" lines
# --------------------------------------------------------------------------------------------
class _ImageListLoader:
    def __init__(self, lines, root: str, new_h: int, new_w: int, is_color: bool,
                 transformer: DataTransformer, batch_size: int, dtypes: list, shuffle: bool,
                 rng: np.random.Generator | None, start: int, source: str = "", line_of: dict | None = None):
        self.lines = lines
        self.source = source
        self.line_of = line_of or {}  # path -> its (first) line in the list file, for error messages
        self.root = root
        self.new_h, self.new_w, self.is_color = new_h, new_w, is_color
        self.transformer = transformer
        self.batch_size = batch_size
        self.dtypes = dtypes
        self.shuffle = shuffle
        self.rng = rng
        self.pos = start
        self._order = tuple(lines)  # the list order as of the last shuffle (states refer to it)
        self.offset = 0  # images passed since setup (never wraps): the sharding counter
        self.shard = (0, 1, 1)

    def state(self) -> dict:
        return {"pos": self.pos, "offset": self.offset, "lines": self._order if self.shuffle else None,
                "rng": rng_state(self.rng), "transform_rng": rng_state(self.transformer.rng)}

    def set_state(self, state: dict) -> None:
        if state["lines"] is not None:
            self.lines = [tuple(x) for x in state["lines"]]
            self._order = tuple(self.lines)
        self.pos = int(state["pos"])
        self.offset = int(state.get("offset", 0))
        set_rng_state(self.rng, state["rng"])
        set_rng_state(self.transformer.rng, state["transform_rng"])

    def _next(self) -> None:
        self.pos += 1
        self.offset += 1
        if self.pos >= len(self.lines):
            log.info(_RESTART_MSG)
            self.pos = 0
            if self.shuffle:
                self.rng.shuffle(self.lines)
                self._order = tuple(self.lines)

    def where(self, name: str) -> str:
        """``list:line: image 'path'`` for an error about the image listed as ``name``."""
        line = self.line_of.get(name)
        return f"{self.source}:{line}: image '{self.root + name}'" if line else f"image '{self.root + name}'"

    def read(self, name: str) -> np.ndarray:
        try:
            return read_image(self.root + name, self.new_h, self.new_w, self.is_color)
        except CctError as e:  # the message names the image file; add the list line
            line = self.line_of.get(name)
            raise (CctError(f"{self.source}:{line}: {e}") if line else e) from None

    def image(self, i: int) -> np.ndarray:
        return self.read(self.lines[i][0])

    def load(self, buf: list[np.ndarray] | None) -> list[np.ndarray]:
        bs = self.batch_size
        picked = []
        for _ in range(bs):
            while not keeps(self.shard, self.offset):  # another rank's image (Caffe's Skip)
                self._next()
            picked.append(self.lines[self.pos])
            self._next()
        images = map_ordered(lambda item: self.read(item[0]), picked)
        data = labels = None
        for i, ((name, label), img) in enumerate(zip(picked, images)):
            chw = img.transpose(2, 0, 1)
            try:
                if i == 0:
                    shape = (bs,) + self.transformer.infer_shape(chw)
                    data = buf[0] if buf is not None and buf[0].shape == shape else np.empty(shape, self.dtypes[0])
                    labels = buf[1] if buf is not None else np.empty((bs,), self.dtypes[1])
                self.transformer.transform(chw, data[i])
            except CctError as e:
                raise CctError(f"{self.where(name)}: {e}") from None
            labels[i] = label
        return [data, labels]


@register("ImageData")
class ImageData(PrefetchingDataLayer):
    """Caffe's ImageData layer: images listed in a text file, with labels (tops: data, label)."""

    param_fields = ("image_data_param", "transform_param", "data_param")
    exact_num_top = 2

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        ip = self.param.image_data_param
        new_h, new_w = int(ip.new_height), int(ip.new_width)
        if (new_h > 0) != (new_w > 0):
            raise self.error("new_height and new_width must be set together")
        if ip.batch_size <= 0:
            raise self.error("image_data_param.batch_size must be positive")
        depth = 4
        if self.param.HasField("data_param"):
            extra = [f.name for f, _ in self.param.data_param.ListFields() if f.name != "prefetch"]
            if extra:
                raise self.unsupported(f"data_param.{extra[0]} in an ImageData layer")
            depth = self.param.data_param.prefetch
        if not ip.source:
            raise self.error("image_data_param.source is not set")
        tp = self._transform_param(ip, "image_data_param")
        needs_rng = ip.shuffle or bool(ip.rand_skip) or tp.mirror or \
            (self.phase == caffe_pb2.TRAIN and tp.crop_size > 0)
        t_rng, rng = child_rngs(needs_rng)
        try:
            transformer = DataTransformer(tp, self.phase, rng=t_rng)
            log.info("Opening file %s", ip.source)
            numbered = read_numbered_image_list(ip.source)
        except CctError as e:
            raise self.error(str(e)) from None
        lines = [(path, label) for path, label, _ in numbered]
        line_of = {path: line for path, _, line in reversed(numbered)}
        if ip.shuffle:
            log.info("Shuffling data")
            rng.shuffle(lines)
        log.info("A total of %d images.", len(lines))
        start = 0
        if ip.rand_skip:
            start = int(rng.integers(ip.rand_skip))
            log.info("Skipping first %d data points.", start)
            if start >= len(lines):
                raise self.error(f"not enough points to skip: rand_skip drew {start} but the list has "
                                 f"{len(lines)} images")
        dtypes = [top[0].dtype, top[1].dtype]
        loader = _ImageListLoader(lines, ip.root_folder, new_h, new_w, ip.is_color, transformer,
                                  int(ip.batch_size), dtypes, ip.shuffle, rng, start, ip.source, line_of)
        try:
            first = loader.image(start)
            shape = (int(ip.batch_size),) + transformer.infer_shape(first.transpose(2, 0, 1))
        except CctError as e:
            raise self.error(str(e)) from None
        top[0].reshape(shape)
        top[1].reshape((int(ip.batch_size),))
        self._start(loader, depth)


# --------------------------------------------------------------------------------------------
# HDF5Data: datasets named after the tops, in the .h5 files listed in a text file
# --------------------------------------------------------------------------------------------
def read_hdf5_list(source: str) -> list[str]:
    """The .h5 file names listed (whitespace separated) in ``source``."""
    try:
        # Bytes as Caffe reads them: a non-UTF-8 path still names its file (surrogateescape, like os.fsdecode).
        with open(source, encoding="utf-8", errors="surrogateescape") as f:
            names = f.read().split()
    except OSError as e:
        raise CctError(f"failed to open HDF5 list file '{source}': {e.strerror}") from None
    if not names:
        raise CctError(f"must have at least 1 HDF5 filename listed in '{source}'")
    return [_resolve_listed(n, source) for n in names]


def load_hdf5_file(path: str, names: Sequence[str], dtypes: Sequence) -> list[np.ndarray]:
    """Read the datasets ``names`` of one HDF5 file (same number of rows) as arrays of ``dtypes``."""
    import h5py

    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise CctError(f"cannot open HDF5 file '{path}': {e}") from None
    with f:
        out = []
        for name, dt in zip(names, dtypes):
            if name not in f:
                raise CctError(f"HDF5 file '{path}' has no dataset '{name}' (datasets are named after the tops)")
            ds = f[name]
            if not isinstance(ds, h5py.Dataset) or ds.ndim < 1:
                raise CctError(f"HDF5 dataset '{name}' in '{path}' must be an array with at least 1 axis")
            if ds.dtype.kind not in "fiub":
                raise CctError(f"HDF5 dataset '{name}' in '{path}' is not numeric ({ds.dtype})")
            out.append(np.asarray(ds[...], dtype=dt))
    n = out[0].shape[0]
    for name, arr in zip(names, out):
        if arr.shape[0] != n:
            raise CctError(f"HDF5 file '{path}': dataset '{name}' has {arr.shape[0]} rows, "
                           f"'{names[0]}' has {n}")
    if n == 0:
        raise CctError(f"HDF5 file '{path}' has no rows")
    return out


class _HDF5Loader:
    def __init__(self, files: list[str], names: list[str], dtypes: list, batch_size: int,
                 shuffle: bool, rng: np.random.Generator | None):
        self.files = files
        self.names = names
        self.dtypes = dtypes
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.rng = rng
        self.file_perm = np.arange(len(files))
        if shuffle:
            self.file_perm = rng.permutation(self.file_perm)
        self.cur_file = 0
        self.arrays: list[np.ndarray] = []
        self.trailing: list[tuple[int, ...]] | None = None
        self._load(self.files[self.file_perm[0]])
        self.offset = 0  # rows passed since setup (never wraps): the sharding counter
        self.shard = (0, 1, 1)

    def state(self) -> dict:
        # file_perm and row_perm are replaced, never mutated, so a state can refer to them.
        return {"cur_file": self.cur_file, "file_perm": self.file_perm, "cur_row": self.cur_row,
                "row_perm": self.row_perm, "offset": self.offset, "rng": rng_state(self.rng)}

    def set_state(self, state: dict) -> None:
        self.file_perm = np.asarray(state["file_perm"], dtype=np.int64)
        self.cur_file = int(state["cur_file"])
        self._load(self.files[self.file_perm[self.cur_file]], permute=False)
        self.row_perm = None if state["row_perm"] is None else np.asarray(state["row_perm"], dtype=np.int64)
        self.cur_row = int(state["cur_row"])
        self.offset = int(state.get("offset", 0))
        set_rng_state(self.rng, state["rng"])

    def _load(self, path: str, permute: bool = True) -> None:
        arrays = load_hdf5_file(path, self.names, self.dtypes)
        trailing = [a.shape[1:] for a in arrays]
        if self.trailing is None:
            self.trailing = trailing
        elif trailing != self.trailing:
            raise CctError(f"HDF5 file '{path}': dataset shapes {trailing} differ from the first file's "
                           f"{self.trailing}")
        self.arrays = arrays
        self.rows = arrays[0].shape[0]
        self.row_perm = self.rng.permutation(self.rows) if (self.shuffle and permute) else None
        self.cur_row = 0

    def _end_of_file(self) -> None:
        if len(self.files) > 1:
            self.cur_file += 1
            if self.cur_file == len(self.files):
                self.cur_file = 0
                if self.shuffle:
                    self.file_perm = self.rng.permutation(self.file_perm)
            self._load(self.files[self.file_perm[self.cur_file]])
        self.cur_row = 0
        if self.shuffle:
            self.row_perm = self.rng.permutation(self.rows)

    def _next_row(self) -> None:
        self.cur_row += 1
        self.offset += 1
        if self.cur_row == self.rows:
            self._end_of_file()

    def load(self, buf: list[np.ndarray] | None) -> list[np.ndarray]:
        bs = self.batch_size
        outs = buf if buf is not None else [np.empty((bs,) + t, dt) for t, dt in zip(self.trailing, self.dtypes)]
        if self.shard[2] > 1:  # row by row, stepping over the other ranks' rows (Caffe's Skip)
            for pos in range(bs):
                while not keeps(self.shard, self.offset):
                    self._next_row()
                row = self.cur_row if self.row_perm is None else self.row_perm[self.cur_row]
                for out, arr in zip(outs, self.arrays):
                    out[pos] = arr[row]
                self._next_row()
            return outs
        pos = 0
        while pos < bs:
            n = min(bs - pos, self.rows - self.cur_row)
            if self.row_perm is None:
                idx: Any = slice(self.cur_row, self.cur_row + n)
            else:
                idx = self.row_perm[self.cur_row:self.cur_row + n]
            for out, arr in zip(outs, self.arrays):
                out[pos:pos + n] = arr[idx]
            pos += n
            self.cur_row += n
            self.offset += n
            if self.cur_row == self.rows:
                self._end_of_file()
        return outs


@register("HDF5Data")
class HDF5Data(PrefetchingDataLayer):
    """Caffe's HDF5Data layer: one top per dataset (named like the top) of the listed HDF5 files."""

    param_fields = ("hdf5_data_param", "transform_param")
    min_num_top = 1

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        hp = self.param.hdf5_data_param
        if self.param.HasField("transform_param"):
            raise self.error("HDF5Data does not transform data (remove transform_param)")
        if not hp.source:
            raise self.error("hdf5_data_param.source is not set")
        if hp.batch_size <= 0:
            raise self.error("hdf5_data_param.batch_size must be positive")
        names = list(self.param.top)
        if len(names) != len(top):
            names = [b.name for b in top]
        rng = child_rngs(hp.shuffle)[1]
        try:
            log.info("Loading list of HDF5 filenames from: %s", hp.source)
            files = read_hdf5_list(hp.source)
            log.info("Number of HDF5 files: %d", len(files))
            loader = _HDF5Loader(files, names, [b.dtype for b in top], int(hp.batch_size), hp.shuffle, rng)
        except CctError as e:
            raise self.error(str(e)) from None
        for blob, trailing in zip(top, loader.trailing):
            blob.reshape((int(hp.batch_size),) + tuple(trailing))
        self._start(loader, 4)
