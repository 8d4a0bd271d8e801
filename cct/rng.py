"""The one random number generator behind fillers, dropout, shuffling and crops.

``set_random_seed`` makes a whole run reproducible (Caffe's ``random_seed``).
"""
from __future__ import annotations

import numpy as np

_rng = np.random.default_rng()


def set_random_seed(seed: int) -> None:
    """Reseed cct's global generator."""
    global _rng
    _rng = np.random.default_rng(int(seed))


def get_rng() -> np.random.Generator:
    """The global generator (numpy Generator)."""
    return _rng


def get_state() -> dict:
    """Snapshot of the generator state (for solver snapshots)."""
    return _rng.bit_generator.state


def set_state(state: dict) -> None:
    """Restore a state returned by ``get_state``."""
    _rng.bit_generator.state = state
