"""Checks on device data whose failures are recorded on the device and raised at a boundary.

A check such as "every label lies in [0, C)" needs the host to look at device memory when it is
written as ``if xp.any(bad): raise ...``: a GPU net would stop for the host in every forward pass,
and a CUDA graph could not capture the pass at all. :class:`DeviceChecks` offers the same check in
two modes:

* immediate (numpy nets, and any layer run outside a net): the check looks at the data at once
  and raises the layer's error right there, as it always has;
* deferred (device nets): the check writes the first failure -- the iteration (read from a device
  counter the solver advances), the check, the offending position and value -- into a small record
  array in device memory with array operations only. :meth:`DeviceChecks.take_failure` reads that
  record at a boundary (the solver's display, test, snapshot and end of ``step``; the end of a
  pycaffe-style ``Net.forward``) and turns it into the same error the immediate mode raises.

A layer that reads memory through a checked value (a label used as an index) must clip the index
so that a bad value cannot read out of bounds before the boundary reports it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..errors import LayerError
from .driver import array_module, to_host

if TYPE_CHECKING:
    from ..layers.base import Layer

#: formats the message of a failed check from the flat position and the value found there
Describe = Callable[[int, int], str]

# the record's fields (int64): set, iteration, check id, flat position, value
_SET, _ITERATION, _CHECK, _POSITION, _VALUE = range(5)
_RECORD_SIZE = 5


@dataclass(frozen=True)
class CheckFailure:
    """The first failed check since the record was last read: its iteration (the device counter's value
    when it failed) and the error naming layer, position and value."""

    iteration: int
    error: LayerError


def raise_first_failure(layer: Layer, xp, bad, values, describe: Describe) -> None:
    """Immediate mode: raise ``layer``'s error for the first True of ``bad`` (reads the data at once)."""
    if bool(xp.any(bad)):
        flat = int(xp.argmax(bad.reshape(-1)))
        raise layer.error(describe(flat, int(values.reshape(-1)[flat])))


def layer_check(layer: Layer, name: str, bad, values, describe: Describe) -> None:
    """Check on ``layer``'s data that no element of ``bad`` is True (see :meth:`DeviceChecks.fail_where`),
    through the checks of the layer's net, or at once for a layer run on its own (``layer.checks`` None)."""
    if layer.checks is None:
        raise_first_failure(layer, array_module(bad), bad, values, describe)
    else:
        layer.checks.fail_where(layer, name, bad, values, describe)


class DeviceChecks:
    """The checks of one net: immediate or deferred (see the module docstring).

    ``deferred`` may be switched (tests force the deferred mode on numpy nets); ``iteration`` is a 0-d
    int64 device array: the solver sets it with :meth:`set_iteration` and advances it with
    :meth:`advance` after each iteration's compute, so that a failure records the iteration it
    happened in, however late it is read.
    """

    def __init__(self, xp, deferred: bool):
        self.xp = xp
        self.deferred = deferred
        self.iteration = xp.zeros((), dtype=np.int64)
        self.record = xp.zeros(_RECORD_SIZE, dtype=np.int64)
        self._ids: dict[tuple[str, str], int] = {}
        self._checks: list[tuple[Layer, Describe]] = []

    def fail_where(self, layer: Layer, name: str, bad, values, describe: Describe) -> None:
        """Check that no element of the boolean array ``bad`` is True; ``values`` (same size, integers)
        holds what to report; ``describe(flat_position, value)`` writes the message. ``name`` tells
        one check of ``layer`` from another."""
        xp = self.xp
        if not self.deferred:
            raise_first_failure(layer, xp, bad, values, describe)
            return
        flat_bad = bad.reshape(-1)
        if flat_bad.size == 0:
            return  # nothing to check (an empty batch)
        check_id = self._register(layer, name, describe)
        position = xp.argmax(flat_bad)
        value = xp.take(values.reshape(-1), position).astype(np.int64)
        found = xp.stack([xp.ones_like(position), self.iteration, xp.full_like(position, check_id),
                          position, value])
        first = flat_bad.any() & (self.record[_SET] == 0)
        xp.copyto(self.record, found, where=first)

    def _register(self, layer: Layer, name: str, describe: Describe) -> int:
        """The check's id (host-side bookkeeping, no device work); keeps its latest ``describe``."""
        key = (layer.name, name)
        check_id = self._ids.get(key)
        if check_id is None:
            check_id = self._ids[key] = len(self._checks)
            self._checks.append((layer, describe))
        else:
            self._checks[check_id] = (layer, describe)
        return check_id

    def set_iteration(self, iteration: int) -> None:
        """Set the device iteration counter (between iterations)."""
        self.iteration.fill(iteration)

    def advance(self) -> None:
        """Count one iteration on the device (part of an iteration's compute)."""
        self.iteration += 1

    def take_failure(self) -> CheckFailure | None:
        """Read the record (a device->host transfer: call at boundaries only); the first failure since
        the last call, or None. Clears the record."""
        if not self._checks:
            return None  # only a deferred check registers itself: nothing can have been recorded
        record = [int(v) for v in to_host(self.record)]
        if not record[_SET]:
            return None
        self.record.fill(0)
        layer, describe = self._checks[record[_CHECK]]
        return CheckFailure(record[_ITERATION], layer.error(describe(record[_POSITION], record[_VALUE])))

