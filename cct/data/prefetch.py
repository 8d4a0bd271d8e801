"""A small background prefetcher: one thread fills a bounded queue with batches.

``Prefetcher(produce, depth)`` calls ``produce(buffer)`` over and over in a daemon thread;
``buffer`` is a batch handed back with ``recycle()`` (or None), so batch arrays are reused
instead of reallocated (Caffe's free/full queue pair). ``get()`` returns the next batch in
order; an exception raised by ``produce`` is re-raised by ``get()`` in the consumer (and by
every later ``get()``). ``close()`` stops the thread cleanly; it is also called at interpreter
exit for prefetchers still running.
"""
from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

from ..errors import CctError

_POLL_S = 0.05
_LIVE: weakref.WeakSet[Prefetcher] = weakref.WeakSet()


class _Failure:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


class Prefetcher:
    """Runs ``produce(recycled_buffer_or_None) -> batch`` ahead of the consumer in a background thread."""

    def __init__(self, produce: Callable[[Any], Any], depth: int = 4, name: str = "cct-prefetch",
                 start: bool = True):
        if depth < 1:
            raise CctError(f"prefetch depth must be at least 1, got {depth}")
        self._produce = produce
        self._full: queue.Queue = queue.Queue(maxsize=depth)
        self._free: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = False
        _LIVE.add(self)
        if start:
            self.start()

    def start(self) -> None:
        """Start the background thread (once)."""
        if not self._started:
            self._started = True
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                buf = self._free.get_nowait()
            except queue.Empty:
                buf = None
            try:
                item: Any = self._produce(buf)
            except BaseException as e:  # noqa: B036 - handed to the consumer
                item = _Failure(e)
            while not self._stop.is_set():
                try:
                    self._full.put(item, timeout=_POLL_S)
                    break
                except queue.Full:
                    continue
            if isinstance(item, _Failure):
                return

    def get(self, timeout: float | None = None) -> Any:
        """The next batch (blocks); re-raises the producer's exception."""
        if self._failure is not None:
            raise self._failure
        if self._stop.is_set():
            raise CctError("prefetcher is closed")
        self.start()
        waited = 0.0
        while True:
            try:
                item = self._full.get(timeout=_POLL_S)
                break
            except queue.Empty:
                waited += _POLL_S
                if not self._thread.is_alive() and self._full.empty():
                    raise CctError("data prefetch thread stopped unexpectedly") from None
                if timeout is not None and waited >= timeout:
                    raise CctError(f"no batch from the data prefetch thread within {timeout} s") from None
        if isinstance(item, _Failure):
            self._failure = item.exc
            raise item.exc
        return item

    def recycle(self, item: Any) -> None:
        """Give a consumed batch back so the producer can refill its arrays."""
        if not self._stop.is_set():
            self._free.put(item)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread and wait for it (idempotent)."""
        self._stop.set()
        while True:  # unblock a producer waiting on a full queue
            try:
                self._full.get_nowait()
            except queue.Empty:
                break
        if self._started and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def thread_alive(self) -> bool:
        """True while the background thread runs."""
        return self._thread.is_alive()

    @property
    def closed(self) -> bool:
        """True once ``close()`` was called."""
        return self._stop.is_set()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@atexit.register
def _close_all() -> None:
    for p in list(_LIVE):
        p.close(timeout=2.0)
