"""Progress bars (tqdm) for long commands: count, rate and ETA, on a terminal only.

A bar is drawn only when its stream (stderr) is a terminal, the command did not turn it off
(``--noprogress``, ``--quiet``) and ``CCT_PROGRESS`` is not ``0``. Otherwise :class:`Progress` does
nothing, so a log redirected to a file (what ``cct parse_log`` reads) holds only glog lines.

While a bar is shown, the glog handlers that write to the same stream print through
``tqdm.write``: each log line is written whole on its own line and the bar is redrawn below it,
never mixed into it.

Why tqdm: it is small, pure Python, well kept, and computes smoothed rates and ETAs; the earlier
hand-written bar had neither. Nothing here is process-wide state: each bar is an object, and the
handlers it redirects are restored when it closes.
"""
from __future__ import annotations

import logging
import sys
from typing import IO, Any

from . import env

__all__ = ["Progress", "progress_enabled"]


def progress_enabled(requested: bool = True, stream: IO[str] | None = None) -> bool:
    """Whether a bar should be drawn on ``stream`` (default stderr): requested, a TTY, CCT_PROGRESS != 0."""
    if not requested or env.is_off("CCT_PROGRESS"):
        return False
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or not a file
        return False


class _BarSafeStream:
    """A stream for log handlers that writes through ``tqdm.write`` (clears the bar, redraws it after)."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream

    def write(self, s: str) -> int:
        from tqdm import tqdm

        tqdm.write(s, file=self.stream, end="")
        return len(s)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return True


class Progress:
    """A progress bar of ``total`` steps named ``desc``; a no-op unless :func:`progress_enabled`.

    Use as a context manager (or call :meth:`close`); :meth:`update` adds steps, :meth:`set` moves to an
    absolute count (e.g. the solver's iteration). ``total=None`` shows count and rate without an ETA.
    """

    def __init__(self, total: int | None, desc: str = "", unit: str = "it", enabled: bool = True,
                 stream: IO[str] | None = None, initial: int = 0, unit_scale: bool = False) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.enabled = progress_enabled(enabled, self.stream)
        self._bar: Any = None
        self._swapped: list[tuple[logging.StreamHandler, Any]] = []
        if not self.enabled:
            return
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc=desc, unit=unit, initial=initial, file=self.stream, leave=False,
                         dynamic_ncols=True, unit_scale=unit_scale, mininterval=0.2, smoothing=0.1)
        safe = _BarSafeStream(self.stream)
        for logger in (logging.getLogger("cct"), logging.getLogger()):
            for h in logger.handlers:
                if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) is self.stream:
                    self._swapped.append((h, h.setStream(safe)))

    @property
    def n(self) -> int:
        """Steps done so far (0 when disabled)."""
        return int(self._bar.n) if self._bar is not None else 0

    def update(self, n: int = 1) -> None:
        """Advance by ``n`` steps."""
        if self._bar is not None and n:
            self._bar.update(n)

    def set(self, value: int) -> None:
        """Move to ``value`` steps done."""
        if self._bar is not None and value != self._bar.n:
            self._bar.update(value - self._bar.n)

    def set_total(self, total: int | None) -> None:
        """Change the number of steps (e.g. once it is known)."""
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    def close(self) -> None:
        """Remove the bar and give the log handlers their stream back."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        for h, old in self._swapped:
            h.setStream(old)
        self._swapped = []

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
