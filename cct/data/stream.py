"""What every record loader shares: Caffe's restart message, the sharding of a record stream (Caffe's
``Skip()``) and the generator states a read state records.

Every loader counts the records it passes (``offset``, a counter of the whole record stream that never
wraps); a loader sharded as ``(start, count, period)`` keeps only the records whose offset modulo
``period`` lies in ``[start, start + count)`` and steps over the others.
"""
from __future__ import annotations

import numpy as np

#: what Caffe logs when a loader wraps around to its first record
RESTART_MSG = "Restarting data prefetching from start."


def rng_state(rng: np.random.Generator | None) -> dict | None:
    """The state of a layer's generator (None for none), for a data read state."""
    return None if rng is None else rng.bit_generator.state


def set_rng_state(rng: np.random.Generator | None, state: dict | None) -> None:
    """Restore a state from :func:`rng_state` (nothing when either is None)."""
    if rng is not None and state is not None:
        rng.bit_generator.state = state


def keeps(shard: tuple[int, int, int], offset: int) -> bool:
    """Whether a loader sharded as ``(start, count, period)`` keeps the record at stream ``offset``."""
    start, count, period = shard
    return start <= offset % period < start + count

