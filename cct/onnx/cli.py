"""``cct export_onnx`` (net prototxt + caffemodel -> ONNX, checked by ``onnx.checker``) and ``cct import_onnx``."""
from __future__ import annotations

import argparse
import logging

from ..flags import FlagParser
from ..net import Net
from ..proto import caffe_pb2
from ..tools import add_bool_flag, add_flag, tool_parser
from .export import DEFAULT_OPSET, export
from .importer import import_onnx

log = logging.getLogger("cct")


def build_export_parser() -> FlagParser:
    """The arguments of ``cct export_onnx``."""
    p = tool_parser("export_onnx", "Export a Caffe net (prototxt + caffemodel) to ONNX; a layer ONNX cannot "
                    "express exactly is an error naming it.", progress=False)
    add_flag(p, "model", required=True, help="the net prototxt (a deploy net: Input layers, no loss)")
    add_flag(p, "weights", required=True, help="the trained weights (.caffemodel or .h5)")
    add_flag(p, "out", required=True, help="the ONNX file to write")
    add_flag(p, "opset", type=int, default=DEFAULT_OPSET, help="the ONNX opset to target (13 or newer)")
    add_bool_flag(p, "dynamic_batch", "make the batch axis of every input and output symbolic")
    add_bool_flag(p, "fold_batchnorm", "write each BatchNorm followed by a per-channel Scale as one "
                  "BatchNormalization node")
    add_flag(p, "phase", default="TEST", choices=["TEST", "TRAIN"], help="the phase to build the net in")
    return p


def run_export(a: argparse.Namespace) -> int:
    """``cct export_onnx`` on parsed arguments."""
    net = Net(a.model, caffe_pb2.TEST if a.phase == "TEST" else caffe_pb2.TRAIN, weights=a.weights)
    export(net, a.out, opset=a.opset, dynamic_batch=a.dynamic_batch, fold_batchnorm=a.fold_batchnorm)
    log.info("Wrote ONNX model (opset %d%s) to %s", a.opset, ", dynamic batch" if a.dynamic_batch else "", a.out)
    return 0


def build_import_parser() -> FlagParser:
    """The arguments of ``cct import_onnx``."""
    p = tool_parser("import_onnx", "Convert an ONNX model into a Caffe deploy prototxt and caffemodel where BVLC "
                    "layers express it exactly; an op they cannot is an error naming the node.", progress=False)
    p.add_argument("onnx_model", metavar="MODEL.onnx", help="the ONNX model to convert")
    add_flag(p, "out_model", required=True, help="the deploy prototxt to write")
    add_flag(p, "out_weights", required=True, help="the caffemodel to write")
    return p


def run_import(a: argparse.Namespace) -> int:
    """``cct import_onnx`` on parsed arguments."""
    import_onnx(a.onnx_model, a.out_model, a.out_weights)
    log.info("Wrote %s and %s", a.out_model, a.out_weights)
    return 0
