"""compute_image_mean: the per-pixel mean of the images in a database (Caffe's tool).

Usage: ``compute_image_mean [--backend=lmdb] INPUT_DB [OUTPUT_FILE]``. Writes a legacy 4-D
BlobProto (1 x C x H x W) usable as ``transform_param { mean_file: ... }`` and logs the mean
of each channel. As Caffe, the sum is accumulated in float32 and divided by the count.
"""
from __future__ import annotations

import argparse
import logging

import numpy as np

from ..data.db import open_db, parse_datum
from ..data.transformer import datum_to_array
from ..errors import CctError
from ..flags import FlagParser
from ..io.blobproto import array_to_blobproto, write_binaryproto
from ..progress import Progress
from . import add_flag, run_tool, tool_parser

log = logging.getLogger("cct")


def compute_image_mean(input_db: str, output_file: str | None = None, backend: str = "lmdb",
                       progress: bool = False) -> np.ndarray:
    """Mean image (1, C, H, W) float32 of every Datum in ``input_db``; written to ``output_file`` if given.

    ``progress``: show a progress bar on a terminal (:class:`cct.progress.Progress`)."""
    with open_db(input_db, backend) as db, Progress(len(db), "compute_image_mean", unit="img",
                                                    enabled=progress) as bar:
        total = None
        count = 0
        for key, value in db.items():
            bar.update()
            datum = parse_datum(value, key, input_db)
            if datum.encoded and count == 0:
                log.info("Decoding Datum")
            arr = datum_to_array(datum)
            if total is None:
                total = np.zeros(arr.shape, dtype=np.float32)
                log.info("Starting iteration")
            elif arr.shape != total.shape:
                raise CctError(f"record '{key.decode('utf-8', 'replace')}' in '{input_db}': incorrect data field "
                               f"size {arr.size} (shape {list(arr.shape)}, expected {list(total.shape)})")
            total += arr  # float32 accumulation, as Caffe's float BlobProto sum
            count += 1
            if count % 10000 == 0:
                log.info("Processed %d files.", count)
        if count % 10000 != 0:
            log.info("Processed %d files.", count)
    mean = (total / np.float32(count)).astype(np.float32)[None]
    if output_file:
        log.info("Write to %s", output_file)
        write_binaryproto(output_file, array_to_blobproto(mean, legacy_4d=True))
    c = mean.shape[1]
    log.info("Number of channels: %d", c)
    for ch in range(c):
        log.info("mean_value channel [%d]: %g", ch, float(mean[0, ch].astype(np.float64).mean()))
    return mean


def build_parser() -> FlagParser:
    """The argument parser (Caffe's flags)."""
    p = tool_parser("compute_image_mean", "Compute the mean image of a set of images given by a leveldb/lmdb")
    p.add_argument("input_db", metavar="INPUT_DB")
    p.add_argument("output_file", metavar="OUTPUT_FILE", nargs="?", default=None)
    add_flag(p, "backend", default="lmdb", choices=["lmdb", "leveldb"],
             help="The backend {leveldb, lmdb} containing the images")
    return p


def run(a: argparse.Namespace) -> int:
    """``cct compute_image_mean`` on parsed flags."""
    compute_image_mean(a.input_db, a.output_file, a.backend, progress=a.progress)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    return run_tool(run, build_parser(), argv)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
