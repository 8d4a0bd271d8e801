"""Caffe's dataset tools, each a module with ``main(argv) -> int``.

* ``convert_imageset``: image files + list file -> LMDB/LevelDB of Datum.
* ``compute_image_mean``: database -> mean ``.binaryproto``.
* ``convert_mnist``: MNIST idx files -> database.
* ``convert_cifar``: CIFAR-10 binary batches -> train/test databases.
* ``make_digits``: a built-in synthetic 28x28 digit dataset (MNIST layout), no download needed.

Flags are spelled as in Caffe's gflags tools (``--resize_height=256``, ``--gray``,
``--backend=lmdb``; ``-flag`` also works and booleans accept ``=true``/``=false``).
"""
from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from ..errors import CctError

__all__ = ["add_bool_flag", "add_flag", "parse_bool", "run_tool"]


def parse_bool(text: str | bool) -> bool:
    """gflags-style boolean value: true/false, 1/0, yes/no."""
    if isinstance(text, bool):
        return text
    t = text.strip().lower()
    if t in ("1", "true", "t", "yes", "y"):
        return True
    if t in ("0", "false", "f", "no", "n"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: '{text}'")


def add_flag(parser: argparse.ArgumentParser, name: str, **kwargs) -> None:
    """A gflags-style flag: accepted as ``--name`` and ``-name``."""
    parser.add_argument(f"--{name}", f"-{name}", dest=name, **kwargs)


def add_bool_flag(parser: argparse.ArgumentParser, name: str, help: str, default: bool = False) -> None:
    """A boolean flag: ``--name``, ``--name=true|false``."""
    add_flag(parser, name, nargs="?", const=True, default=default, type=parse_bool, metavar="BOOL", help=help)


def run_tool(body: Callable[[argparse.Namespace], int], parser: argparse.ArgumentParser,
             argv: list[str] | None) -> int:
    """Parse ``argv``, set up INFO logging if nobody did, run ``body``; a CctError prints and returns 1."""
    args = parser.parse_args(argv)
    if not logging.getLogger().handlers and not logging.getLogger("cct").handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    if logging.getLogger("cct").getEffectiveLevel() > logging.INFO:
        logging.getLogger("cct").setLevel(logging.INFO)
    try:
        return int(body(args) or 0)
    except CctError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 1
