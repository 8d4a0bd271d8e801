#!/usr/bin/env python
"""Write tests/data/bvlc_fields.json, the field list of BVLC Caffe's caffe.proto.

    python tools/bvlc_fields.py PATH/TO/BVLC/src/caffe/proto/caffe.proto --commit SHA

The list (message and field names, numbers, labels, types, defaults; enum values) is what
tests/test_proto_bvlc.py compares cct's proto/caffe.proto with. Needs ``grpcio-tools``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTPUT = os.path.join(ROOT, "tests", "data", "bvlc_fields.json")


def field_list(proto_path: str) -> dict:
    """:func:`cct.proto.fieldlist.describe` of the .proto file at ``proto_path``."""
    import importlib.resources

    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    sys.path.insert(0, ROOT)
    from cct.proto.fieldlist import describe

    include = str(importlib.resources.files("grpc_tools") / "_proto")
    src_dir, name = os.path.split(os.path.abspath(proto_path))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "fields.desc")
        rc = protoc.main(["protoc", f"-I{src_dir}", f"-I{include}", f"--descriptor_set_out={out}", name])
        if rc != 0:
            raise SystemExit(f"bvlc_fields: protoc failed (exit {rc}) on {proto_path}")
        with open(out, "rb") as f:
            (fdp,) = descriptor_pb2.FileDescriptorSet.FromString(f.read()).file
    return describe(fdp)


def main(argv: list[str] | None = None) -> int:
    """Write the field list of the given BVLC caffe.proto."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("proto", help="BVLC Caffe's src/caffe/proto/caffe.proto")
    ap.add_argument("--commit", required=True, help="the BVLC/caffe commit the file comes from")
    ap.add_argument("-o", "--output", default=OUTPUT)
    args = ap.parse_args(argv)
    data = {"source": {"repository": "BVLC/caffe", "path": "src/caffe/proto/caffe.proto", "commit": args.commit},
            **field_list(args.proto)}
    with open(args.output, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"bvlc_fields: wrote {os.path.relpath(args.output)} ({len(data['messages'])} messages)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
