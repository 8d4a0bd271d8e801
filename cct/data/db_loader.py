"""The loader of Caffe's ``Data`` layer: transformed batches of the Datum records of an LMDB or LevelDB.

It walks the database in key order and starts again from the first key at the end ("Restarting data
prefetching from start."); decoding of encoded records runs on :mod:`cct.data.decode_pool`, the transforms
in record order (their random draws stay reproducible).
"""
from __future__ import annotations

import logging

import numpy as np

from ..errors import CctError
from ..proto import caffe_pb2
from .db import DB, parse_datum
from .decode_pool import DecodePool
from .stream import RESTART_MSG, continued_state, keeps, rng_state, set_rng_state
from .transformer import DataTransformer

log = logging.getLogger("cct")


class DBLoader:
    """Walks a database cursor in key order, wrapping at the end; builds transformed batches."""

    def __init__(self, db: DB, transformer: DataTransformer, batch_size: int, dtypes: list, skip: int):
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
        self.decode = DecodePool()  # encoded records (JPEG/PNG) are decoded side by side

    def state(self) -> dict:
        return {"pos": self.pos, "offset": self.offset, "transform_rng": rng_state(self.transformer.rng),
                "shard": self.shard}

    def set_state(self, state: dict) -> None:
        state = continued_state(state, self.shard)
        self.cursor.seek_to_first()
        self.pos = 0
        for _ in range(int(state["pos"]) % max(1, len(self.db))):
            self.next()
        self.offset = int(state.get("offset", 0))
        set_rng_state(self.transformer.rng, state["transform_rng"])

    def close(self) -> None:
        """Release the cursor, the database and the decoding threads."""
        self.cursor.close()
        self.db.close()
        self.decode.close()

    def next(self) -> None:
        self.cursor.next()
        self.pos += 1
        self.offset += 1
        if not self.cursor.valid:
            log.info(RESTART_MSG)
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
        arrays = self.decode.map(lambda kd: self._array(*kd), records, parallel=records[0][1].encoded)
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
