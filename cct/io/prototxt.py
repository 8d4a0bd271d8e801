"""Reading and writing Caffe text-format files (nets and solvers), with file:line:column errors."""
from __future__ import annotations

import os

from google.protobuf import text_format
from google.protobuf.message import Message

from ..errors import CctError, ProtoParseError
from ..proto import caffe_pb2
from .atomic import atomic_write_bytes
from .fork_fields import explain_unknown_field
from .upgrade import upgrade_net, upgrade_solver


def parse_text(text: str, message: Message, source: str = "<string>") -> Message:
    """Merge prototxt ``text`` into ``message``; syntax errors raise ProtoParseError with source:line:col."""
    try:
        text_format.Merge(text, message)
    except text_format.ParseError as e:
        line, col = e.GetLine(), e.GetColumn()
        msg = str(e)
        # protobuf prefixes "line:col : "; keep only the explanation.
        if " : " in msg:
            msg = msg.split(" : ", 1)[1]
        where = f"{source}:{line}:{col}" if line else source

        msg = explain_unknown_field(text, line, col, msg) or msg
        raise ProtoParseError(f"{where}: {msg}") from None
    return message


def read_text_file(path: str | os.PathLike, message: Message) -> Message:
    """Parse the prototxt file at ``path`` into ``message``."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise CctError(f"cannot read '{path}': {e.strerror}") from None
    return parse_text(decode_text(raw, os.fspath(path)), message, source=os.fspath(path))


def decode_text(raw: bytes, source: str = "<bytes>") -> str:
    """``raw`` as UTF-8 text; an undecodable byte raises ProtoParseError naming ``source:line:column``
    (column in bytes, both 1-based) and the byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        bad = raw[e.start:e.end]
        raise ProtoParseError(f"{source}:{line}:{col}: invalid UTF-8 byte{'s' if len(bad) > 1 else ''} "
                              f"{' '.join(f'0x{b:02x}' for b in bad)} ({e.reason}); expected UTF-8 text") from None


def read_net_prototxt(path: str | os.PathLike) -> caffe_pb2.NetParameter:
    """Read a net prototxt and upgrade legacy (V0/V1, input_dim) definitions to the current format."""
    net = read_text_file(path, caffe_pb2.NetParameter())
    return upgrade_net(net, source=os.fspath(path))


def read_solver_prototxt(path: str | os.PathLike) -> caffe_pb2.SolverParameter:
    """Read a solver prototxt (and upgrade the deprecated ``solver_type`` enum to ``type``)."""
    solver = read_text_file(path, caffe_pb2.SolverParameter())
    return upgrade_solver(solver, source=os.fspath(path))


def to_text(message: Message) -> str:
    """Text-format a message as Caffe writes prototxt."""
    return text_format.MessageToString(message)


def write_text_file(path: str | os.PathLike, message: Message) -> None:
    atomic_write_bytes(path, to_text(message).encode("utf-8"))
