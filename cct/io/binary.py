"""Reading binary protobuf files (caffemodel, solverstate, binaryproto) with errors that name the file."""
from __future__ import annotations

import os
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from ..errors import CctError, ProtoParseError

M = TypeVar("M", bound=Message)


def read_binary_message(path: str | os.PathLike, message: M, what: str) -> M:
    """Parse the file at ``path`` into ``message``; ``what`` names the kind of file in errors.

    A missing/unreadable file is a CctError, bytes that are not such a message a ProtoParseError
    (also when every byte went to unknown fields: a text prototxt, an HDF5 file, an image...).
    """
    source = os.fspath(path)
    try:
        with open(source, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise CctError(f"cannot read {what} '{source}': {e.strerror}") from None
    try:
        # upb has no 64 MB total-size limit (Caffe's C++ reader raises it to 2 GB); only nesting
        # depth is limited, and these messages are shallow.
        message.ParseFromString(raw)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise ProtoParseError(f"{source}: not a valid {what}: {e}") from None
    if raw and not message.ListFields():
        raise ProtoParseError(f"{source}: not a {what}: no {type(message).__name__} field found")
    return message
