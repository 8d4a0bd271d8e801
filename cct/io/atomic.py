"""Crash-safe file writes: write a temp file beside the target, fsync, then rename."""
from __future__ import annotations

import os
import tempfile


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that readers see the old or the new file, never a torn one."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-" + os.path.basename(path) + ".", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_tmp_path(path: str | os.PathLike) -> str:
    """A temp path in the same directory as ``path`` (for writers such as h5py that need a filename)."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-" + os.path.basename(path) + ".", dir=directory)
    os.close(fd)
    return tmp
