"""The thread pool that decodes images (JPEG/PNG records, image files) for a data loader.

Decoding is deterministic and releases the GIL, so a batch's images are decoded side by side; the results
come back in order and the first error is raised as it would be serially. Each loader owns one pool (its
layer, and so its net, owns the loader) and stops its threads when it closes.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

#: threads of a pool at most (decoding a batch of small images gains nothing past this)
MAX_WORKERS = 8


class DecodePool:
    """``map`` over a batch's items on up to ``workers`` threads named ``cct-decode`` (default: the cores,
    at most :data:`MAX_WORKERS`), started on first use; :meth:`close` stops them (a later ``map`` starts them
    again)."""

    def __init__(self, workers: int | None = None) -> None:
        self.workers = int(workers) if workers is not None else min(MAX_WORKERS, os.cpu_count() or 1)
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    def map(self, fn: Callable[[Any], T], items: Sequence[Any], parallel: bool = True) -> list[T]:
        """``[fn(x) for x in items]``, side by side unless ``parallel`` is false, there is one item or one
        worker (order and errors kept)."""
        if not parallel or len(items) < 2 or self.workers < 2:
            return [fn(x) for x in items]
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="cct-decode")
            executor = self._executor
        return list(executor.map(fn, items))

    def close(self) -> None:
        """Stop the threads (a batch being decoded finishes first)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
