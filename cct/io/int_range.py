"""Unsigned (and 64-bit) prototxt fields that Caffe reads into a signed ``int``: values above INT_MAX.

caffe.proto declares kernel sizes, strides, pads, num_output, batch sizes, ... as ``uint32`` (and blob
dims as ``int64``), but Caffe's layers copy them into ``int``: 4294967295 becomes -1 there (a pooling
stride of 4294967295 silently means a 1x1 output). :func:`values_above_int_max` finds such values in a
LayerParameter so that the net can refuse them, naming the field.
"""
from __future__ import annotations

from collections.abc import Iterator

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from ..membudget import INT_MAX

_WIDE = (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_INT64)
# fields Caffe keeps unsigned or wide: rand_skip (unsigned modulus), prefetch (a container size)
KEPT_UNSIGNED = frozenset({("DataParameter", "rand_skip"), ("ImageDataParameter", "rand_skip"),
                           ("DataParameter", "prefetch")})


def values_above_int_max(message: Message, prefix: str = "") -> Iterator[tuple[str, int]]:
    """Each (field path, value) in ``message`` whose value Caffe would read into an ``int`` past INT_MAX."""
    for field, value in message.ListFields():
        path = f"{prefix}{field.name}"
        repeated = field.is_repeated
        items = list(value) if repeated else [value]
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            for i, sub in enumerate(items):
                yield from values_above_int_max(sub, f"{path}[{i}]." if repeated else f"{path}.")
        elif field.type in _WIDE and (message.DESCRIPTOR.name, field.name) not in KEPT_UNSIGNED:
            for i, v in enumerate(items):
                if v > INT_MAX:
                    yield (f"{path}[{i}]" if repeated else path), int(v)
