"""Field list of a .proto file: every message's fields (name, number, label, type, default, packed)
and every enum's values, as plain JSON-able data.

Used to compare cct's ``caffe.proto`` with BVLC Caffe's (``tests/data/bvlc_fields.json`` holds BVLC
master's list; ``tools/bvlc_fields.py`` writes it from a BVLC ``caffe.proto``).
"""
from __future__ import annotations

import struct
from typing import Any

from google.protobuf import descriptor_pb2

_LABELS = {1: "optional", 2: "required", 3: "repeated"}
_TYPES = {v: k[len("TYPE_"):].lower() for k, v in descriptor_pb2.FieldDescriptorProto.Type.items()}


def _default(f: descriptor_pb2.FieldDescriptorProto) -> str:
    """The default as text; floats spelled as Python's repr of the value the field holds (protoc's
    descriptor output and a generated module's embedded descriptor spell them differently)."""
    FDP = descriptor_pb2.FieldDescriptorProto
    if f.type == FDP.TYPE_FLOAT:
        return repr(struct.unpack("<f", struct.pack("<f", float(f.default_value)))[0])
    if f.type == FDP.TYPE_DOUBLE:
        return repr(float(f.default_value))
    return f.default_value


def _field(f: descriptor_pb2.FieldDescriptorProto) -> dict[str, Any]:
    out: dict[str, Any] = {"name": f.name, "number": f.number, "label": _LABELS[f.label], "type": _TYPES[f.type]}
    if f.type_name:
        out["type_name"] = f.type_name.lstrip(".")
    if f.HasField("default_value"):
        out["default"] = _default(f)
    if f.options.HasField("packed"):
        out["packed"] = f.options.packed
    return out


def _walk(msg: descriptor_pb2.DescriptorProto, prefix: str, messages: dict, enums: dict) -> None:
    name = prefix + msg.name
    messages[name] = sorted((_field(f) for f in msg.field), key=lambda d: d["number"])
    for e in msg.enum_type:
        enums[f"{name}.{e.name}"] = {v.name: v.number for v in e.value}
    for n in msg.nested_type:
        _walk(n, name + ".", messages, enums)


def describe(fdp: descriptor_pb2.FileDescriptorProto) -> dict[str, Any]:
    """``{"package", "messages": {full name: [field, ...]}, "enums": {full name: {value: number}}}``."""
    messages: dict[str, list] = {}
    enums: dict[str, dict] = {}
    for m in fdp.message_type:
        _walk(m, "", messages, enums)
    for e in fdp.enum_type:
        enums[e.name] = {v.name: v.number for v in e.value}
    return {"package": fdp.package, "messages": messages, "enums": enums}


def describe_module(pb2_module) -> dict[str, Any]:
    """:func:`describe` of a generated ``*_pb2`` module's file."""
    return describe(descriptor_pb2.FileDescriptorProto.FromString(pb2_module.DESCRIPTOR.serialized_pb))


def differences(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """Human-readable differences between two field lists (empty when they agree)."""
    out: list[str] = []
    for kind in ("messages", "enums"):
        exp, act = expected[kind], actual[kind]
        for name in sorted(set(exp) - set(act)):
            out.append(f"{kind[:-1]} {name} missing")
        for name in sorted(set(act) - set(exp)):
            out.append(f"{kind[:-1]} {name} is not in the reference")
        for name in sorted(set(exp) & set(act)):
            if kind == "enums":
                if exp[name] != act[name]:
                    out.append(f"enum {name}: values {act[name]} != {exp[name]}")
                continue
            ef = {f["name"]: f for f in exp[name]}
            af = {f["name"]: f for f in act[name]}
            for fname in sorted(set(ef) - set(af)):
                out.append(f"{name}.{fname} (= {ef[fname]['number']}) missing")
            for fname in sorted(set(af) - set(ef)):
                out.append(f"{name}.{fname} is not in the reference")
            for fname in sorted(set(ef) & set(af)):
                if ef[fname] != af[fname]:
                    out.append(f"{name}.{fname}: {af[fname]} != {ef[fname]}")
    return out
