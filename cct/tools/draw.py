"""draw: a net prototxt drawn as a graph, as Caffe's ``python/draw_net.py`` draws it (the ``[draw]`` extra).

``cct draw NET OUT.png [--rankdir LR] [--phase ALL|TRAIN|TEST] [--display_lrm]``

Layers are boxes (blue; activation layers green) with their type and main parameters, blobs are
grey octagons, edges are labelled with blob sizes where known, exactly as pycaffe's ``caffe.draw``
(which this calls). The image format follows OUT's extension (``.png``, ``.svg``, ``.pdf``, ...;
``.raw``/``.dot`` writes the graphviz source). Needs pydot (``pip install 'cct[draw]'``) and, except
for ``.dot``/``.raw``, graphviz's ``dot`` program. A legacy (V0/V1) net is upgraded first.
"""
from __future__ import annotations

import argparse
import logging
import os

from ..errors import CctError
from ..flags import FlagParser
from ..io.prototxt import read_text_file
from ..io.upgrade import net_needs_upgrade, upgrade_net
from ..proto import caffe_pb2
from . import run_tool, tool_parser

log = logging.getLogger("cct")


def draw(net_path: str, out: str, rankdir: str = "LR", phase: str = "ALL", display_lrm: bool = False) -> None:
    """Draw the net prototxt ``net_path`` into the image ``out``."""
    try:
        import pydot  # noqa: F401 - checked here for a clean error

        import caffe.draw as cdraw
    except ImportError:
        raise CctError("cct draw needs pydot, an optional dependency: pip install 'cct[draw]' (and graphviz's "
                       "'dot' program, e.g. apt-get install graphviz)") from None
    phases = {"ALL": None, "TRAIN": caffe_pb2.TRAIN, "TEST": caffe_pb2.TEST}
    if phase.upper() not in phases:
        raise CctError(f"--phase must be TRAIN, TEST or ALL, not '{phase}'")
    net = read_text_file(net_path, caffe_pb2.NetParameter())
    if net_needs_upgrade(net):
        upgrade_net(net, source=os.fspath(net_path))
    log.info("Drawing net to %s", out)
    ext = os.path.splitext(out)[1].lstrip(".").lower()
    if not ext:
        raise CctError(f"'{out}' has no extension to name the image format (.png, .svg, .pdf, .dot ...)")
    graph = cdraw.get_pydot_graph(net, rankdir, phase=phases[phase.upper()], display_lrm=display_lrm)
    if ext in ("dot", "raw"):
        data = graph.to_string().encode("utf-8")
    else:
        try:
            data = graph.create(format=ext)
        except FileNotFoundError:
            raise CctError("graphviz's 'dot' program is not installed (e.g. apt-get install graphviz); "
                           "OUT.dot writes the graph without it") from None
        except Exception as e:  # pydot reports dot's own failures (unknown format...) as plain exceptions
            raise CctError(f"graphviz could not draw '{out}': {str(e).strip().splitlines()[-1]}") from None
    with open(out, "wb") as f:
        f.write(data)


def build_parser() -> FlagParser:
    """The arguments of ``cct draw`` (those of Caffe's draw_net.py)."""
    p = tool_parser("draw", "Draw a graph of the net architecture.", progress=False)
    p.add_argument("input_net_proto_file", metavar="NET", help="the net prototxt")
    p.add_argument("output_image_file", metavar="OUT", help="the image to write (.png, .svg, .pdf, .dot ...)")
    p.add_argument("--rankdir", default="LR",
                   help="graph direction: LR (left-right), TB (top-bottom), RL, BT (graphviz's rankdir)")
    p.add_argument("--phase", default="ALL", help="layers of which phase to draw: TRAIN, TEST or ALL")
    p.add_argument("--display_lrm", action="store_true",
                   help="show the learning rate multipliers of Convolution, Deconvolution and InnerProduct layers")
    return p


def run(a: argparse.Namespace) -> int:
    """``cct draw`` on parsed arguments."""
    draw(a.input_net_proto_file, a.output_image_file, a.rankdir, a.phase, a.display_lrm)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    return run_tool(run, build_parser(), argv)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
