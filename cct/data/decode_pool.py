"""The thread pool that decodes images (JPEG/PNG records, image files) for the data loaders.

Decoding is deterministic and releases the GIL, so a batch's images are decoded side by side; the results
come back in order and the first error is raised as it would be serially.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def map_ordered(fn, items: list, parallel: bool = True) -> list:
    """``[fn(x) for x in items]``, on a shared thread pool for image decoding (order and errors kept)."""
    global _POOL
    workers = min(8, os.cpu_count() or 1)
    if not parallel or len(items) < 2 or workers < 2:
        return [fn(x) for x in items]
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cct-decode")
    return list(_POOL.map(fn, items))
