"""convert_cifar: CIFAR-10 binary batches -> train/test databases (Caffe's convert_cifar_data).

Usage: ``convert_cifar INPUT_FOLDER OUTPUT_FOLDER [DB_TYPE]`` (DB_TYPE lmdb or leveldb, default
lmdb). Reads ``data_batch_1.bin`` .. ``data_batch_5.bin`` and ``test_batch.bin`` (records of one
label byte + 3072 pixel bytes, planes R, G, B, stored as is) and writes
``OUTPUT_FOLDER/cifar10_train_<DB_TYPE>`` (keys ``"%05d"`` of batch*10000 + item) and
``OUTPUT_FOLDER/cifar10_test_<DB_TYPE>`` (keys ``"%05d"`` of the item).
"""
from __future__ import annotations

import argparse
import logging
import os

import numpy as np

from ..errors import CctError
from ..flags import FlagParser
from . import add_flag, run_tool, tool_parser
from .convert_mnist import write_images_db

log = logging.getLogger("cct")

IMAGE_SIZE = 32
BATCH_SIZE = 10000
NUM_TRAIN_BATCHES = 5
RECORD = 1 + 3 * IMAGE_SIZE * IMAGE_SIZE


def read_cifar_batch(path: str) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 (N, 3, 32, 32), labels (N,)) of one CIFAR-10 binary batch file."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise CctError(f"unable to open file '{path}': {e.strerror}") from None
    if len(raw) == 0 or len(raw) % RECORD:
        raise CctError(f"'{path}' is not a CIFAR-10 binary batch ({len(raw)} bytes, not a multiple of {RECORD})")
    rec = np.frombuffer(raw, np.uint8).reshape(-1, RECORD)
    return rec[:, 1:].reshape(-1, 3, IMAGE_SIZE, IMAGE_SIZE), rec[:, 0].copy()


def convert_cifar(input_folder: str, output_folder: str, db_type: str = "lmdb") -> tuple[int, int]:
    """Write the train and test databases; returns (train count, test count)."""
    os.makedirs(output_folder, exist_ok=True)
    log.info("Writing Training data")
    imgs, labs, ids = [], [], []
    for b in range(1, NUM_TRAIN_BATCHES + 1):
        log.info("Training Batch %d", b)
        x, y = read_cifar_batch(os.path.join(input_folder, f"data_batch_{b}.bin"))
        if x.shape[0] != BATCH_SIZE:
            log.warning("data_batch_%d.bin holds %d images (CIFAR-10 batches hold %d)", b, x.shape[0], BATCH_SIZE)
        imgs.append(x)
        labs.append(y)
        ids.append((b - 1) * BATCH_SIZE + np.arange(x.shape[0]))
    n_train = write_images_db(os.path.join(output_folder, f"cifar10_train_{db_type}"),
                              np.concatenate(imgs), np.concatenate(labs), db_type, "{:05d}", np.concatenate(ids))
    log.info("Writing Testing data")
    x, y = read_cifar_batch(os.path.join(input_folder, "test_batch.bin"))
    n_test = write_images_db(os.path.join(output_folder, f"cifar10_test_{db_type}"), x, y, db_type, "{:05d}")
    return n_train, n_test


def build_parser() -> FlagParser:
    """The argument parser (Caffe's arguments)."""
    p = tool_parser("convert_cifar", "Convert the CIFAR-10 binary batches to the lmdb/leveldb format")
    p.add_argument("input_folder", metavar="INPUT_FOLDER")
    p.add_argument("output_folder", metavar="OUTPUT_FOLDER")
    p.add_argument("db_type", metavar="DB_TYPE", nargs="?", default=None, choices=["lmdb", "leveldb", None])
    add_flag(p, "backend", default="lmdb", choices=["lmdb", "leveldb"], help="Database type (same as DB_TYPE)")
    return p


def run(a: argparse.Namespace) -> int:
    """``cct convert_cifar`` on parsed flags."""
    convert_cifar(a.input_folder, a.output_folder, a.db_type or a.backend)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    return run_tool(run, build_parser(), argv)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
