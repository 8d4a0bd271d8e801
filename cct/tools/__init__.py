"""Caffe's dataset tools, each a module with ``main(argv) -> int``.

* ``convert_imageset``: image files + list file -> LMDB/LevelDB of Datum.
* ``compute_image_mean``: database -> mean ``.binaryproto``.
* ``convert_mnist``: MNIST idx files -> database.
* ``convert_cifar``: CIFAR-10 binary batches -> train/test databases.
* ``make_digits``: a built-in synthetic 28x28 digit dataset (MNIST layout), no download needed.
* ``extract_features``: blobs of a trained net -> databases of float Datum records.
* ``upgrade_proto``: ``upgrade_net_proto_text``, ``upgrade_net_proto_binary``, ``upgrade_solver_proto_text``.
* ``parse_log`` / ``plot``: training log -> CSV tables (as Caffe's parse_log.py) / curves (matplotlib).
* ``draw``: a net prototxt -> a graph image (pydot + graphviz, as Caffe's draw_net.py).

Each has ``build_parser()`` and ``run(args)`` (used by ``cct <tool>``) and ``main(argv) -> int``.
Flags are spelled as in Caffe's gflags tools (``--resize_height=256``, ``--gray``, ``--nogray``,
``--backend=lmdb``; ``-flag`` also works and booleans accept ``=true``/``=false``), see :mod:`cct.flags`.
"""
from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from ..errors import CctError
from ..flags import FlagParser, add_progress_flag, command_parser, parse_bool

__all__ = ["add_bool_flag", "add_flag", "parse_bool", "run_tool", "tool_parser"]


def tool_parser(name: str, description: str, progress: bool = True) -> FlagParser:
    """The parser of ``cct <name>`` (gflags syntax, defaults in ``--help``); ``progress``: add ``--progress``."""
    p = command_parser(name, description)
    if progress:
        add_progress_flag(p)
    return p


def add_flag(parser: argparse.ArgumentParser, name: str, **kwargs) -> None:
    """A gflags-style valued flag: ``--name V``, ``-name V``, ``--name=V``."""
    parser.add_argument(f"--{name}", dest=name, **kwargs)


def add_bool_flag(parser: FlagParser, name: str, help: str, default: bool = False) -> None:
    """A boolean flag: ``--name``, ``--noname``, ``--name=true|false``; never takes the next word."""
    parser.add_bool(name, help, default)


def run_tool(body: Callable[[argparse.Namespace], int], parser: argparse.ArgumentParser,
             argv: Sequence[str] | None) -> int:
    """Parse ``argv``, set up INFO logging if nobody did, run ``body``; a CctError prints and returns 1."""
    if not logging.getLogger().handlers and not logging.getLogger("cct").handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    if logging.getLogger("cct").getEffectiveLevel() > logging.INFO:
        logging.getLogger("cct").setLevel(logging.INFO)
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
        return int(body(args) or 0)
    except CctError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 1
