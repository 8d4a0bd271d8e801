"""The loader of Caffe's ``ImageData`` layer: transformed batches of the images listed, with labels, in a
text file.

It walks the list (shuffled again at each pass with ``shuffle``) and starts over at the end; the images
are read and decoded on :mod:`cct.data.decode_pool`, the transforms run in list order.
"""
from __future__ import annotations

import logging

import numpy as np

from ..errors import CctError
from .decode_pool import DecodePool
from .stream import RESTART_MSG, continued_state, keeps, rng_state, set_rng_state
from .transformer import DataTransformer, read_image

log = logging.getLogger("cct")


class ImageListLoader:
    """Walks a list of ``(path, label)`` lines from ``start``, wrapping at the end; builds transformed batches."""

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
        self.decode = DecodePool()  # the images of a batch are read and decoded side by side

    def state(self) -> dict:
        return {"pos": self.pos, "offset": self.offset, "lines": self._order if self.shuffle else None,
                "rng": rng_state(self.rng), "transform_rng": rng_state(self.transformer.rng), "shard": self.shard}

    def set_state(self, state: dict) -> None:
        state = continued_state(state, self.shard)
        if state["lines"] is not None:
            self.lines = [tuple(x) for x in state["lines"]]
            self._order = tuple(self.lines)
        self.pos = int(state["pos"])
        self.offset = int(state.get("offset", 0))
        set_rng_state(self.rng, state["rng"])
        set_rng_state(self.transformer.rng, state["transform_rng"])

    def close(self) -> None:
        """Stop the decoding threads."""
        self.decode.close()

    def _next(self) -> None:
        self.pos += 1
        self.offset += 1
        if self.pos >= len(self.lines):
            log.info(RESTART_MSG)
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
        images = self.decode.map(lambda item: self.read(item[0]), picked)
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
