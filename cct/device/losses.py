"""The solver's per-iteration losses, kept in device memory until a boundary reads them."""
from __future__ import annotations

import numpy as np

from .driver import to_host


class LossLog:
    """Up to ``capacity`` per-iteration losses (float32) in a device buffer, read in order by :meth:`take`.

    :meth:`append` writes on the device only (the slot is a device counter, so the same kernels serve
    every iteration); the host keeps the iteration number of each pending loss.
    """

    def __init__(self, xp, capacity: int):
        self.xp = xp
        self.capacity = max(1, int(capacity))
        self.values = xp.zeros(self.capacity, dtype=np.float32)
        self._slots = xp.arange(self.capacity)
        self._slot = xp.zeros((), dtype=self._slots.dtype)
        self.iterations: list[int] = []

    @property
    def full(self) -> bool:
        """True when the next :meth:`append` would find no free slot (read the log first)."""
        return len(self.iterations) >= self.capacity

    def append(self, iteration: int, loss) -> None:
        """Keep ``loss`` (a 0-d float32 array of the log's array module, or a host float32) for ``iteration``."""
        self.record(loss)
        self.note(iteration)

    def record(self, loss) -> None:
        """The device half of :meth:`append` (capturable in a CUDA graph: the slot is a device counter)."""
        self.xp.copyto(self.values, loss, where=self._slots == self._slot)
        self._slot += 1

    def note(self, iteration: int) -> None:
        """The host half of :meth:`append`: the iteration of the loss just recorded."""
        self.iterations.append(iteration)

    def take(self) -> list[tuple[int, np.float32]]:
        """The pending (iteration, loss) pairs in order (one device->host read); empties the log."""
        n = len(self.iterations)
        if not n:
            return []
        values = to_host(self.values[:n])
        taken = [(it, np.float32(v)) for it, v in zip(self.iterations, values)]
        self.iterations = []
        self._slot.fill(0)
        return taken

