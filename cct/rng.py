"""Seeding from user code: reseed the current configuration's :class:`~cct.random_source.RandomSource`.

There is no process-global generator: a :class:`cct.config.Config` owns a source (the process default's
is what Caffe calls the process RNG), a net hands its source to its layers and a solver with a
``random_seed`` owns one of its own (see :mod:`cct.random_source`). ``cct.set_random_seed`` (and
pycaffe's ``caffe.set_random_seed``) reseed :func:`cct.config.current`'s source.
"""
from __future__ import annotations

import numpy as np

from .config import current


def set_random_seed(seed: int) -> None:
    """Reseed the current configuration's random source (Caffe's ``Caffe::set_random_seed``)."""
    current().random.seed(seed)


def get_rng() -> np.random.Generator:
    """The current configuration's generator (what a net built now, or a tool, draws from)."""
    return current().random.generator
