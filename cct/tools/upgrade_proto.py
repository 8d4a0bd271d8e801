"""Caffe's proto upgrade tools: rewrite a legacy net or solver definition in the current format.

* ``cct upgrade_net_proto_text IN OUT``: a V0/V1 or otherwise deprecated net prototxt -> current prototxt.
* ``cct upgrade_net_proto_binary IN OUT``: the same for a binary NetParameter (a ``.caffemodel``).
* ``cct upgrade_solver_proto_text IN OUT``: the ``solver_type`` enum -> the ``type`` string.

As Caffe's tools, an input that needs no upgrade is written back unchanged with the log line
``File already in latest proto format: IN``. The upgrade itself is :mod:`cct.io.upgrade`, the code
that runs whenever cct reads a net or solver; a file it cannot upgrade is an error naming the file
and layer, and nothing is written.
"""
from __future__ import annotations

import argparse
import logging
import os

from ..flags import FlagParser
from ..io.binary import read_binary_message
from ..io.caffemodel import write_caffemodel
from ..io.prototxt import read_text_file, write_text_file
from ..io.upgrade import net_needs_upgrade, upgrade_net, upgrade_solver
from ..proto import caffe_pb2
from . import run_tool, tool_parser

log = logging.getLogger("cct")


def upgrade_net_text(src: str, dst: str) -> bool:
    """Upgrade the net prototxt ``src`` into ``dst``; returns whether it needed an upgrade."""
    net = read_text_file(src, caffe_pb2.NetParameter())
    return _upgrade_net(net, src, dst, binary=False)


def upgrade_net_binary(src: str, dst: str) -> bool:
    """Upgrade the binary NetParameter (``.caffemodel``) ``src`` into ``dst``; returns whether it needed one."""
    net = read_binary_message(src, caffe_pb2.NetParameter(), "binary NetParameter (.caffemodel)")
    return _upgrade_net(net, src, dst, binary=True)


def _upgrade_net(net: caffe_pb2.NetParameter, src: str, dst: str, binary: bool) -> bool:
    needed = net_needs_upgrade(net)
    if needed:
        upgrade_net(net, source=os.fspath(src))
    else:
        log.error("File already in latest proto format: %s", src)
    if binary:
        write_caffemodel(dst, net)
        log.info("Wrote upgraded NetParameter binary proto to %s", dst)
    else:
        write_text_file(dst, net)
        log.info("Wrote upgraded NetParameter text proto to %s", dst)
    return needed


def upgrade_solver_text(src: str, dst: str) -> bool:
    """Upgrade the solver prototxt ``src`` into ``dst``; returns whether it needed an upgrade.

    Only the solver's own format is upgraded (as Caffe's tool); ``snapshot_prefix`` is kept as written.
    """
    solver = read_text_file(src, caffe_pb2.SolverParameter())
    needed = solver.HasField("solver_type")
    if needed:
        upgrade_solver(solver, source=f"<{src}>")  # "<...>": no snapshot_prefix defaulting, as Caffe's tool
    else:
        log.error("File already in latest proto format: %s", src)
    write_text_file(dst, solver)
    log.info("Wrote upgraded SolverParameter text proto to %s", dst)
    return needed


def _parser(name: str, what: str) -> FlagParser:
    p = tool_parser(name, f"Upgrade a {what} written in a deprecated format to the current format.")
    p.add_argument("input", metavar="IN", help=f"the {what} to read")
    p.add_argument("output", metavar="OUT", help="where to write the upgraded file")
    return p


def build_net_text_parser() -> FlagParser:
    """The arguments of ``cct upgrade_net_proto_text``."""
    return _parser("upgrade_net_proto_text", "net prototxt")


def build_net_binary_parser() -> FlagParser:
    """The arguments of ``cct upgrade_net_proto_binary``."""
    return _parser("upgrade_net_proto_binary", "binary net (.caffemodel)")


def build_solver_text_parser() -> FlagParser:
    """The arguments of ``cct upgrade_solver_proto_text``."""
    return _parser("upgrade_solver_proto_text", "solver prototxt")


def run_net_text(a: argparse.Namespace) -> int:
    """``cct upgrade_net_proto_text`` on parsed arguments."""
    upgrade_net_text(a.input, a.output)
    return 0


def run_net_binary(a: argparse.Namespace) -> int:
    """``cct upgrade_net_proto_binary`` on parsed arguments."""
    upgrade_net_binary(a.input, a.output)
    return 0


def run_solver_text(a: argparse.Namespace) -> int:
    """``cct upgrade_solver_proto_text`` on parsed arguments."""
    upgrade_solver_text(a.input, a.output)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m cct.tools.upgrade_proto net_text|net_binary|solver_text IN OUT``."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    kinds = {"net_text": (run_net_text, build_net_text_parser), "net_binary": (run_net_binary,
             build_net_binary_parser), "solver_text": (run_solver_text, build_solver_text_parser)}
    if not argv or argv[0] not in kinds:
        print(f"usage: python -m cct.tools.upgrade_proto {{{','.join(kinds)}}} IN OUT", file=sys.stderr)
        return 1
    body, build = kinds[argv[0]]
    return run_tool(body, build(), argv[1:])


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
