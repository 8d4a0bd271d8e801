"""convert_mnist: MNIST idx files -> database of Datum (Caffe's examples/mnist/convert_mnist_data).

Usage: ``convert_mnist [--backend=lmdb] INPUT_IMAGE_FILE INPUT_LABEL_FILE OUTPUT_DB``. Each image
becomes a raw uint8 Datum (1 x rows x cols) with its label, under key ``"%08d"`` (item index).
Files may be gzip-compressed (``.gz``).
"""
from __future__ import annotations

import argparse
import gzip
import logging

import numpy as np

from ..data.db import open_writer
from ..errors import CctError
from ..flags import FlagParser
from ..progress import Progress
from ..proto import caffe_pb2
from . import add_flag, run_tool, tool_parser

log = logging.getLogger("cct")

IMAGE_MAGIC = 2051
LABEL_MAGIC = 2049


def _read(path: str) -> bytes:
    try:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise CctError(f"cannot read '{path}': {e.strerror or e}") from None


def read_idx(image_file: str, label_file: str) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 (N, rows, cols), labels uint8 (N,)) of an idx image/label file pair."""
    img = _read(image_file)
    lab = _read(label_file)
    if len(img) < 16 or int.from_bytes(img[:4], "big") != IMAGE_MAGIC:
        raise CctError(f"'{image_file}': incorrect image file magic (expected {IMAGE_MAGIC})")
    if len(lab) < 8 or int.from_bytes(lab[:4], "big") != LABEL_MAGIC:
        raise CctError(f"'{label_file}': incorrect label file magic (expected {LABEL_MAGIC})")
    num_items, rows, cols = (int.from_bytes(img[i:i + 4], "big") for i in (4, 8, 12))
    num_labels = int.from_bytes(lab[4:8], "big")
    if num_items != num_labels:
        raise CctError(f"{num_items} images in '{image_file}' but {num_labels} labels in '{label_file}'")
    if len(img) < 16 + num_items * rows * cols or len(lab) < 8 + num_labels:
        raise CctError(f"'{image_file}' or '{label_file}' is truncated")
    images = np.frombuffer(img, np.uint8, num_items * rows * cols, 16).reshape(num_items, rows, cols)
    labels = np.frombuffer(lab, np.uint8, num_labels, 8)
    return images, labels


def write_images_db(db_name: str, images: np.ndarray, labels: np.ndarray, backend: str = "lmdb",
                    key_format: str = "{:08d}", key_ids: np.ndarray | None = None,
                    progress: Progress | None = None) -> int:
    """Write uint8 images (N, H, W) or (N, C, H, W) with labels as raw Datum records; returns N.

    Record i gets the key ``key_format.format(key_ids[i])`` (``key_ids`` defaults to 0..N-1);
    ``progress`` (if given) advances by one per record.
    """
    if images.ndim == 3:
        images = images[:, None]
    n, c, h, w = images.shape
    datum = caffe_pb2.Datum()
    datum.channels, datum.height, datum.width = c, h, w
    images = np.ascontiguousarray(images, dtype=np.uint8)
    with open_writer(db_name, backend) as writer:
        for i in range(n):
            datum.data = images[i].tobytes()
            datum.label = int(labels[i])
            writer.put(key_format.format(i if key_ids is None else int(key_ids[i])), datum.SerializeToString())
            if progress is not None:
                progress.update()
    return n


def convert_mnist(image_file: str, label_file: str, db_name: str, backend: str = "lmdb") -> int:
    """Convert an MNIST idx pair into a new database; returns the number of items."""
    images, labels = read_idx(image_file, label_file)
    log.info("A total of %d items.", images.shape[0])
    log.info("Rows: %d Cols: %d", images.shape[1], images.shape[2])
    n = write_images_db(db_name, images, labels, backend)
    log.info("Processed %d files.", n)
    return n


def build_parser() -> FlagParser:
    """The argument parser (Caffe's flags)."""
    p = tool_parser("convert_mnist", "Convert the MNIST dataset to the lmdb/leveldb format used by Caffe")
    p.add_argument("image_file", metavar="INPUT_IMAGE_FILE")
    p.add_argument("label_file", metavar="INPUT_LABEL_FILE")
    p.add_argument("db_name", metavar="OUTPUT_DB")
    add_flag(p, "backend", default="lmdb", choices=["lmdb", "leveldb"], help="The backend for storing the result")
    return p


def run(a: argparse.Namespace) -> int:
    """``cct convert_mnist`` on parsed flags."""
    convert_mnist(a.image_file, a.label_file, a.db_name, a.backend)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    return run_tool(run, build_parser(), argv)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
