"""Crash-safe file writes: write a temp file beside the target, fsync, then rename over it."""
from __future__ import annotations

import os
import tempfile
from collections.abc import Callable


def default_file_mode() -> int:
    """0666 minus the umask: the mode ``open(path, "w")`` would give (mkstemp's temp files are 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Let ``write(tmp_path)`` create the file at a temp path beside ``path``, then rename it into place.

    Readers see the old file or the new one, never a torn one; a crash leaves no partial target.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-" + os.path.basename(path) + ".", dir=directory)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp, default_file_mode())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically."""

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    atomic_write(path, write)
