"""Crash-safe file writes: write a temp file beside the target, fsync, then rename over it.

The temp file is ``.tmp-<target name>.<pid>-<random>`` in the target's directory. A process killed
while writing leaves it behind; the next write of the same target (and a solver starting into the
same snapshot prefix, :func:`remove_stale_temps`) removes such files whose writing process is gone.
"""
from __future__ import annotations

import glob
import os
import tempfile
import time
from collections.abc import Callable

TEMP_PREFIX = ".tmp-"
# A temp file whose name carries no pid (older cct versions) is stale once untouched this long.
UNKNOWN_WRITER_AGE_S = 3600.0


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
    remove_stale_temps(directory, os.path.basename(path))
    fd, tmp = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{os.path.basename(path)}.{os.getpid()}-", dir=directory)
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


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def _is_stale(tmp: str, now: float) -> bool:
    """Whether the writer of ``tmp`` is gone: its pid (from the name) is not running, or, for a name
    without a pid, it has not been touched for :data:`UNKNOWN_WRITER_AGE_S`."""
    tail = os.path.basename(tmp).rsplit(".", 1)[-1]
    pid_text, dash, _ = tail.partition("-")
    if dash and pid_text.isdigit():
        return not _pid_alive(int(pid_text))
    try:
        return now - os.path.getmtime(tmp) > UNKNOWN_WRITER_AGE_S
    except OSError:
        return False


def remove_stale_temps(directory: str | os.PathLike, name_prefix: str) -> list[str]:
    """Remove the temp files that :func:`atomic_write` left in ``directory`` for targets whose name
    starts with ``name_prefix``, when their writer is gone (killed mid-write). Returns the paths
    removed. A temp file of a live writer (this process included) is never touched."""
    pattern = os.path.join(glob.escape(os.fspath(directory)), glob.escape(TEMP_PREFIX + name_prefix) + "*")
    removed = []
    now = time.time()
    for tmp in glob.glob(pattern):
        if _is_stale(tmp, now):
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                continue
            except OSError:
                continue  # not ours to remove (permissions): leave it
            removed.append(tmp)
    return removed
