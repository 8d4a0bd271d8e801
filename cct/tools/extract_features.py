"""extract_features: run a trained net and store the values of some blobs, one record per item (Caffe's tool).

Usage, in Caffe's argument order::

    cct extract_features WEIGHTS NET BLOB1[,BLOB2...] DB1[,DB2...] NUM_MINI_BATCHES [lmdb|leveldb] [CPU|GPU [ID]]

The net (TEST phase) is run ``NUM_MINI_BATCHES`` times; after each forward pass, item ``n`` of every
named blob becomes one record of the matching new database: key ``"%d"`` (a running item count per
blob, not zero-padded, as in Caffe), value a ``Datum`` with ``channels = 1``, ``height = count/num``,
``width = 1`` and the values in ``float_data``. Records are committed every 1000 items.
One difference: Caffe reads the database type of the *i*-th blob from the argument after the
*i*-th (so a second blob takes ``CPU``/``GPU`` as its type); here every database uses the one type.
"""
from __future__ import annotations

import argparse
import logging

import numpy as np

from ..data.db import open_writer
from ..device.driver import to_host
from ..errors import CctError
from ..flags import FlagParser
from ..net import Net
from ..progress import Progress
from ..proto import caffe_pb2
from ..runsetup import (
    add_common_arguments,
    add_device_arguments,
    engine_config,
    init_logging,
    run_config,
    stages,
    wants_progress,
)
from . import run_tool, tool_parser

log = logging.getLogger("cct")


def _names(text: str, what: str) -> list[str]:
    names = text.split(",")
    if any(not n or n != n.strip() for n in names):
        raise CctError(f"{what} '{text}': names are separated by ',' and cannot be empty or contain spaces")
    return names


def extract_features(net, blob_names: list[str], db_names: list[str], num_mini_batches: int,
                     backend: str = "lmdb", progress: bool = False) -> dict[str, int]:
    """Write ``num_mini_batches`` forward passes' worth of each blob of ``net`` (a :class:`cct.net.Net`)
    into the new databases ``db_names`` (one per blob); returns the number of records per blob."""
    if len(blob_names) != len(db_names):
        raise CctError(f"the number of blob names ({len(blob_names)}) and dataset names ({len(db_names)}) "
                       "must be equal")
    for b in blob_names:
        if not net.has_blob(b):
            raise CctError(f"Unknown feature blob name {b} in the network {net.name}")
    if num_mini_batches < 0:
        raise CctError(f"num_mini_batches must be >= 0, not {num_mini_batches}")
    writers = []
    try:
        for name in db_names:
            log.info("Opening dataset %s", name)
            writers.append(open_writer(name, backend))
        log.info("Extracting Features")
        counts = [0] * len(blob_names)
        datum = caffe_pb2.Datum()
        with Progress(num_mini_batches, "extract_features", unit="batch", enabled=progress) as bar:
            for _ in range(num_mini_batches):
                net.forward()
                for i, (blob_name, writer) in enumerate(zip(blob_names, writers)):
                    data = np.asarray(to_host(net.blob_by_name(blob_name).data), dtype=np.float32)
                    num = data.shape[0] if data.ndim else 1
                    rows = data.reshape(num, -1)
                    datum.channels, datum.height, datum.width = 1, rows.shape[1], 1
                    for row in rows:
                        datum.ClearField("float_data")
                        datum.float_data.extend(row.tolist())
                        writer.put(str(counts[i]), datum.SerializeToString())
                        counts[i] += 1
                        if counts[i] % 1000 == 0:
                            log.info("Extracted features of %d query images for feature blob %s", counts[i],
                                     blob_name)
                bar.update()
        for blob_name, n in zip(blob_names, counts):
            log.info("Extracted features of %d query images for feature blob %s", n, blob_name)
    finally:
        for w in writers:
            w.close()
    log.info("Successfully extracted the features!")
    return dict(zip(blob_names, counts))


def build_parser() -> FlagParser:
    """The arguments of ``cct extract_features`` (Caffe's order) and the flags of ``cct test``."""
    p = tool_parser("extract_features", "Run a trained net and save the values of blobs as Datum records "
                    "(float_data) in new databases, one per blob.", progress=False)
    p.add_argument("weights", metavar="WEIGHTS", help="the trained net (.caffemodel or .h5)")
    p.add_argument("model", metavar="NET", help="the net prototxt (TEST phase is used)")
    p.add_argument("blobs", metavar="BLOBS", help="blob names, comma-separated (e.g. fc7,fc8)")
    p.add_argument("dbs", metavar="DBS", help="new database paths, comma-separated, one per blob")
    p.add_argument("num_mini_batches", metavar="NUM_MINI_BATCHES", type=int, help="forward passes to run")
    p.add_argument("rest", metavar="[lmdb|leveldb] [CPU|GPU [DEVICE_ID]]", nargs="*",
                   help="database type (default lmdb) and device, as Caffe's tool")
    add_common_arguments(p)
    add_device_arguments(p)
    return p


def _rest(words: list[str]) -> tuple[str, str | None]:
    """(backend, gpu flag) from Caffe's trailing arguments."""
    backend, gpu = "lmdb", None
    words = list(words)
    if words and words[0].lower() in ("lmdb", "leveldb"):
        backend = words.pop(0).lower()
    if words and words[0].upper() in ("CPU", "GPU"):
        mode = words.pop(0).upper()
        if mode == "GPU":
            gpu = words.pop(0) if words else "0"
            if not gpu.isdigit():
                raise CctError(f"DEVICE_ID must be a non-negative integer, not '{gpu}'")
    if words:
        raise CctError(f"unexpected arguments {words}: after NUM_MINI_BATCHES come [lmdb|leveldb] [CPU|GPU [ID]]")
    return backend, gpu


def run(a: argparse.Namespace) -> int:
    """``cct extract_features`` on parsed arguments."""
    backend, gpu = _rest(a.rest)
    if gpu is not None:
        if a.gpu not in (None, gpu):
            raise CctError(f"GPU {gpu} and --gpu={a.gpu} disagree")
        a.gpu = gpu
    init_logging(a.quiet)
    blobs, dbs = _names(a.blobs, "BLOBS"), _names(a.dbs, "DBS")
    config = run_config(a, engine_config(a, calibrate=False))
    net = Net(a.model, caffe_pb2.TEST, level=a.level, stages=stages(a.stage), config=config)
    net.copy_from(a.weights)
    extract_features(net, blobs, dbs, a.num_mini_batches, backend, progress=wants_progress(a))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    return run_tool(run, build_parser(), argv)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
