"""What every record loader shares: Caffe's restart message, the sharding of a record stream (Caffe's
``Skip()``) and the generator states a read state records.

Every loader counts the records it passes (``offset``, a counter of the whole record stream that never
wraps); a loader sharded as ``(start, count, period)`` keeps only the records whose offset modulo
``period`` lies in ``[start, start + count)`` and steps over the others.

A read state records the sharding it was taken under (``shard``); a snapshot of several ranks adds to each
rank's state the shared counter state (``shared``: the state of the rank that read furthest, where the next
global batch starts). A loader restoring a state taken under another sharding continues from ``shared``
(:func:`continued_state`): each rank's own position is only right for its own sharding (under data
parallelism rank 0 of N stops N-1 records before the global batch's end, a data layer split other than by
sample reads every record of the global batch on every rank, all from the same state).
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


def continued_state(state: dict, shard: tuple[int, int, int]) -> dict:
    """The read state a loader sharded as ``shard`` continues from: ``state``, or its shared counter state
    (``state["shared"]``) when ``state`` was taken under another sharding and a snapshot gave it one."""
    saved = state.get("shard")
    if saved is None or "shared" not in state or tuple(int(x) for x in saved) == tuple(shard):
        return state
    return state["shared"]
