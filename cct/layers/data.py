"""Data layers: ``Data`` (LMDB/LevelDB of Datum), ``ImageData`` (image list file), ``HDF5Data``.

Each layer reads ahead in a background thread (:class:`cct.data.prefetch.Prefetcher`, queue
depth ``data_param.prefetch``, default 4) so loading and transforming overlap compute;
``forward`` copies the next ready batch into the tops. Like Caffe's data layers they have no
bottoms, no backward, and never take a gradient. The layers check their parameters and set up; the
reading is their loader's (:mod:`cct.data.db_loader`, :mod:`cct.data.image_list_loader`,
:mod:`cct.data.hdf5_loader`).

Randomness (crops, mirrors, shuffles, ``rand_skip``) comes from two generators private to the
layer (one for the transforms, one for the record order, like Caffe's transformer and prefetch
RNGs), seeded by one draw of the layer's host random source at setup (its net's, :mod:`cct.random_source`;
only when the layer needs any), so
a run with a fixed ``random_seed`` is reproducible whatever the thread timing. As in Caffe,
``mirror: true`` flips at random in the TEST phase too; only the crop is centred in TEST.

Decoding of encoded records (JPEG/PNG) and image files runs on a small thread pool
(:mod:`cct.data.decode_pool`: deterministic work, order kept); the transforms stay in record order on the
prefetch thread.

Order of records (Caffe's): ``Data`` walks the database in key order and restarts from the
first key at the end ("Restarting data prefetching from start."); ``ImageData`` walks the list
(reshuffled at each pass with ``shuffle``); ``HDF5Data`` walks the rows of each listed file in
order and wraps around row by row, even inside a batch.

Sharding (distributed training, :meth:`PrefetchingDataLayer.set_shard`): every loader counts the
records it passes (``offset``, a counter of the layer's whole record stream that never wraps); a
layer sharded as rank r of N keeps only the records whose offset is r modulo N and steps over the
others, as Caffe's ``Skip()`` (:mod:`cct.data.stream`). N ranks at batch b thus read, between them,
exactly the records one process reads at batch N*b, each once.
"""
from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..blob import Blob
from ..data.db import open_db
from ..data.db_loader import DBLoader
from ..data.hdf5_loader import HDF5Loader, read_hdf5_list
from ..data.image_list_loader import ImageListLoader
from ..data.prefetch import Prefetcher
from ..data.transformer import DataTransformer, read_numbered_image_list
from ..errors import CctError
from ..proto import caffe_pb2
from .base import Layer, register

log = logging.getLogger("cct")

_LEGACY_TRANSFORM_FIELDS = ("scale", "mean_file", "crop_size", "mirror")


def _copy_to_blob(blob: Blob, arr: np.ndarray) -> None:
    """Reshape ``blob`` to ``arr.shape`` and copy ``arr`` into its data (an upload when it is a GPU's)."""
    blob.reshape(arr.shape)
    blob.device.upload(arr, out=blob.data)


def child_rngs(parent: np.random.Generator,
               needed: bool) -> tuple[np.random.Generator | None, np.random.Generator | None]:
    """(transform generator, order generator) for a layer, seeded by one draw of ``parent`` (the layer's
    host generator).

    Two streams, as Caffe's transformer RNG and prefetch (shuffle) RNG: the record order does not
    depend on how many draws the transforms make. No draw at all when the layer needs none.
    """
    if not needed:
        return None, None
    ss = np.random.SeedSequence(int(parent.integers(0, 2**63 - 1)))
    a, b = ss.spawn(2)
    return np.random.default_rng(a), np.random.default_rng(b)


def _rank_rng(rng: np.random.Generator | None, rank: int) -> None:
    """Give rank ``rank`` > 0 a transform stream of its own, derived from the shared one (rank 0 keeps
    the shared stream, so one rank reproduces a single process)."""
    if rng is not None and rank > 0:
        seed = int(rng.bit_generator.random_raw())
        rng.bit_generator.state = np.random.default_rng([seed, rank]).bit_generator.state


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
        t_rng, rng = child_rngs(self.host_random().generator, needs_rng)
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
        loader = DBLoader(db, transformer, int(dp.batch_size), dtypes, skip)
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
        t_rng, rng = child_rngs(self.host_random().generator, needs_rng)
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
        loader = ImageListLoader(lines, ip.root_folder, new_h, new_w, ip.is_color, transformer,
                                  int(ip.batch_size), dtypes, ip.shuffle, rng, start, ip.source, line_of)
        try:
            first = loader.image(start)
            shape = (int(ip.batch_size),) + transformer.infer_shape(first.transpose(2, 0, 1))
        except CctError as e:
            raise self.error(str(e)) from None
        top[0].reshape(shape)
        top[1].reshape((int(ip.batch_size),))
        self._start(loader, depth)


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
        rng = child_rngs(self.host_random().generator, hp.shuffle)[1]
        try:
            log.info("Loading list of HDF5 filenames from: %s", hp.source)
            files = read_hdf5_list(hp.source)
            log.info("Number of HDF5 files: %d", len(files))
            loader = HDF5Loader(files, names, [b.dtype for b in top], int(hp.batch_size), hp.shuffle, rng)
        except CctError as e:
            raise self.error(str(e)) from None
        for blob, trailing in zip(top, loader.trailing):
            blob.reshape((int(hp.batch_size),) + tuple(trailing))
        self._start(loader, 4)
