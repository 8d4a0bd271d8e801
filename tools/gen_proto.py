#!/usr/bin/env python
"""Regenerate cct/proto/caffe_pb2.py from proto/caffe.proto with grpc_tools' bundled protoc.

    python tools/gen_proto.py           # write cct/proto/caffe_pb2.py
    python tools/gen_proto.py --check   # exit 1 if the committed file differs from a fresh generation

Needs ``grpcio-tools`` (``pip install grpcio-tools``, part of the ``test`` extra).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROTO_DIR = os.path.join(ROOT, "proto")
PROTO_FILE = os.path.join(PROTO_DIR, "caffe.proto")
OUTPUT = os.path.join(ROOT, "cct", "proto", "caffe_pb2.py")


def _protoc(args: list[str]) -> None:
    try:
        from grpc_tools import protoc
    except ImportError:
        raise SystemExit("gen_proto: grpc_tools is not installed (pip install grpcio-tools)") from None
    import importlib.resources

    # protoc needs the well-known .proto includes that ship with grpc_tools.
    include = str(importlib.resources.files("grpc_tools") / "_proto")
    rc = protoc.main(["grpc_tools.protoc", f"-I{PROTO_DIR}", f"-I{include}", *args])
    if rc != 0:
        raise SystemExit(f"gen_proto: protoc failed (exit {rc}) on {PROTO_FILE}")


def generate() -> bytes:
    """The caffe_pb2.py that protoc generates from proto/caffe.proto now."""
    with tempfile.TemporaryDirectory() as tmp:
        _protoc([f"--python_out={tmp}", PROTO_FILE])
        with open(os.path.join(tmp, "caffe_pb2.py"), "rb") as f:
            return f.read()


def normalize_descriptor(fd) -> bytes:
    """``fd`` (a FileDescriptorProto) serialized after removing what differs between protoc's
    --descriptor_set_out and the descriptor embedded in generated Python (json_name, float default
    spelling), so two descriptors of the same .proto compare equal."""
    import struct

    from google.protobuf import descriptor_pb2

    fd = descriptor_pb2.FileDescriptorProto.FromString(fd.SerializeToString())
    FDP = descriptor_pb2.FieldDescriptorProto

    def walk(msgs) -> None:
        for m in msgs:
            for field in m.field:
                field.ClearField("json_name")
                if field.HasField("default_value") and field.type in (FDP.TYPE_FLOAT, FDP.TYPE_DOUBLE):
                    v = float(field.default_value)
                    if field.type == FDP.TYPE_FLOAT:
                        v = struct.unpack("<f", struct.pack("<f", v))[0]
                    field.default_value = repr(v)
            walk(m.nested_type)

    walk(fd.message_type)
    return fd.SerializeToString()


def descriptor_set() -> bytes:
    """The normalized FileDescriptorProto of proto/caffe.proto (independent of the protoc version)."""
    from google.protobuf import descriptor_pb2

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "caffe.desc")
        _protoc([f"--descriptor_set_out={out}", PROTO_FILE])
        with open(out, "rb") as f:
            fds = descriptor_pb2.FileDescriptorSet.FromString(f.read())
    (fd,) = fds.file
    return normalize_descriptor(fd)


def committed_descriptor() -> bytes:
    """The normalized FileDescriptorProto embedded in the committed cct/proto/caffe_pb2.py."""
    from google.protobuf import descriptor_pb2

    sys.path.insert(0, ROOT)
    from cct.proto import caffe_pb2

    fd = descriptor_pb2.FileDescriptorProto.FromString(caffe_pb2.DESCRIPTOR.serialized_pb)
    return normalize_descriptor(fd)


def main(argv: list[str] | None = None) -> int:
    """Write (or with --check, verify) cct/proto/caffe_pb2.py."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit non-zero if the committed module is stale")
    args = ap.parse_args(argv)
    fresh = generate()
    try:
        with open(OUTPUT, "rb") as f:
            current = f.read()
    except FileNotFoundError:
        current = None
    if args.check:
        if current != fresh:
            print(f"gen_proto: {os.path.relpath(OUTPUT, ROOT)} differs from a fresh generation from "
                  f"{os.path.relpath(PROTO_FILE, ROOT)}; run python tools/gen_proto.py", file=sys.stderr)
            return 1
        print(f"gen_proto: {os.path.relpath(OUTPUT, ROOT)} is up to date")
        return 0
    if current == fresh:
        print(f"gen_proto: {os.path.relpath(OUTPUT, ROOT)} unchanged")
        return 0
    sys.path.insert(0, ROOT)
    from cct.io.atomic import atomic_write_bytes

    mode = os.stat(OUTPUT).st_mode & 0o777 if current is not None else 0o644
    atomic_write_bytes(OUTPUT, fresh)
    os.chmod(OUTPUT, mode)  # the temp file behind the atomic write is created 0600
    print(f"gen_proto: wrote {os.path.relpath(OUTPUT, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
