"""convert_imageset: convert a set of images to an LMDB/LevelDB of Datum (Caffe's tool).

Usage: ``convert_imageset [FLAGS] ROOTFOLDER/ LISTFILE DB_NAME``. LISTFILE lines are
``subfolder1/file1.JPEG 7``; ROOTFOLDER is prefixed to each path as a plain string (keep its
trailing slash). Keys are ``"%08d_<path>"`` (line number after shuffling). Images are stored as
raw CxHxW BGR bytes, or with ``--encoded`` as encoded bytes (the file itself when it already
has the requested format and no resize/colour change is needed).
"""
from __future__ import annotations

import argparse
import logging
import os

import numpy as np

from ..config import current
from ..data.db import open_writer
from ..data.transformer import decode_image, encode_image, image_to_datum, read_image, read_image_list
from ..errors import CctError
from ..flags import FlagParser
from ..progress import Progress
from ..proto import caffe_pb2
from . import add_bool_flag, add_flag, run_tool, tool_parser

log = logging.getLogger("cct")


def _match_ext(fn: str, enc: str) -> bool:
    p = fn.rfind(".")
    ext = fn[p + 1:].lower() if p >= 0 else ""
    return ext == enc or (enc == "jpg" and ext == "jpeg")


def image_file_to_datum(path: str, label: int, height: int = 0, width: int = 0, is_color: bool = True,
                        encoding: str = "") -> caffe_pb2.Datum:
    """Caffe's ReadImageToDatum: raw CHW BGR bytes, or encoded bytes when ``encoding`` is set."""
    img = read_image(path, height, width, is_color)
    if encoding:
        datum = caffe_pb2.Datum()
        if (img.shape[2] == 3) == is_color and not height and not width and _match_ext(path, encoding):
            with open(path, "rb") as f:
                datum.data = f.read()
        else:
            datum.data = encode_image(img, encoding)
        datum.label = int(label)
        datum.encoded = True
        return datum
    return image_to_datum(img, label)


def convert_imageset(root_folder: str, list_file: str, db_name: str, resize_height: int = 0,
                     resize_width: int = 0, gray: bool = False, shuffle: bool = False, encoded: bool = False,
                     encode_type: str = "", backend: str = "lmdb", check_size: bool = False,
                     progress: bool = False) -> int:
    """Write the images of ``list_file`` into a new database ``db_name``; returns the number written.

    ``progress``: show a progress bar on a terminal (:class:`cct.progress.Progress`)."""
    if (resize_height > 0) != (resize_width > 0) and (resize_height or resize_width):
        log.warning("resize needs both --resize_height and --resize_width; the image is not resized")
    is_color = not gray
    lines = read_image_list(list_file)
    if shuffle:
        log.info("Shuffling data")
        order = current().random.generator.permutation(len(lines))
        lines = [lines[i] for i in order]
    log.info("A total of %d images.", len(lines))
    if encode_type and not encoded:
        log.info("encode_type specified, assuming encoded=true.")
    encoded = encoded or bool(encode_type)
    count = 0
    data_size = None
    with open_writer(db_name, backend) as writer, Progress(len(lines), "convert_imageset", unit="img",
                                                         enabled=progress) as bar:
        for line_id, (name, label) in enumerate(lines):
            bar.update()
            enc = encode_type.lower().lstrip(".")
            if encoded and not enc:
                p = name.rfind(".")
                if p < 0:
                    log.warning("Failed to guess the encoding of '%s'", name)
                enc = name[p + 1:].lower() if p >= 0 else ""
            path = root_folder + name
            try:
                datum = image_file_to_datum(path, label, resize_height, resize_width, is_color, enc)
            except CctError as e:
                log.error("%s", e)
                continue
            if check_size:
                if datum.encoded:
                    size = int(np.prod(decode_image(datum.data, "native").shape))
                else:
                    size = len(datum.data)
                if data_size is None:
                    data_size = size
                elif size != data_size:
                    raise CctError(f"incorrect data field size {size} for '{path}' (expected {data_size})")
            writer.put(f"{line_id:08d}_{name}", datum.SerializeToString())
            count += 1
            if count % 1000 == 0:
                log.info("Processed %d files.", count)
    if count % 1000 != 0:
        log.info("Processed %d files.", count)
    if count == 0:
        raise CctError(f"no image of '{list_file}' could be read; '{db_name}' is empty")
    return count


def build_parser() -> FlagParser:
    """The argument parser (Caffe's flags)."""
    p = tool_parser("convert_imageset", "Convert a set of images to the leveldb/lmdb format used as input for Caffe.")
    p.add_argument("root_folder", metavar="ROOTFOLDER/")
    p.add_argument("list_file", metavar="LISTFILE")
    p.add_argument("db_name", metavar="DB_NAME")
    add_bool_flag(p, "gray", "When this option is on, treat images as grayscale ones")
    add_bool_flag(p, "shuffle", "Randomly shuffle the order of images and their labels")
    add_flag(p, "backend", default="lmdb", choices=["lmdb", "leveldb"], help="The backend for storing the result")
    add_flag(p, "resize_width", type=int, default=0, help="Width images are resized to")
    add_flag(p, "resize_height", type=int, default=0, help="Height images are resized to")
    add_bool_flag(p, "check_size", "When this option is on, check that all the datum have the same size")
    add_bool_flag(p, "encoded", "When this option is on, the encoded image will be save in datum")
    add_flag(p, "encode_type", default="", help="Optional: What type should we encode the image as ('png','jpg',...)")
    return p


def run(a: argparse.Namespace) -> int:
    """``cct convert_imageset`` on parsed flags."""
    if not os.path.isfile(a.list_file):
        raise CctError(f"list file '{a.list_file}' does not exist")
    convert_imageset(a.root_folder, a.list_file, a.db_name, a.resize_height, a.resize_width, a.gray,
                     a.shuffle, a.encoded, a.encode_type, a.backend, a.check_size, progress=a.progress)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    return run_tool(run, build_parser(), argv)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
