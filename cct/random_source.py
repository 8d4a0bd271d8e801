"""The host random generator, owned by whoever draws from it (no process-global generator).

A :class:`RandomSource` holds one numpy ``Generator``. Who owns one (Caffe's semantics):

* the process default :class:`cct.config.Config` (and every copy made from it with ``replace``):
  :func:`cct.set_random_seed` / ``caffe.set_random_seed`` reseed the current configuration's source,
  as Caffe's ``Caffe::set_random_seed`` reseeds the process RNG;
* a :class:`cct.solver.Solver` whose ``random_seed >= 0`` makes a source of its own seeded with it
  (its nets and snapshots use it, so two solvers in one process do not disturb each other); without a
  seed it uses its configuration's source;
* a :class:`cct.net.Net` takes its configuration's source (or the ``random=`` it is given) and hands it
  to its layers before their setup: fillers, data layers' shuffles and crops, the key of the net's
  device random streams. A layer set up on its own draws from the current configuration's source.
"""
from __future__ import annotations

import numpy as np


class RandomSource:
    """One seedable numpy ``Generator`` (PCG64, as ``np.random.default_rng``).

    ``seed(s)`` starts a new generator, exactly ``np.random.default_rng(s)`` (its seed sequence too, from
    which nets spawn the keys of their device random streams: :func:`cct.device.random.key_from_host`),
    so hold the source, not its ``generator``, across a reseed. ``state()`` / ``restore(state)`` save and
    restore the generator's position (snapshots). ``RandomSource()`` is seeded from the operating system.
    """

    __slots__ = ("_generator",)

    def __init__(self, seed: int | None = None):
        self._generator = np.random.default_rng(None if seed is None else int(seed))

    @property
    def generator(self) -> np.random.Generator:
        """The numpy generator to draw from."""
        return self._generator

    def seed(self, seed: int) -> None:
        """Restart from ``seed`` (Caffe's ``random_seed``): a new generator, as ``np.random.default_rng(seed)``."""
        self._generator = np.random.default_rng(int(seed))

    def state(self) -> dict:
        """The generator's position (a dict numpy can restore; what solver snapshots save)."""
        return self._generator.bit_generator.state

    def restore(self, state: dict) -> None:
        """Continue from a position returned by :meth:`state`."""
        self._generator.bit_generator.state = state

    def __repr__(self) -> str:
        return f"RandomSource(at 0x{id(self):x})"
