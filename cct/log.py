"""glog-style logging ("I1122 01:23:45.123456 1234 solver.py:42] ...") so Caffe's log parsers read cct logs."""
from __future__ import annotations

import logging
import sys
import time

_LEVEL_CHAR = {logging.DEBUG: "I", logging.INFO: "I", logging.WARNING: "W", logging.ERROR: "E", logging.CRITICAL: "F"}


def ostream_float(x: float) -> str:
    """A float as C++'s ostream prints it by default (6 significant digits): how Caffe's log lines show numbers."""
    return f"{float(x):g}"


class GlogFormatter(logging.Formatter):
    """Formats records as glog does: level char, MMDD, time with microseconds, pid, file:line]."""

    def format(self, record: logging.LogRecord) -> str:
        t = time.localtime(record.created)
        usec = int((record.created - int(record.created)) * 1e6)
        prefix = (f"{_LEVEL_CHAR.get(record.levelno, 'I')}{t.tm_mon:02d}{t.tm_mday:02d} "
                  f"{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d}.{usec:06d} {record.process:5d} "
                  f"{record.filename}:{record.lineno}] ")
        msg = record.getMessage()
        if record.exc_info:
            msg += "\n" + self.formatException(record.exc_info)
        return prefix + msg


class _StderrHandler(logging.StreamHandler):
    """A handler writing to whatever ``sys.stderr`` is when a record is emitted (not the object it was when
    the handler was made, which a caller or test harness may have replaced and closed since); a stream set
    with ``setStream`` (other than sys.stderr) is used instead until ``setStream(sys.stderr)``."""

    _override = None

    @property  # type: ignore[override]
    def stream(self):
        return self._override if self._override is not None else sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        self._override = None if value is sys.stderr else value


def init_log(level: int = logging.INFO, stream=None) -> logging.Logger:
    """Send cct's log to ``stream`` (default: the current stderr, as glog) in glog format; idempotent."""
    logger = logging.getLogger("cct")
    logger.setLevel(level)
    for h in list(logger.handlers):
        if getattr(h, "_cct_glog", False):
            logger.removeHandler(h)
    handler = logging.StreamHandler(stream) if stream is not None else _StderrHandler()
    handler.setFormatter(GlogFormatter())
    handler._cct_glog = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.propagate = False
    return logger
