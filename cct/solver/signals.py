"""SIGINT / SIGHUP during training, as Caffe's ``--sigint_effect`` / ``--sighup_effect``.

The handler only records that a signal arrived; the solver asks for the requested action between
iterations (and between test batches) and then stops, snapshots, or ignores it:

* ``stop``: finish the current iteration, snapshot (when ``snapshot_after_train``) and exit;
* ``snapshot``: write a snapshot and go on training;
* ``none``: ignore the signal.

Caffe's defaults are ``--sigint_effect=stop`` and ``--sighup_effect=snapshot``.
"""
from __future__ import annotations

import signal
import threading
from collections.abc import Callable

from ..errors import CctError

NONE = "none"
STOP = "stop"
SNAPSHOT = "snapshot"
EFFECTS = (STOP, SNAPSHOT, NONE)


def check_effect(effect: str) -> str:
    """Validate a ``--sig*_effect`` value (Caffe: 'Invalid signal effect "X" was specified')."""
    if effect not in EFFECTS:
        raise CctError(f"Invalid signal effect \"{effect}\" was specified (use stop, snapshot or none)")
    return effect


class SignalHandler:
    """Install SIGINT/SIGHUP handlers that record the signal; ``action()`` returns (and clears) the
    requested solver action. Use as a context manager to restore the previous handlers."""

    def __init__(self, sigint_effect: str = STOP, sighup_effect: str = SNAPSHOT):
        self.sigint_effect = check_effect(sigint_effect)
        self.sighup_effect = check_effect(sighup_effect)
        self._got_sigint = False
        self._got_sighup = False
        self._previous: dict[int, object] = {}
        self._installed = False

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            self._got_sigint = True
        else:
            self._got_sighup = True

    def install(self) -> SignalHandler:
        """Install the handlers (only possible from the main thread; elsewhere this is a no-op)."""
        if self._installed or threading.current_thread() is not threading.main_thread():
            return self
        sigs = [signal.SIGINT]
        if hasattr(signal, "SIGHUP"):
            sigs.append(signal.SIGHUP)
        for s in sigs:
            self._previous[s] = signal.signal(s, self._on_signal)
        self._installed = True
        return self

    def uninstall(self) -> None:
        """Restore the handlers that were in place before :meth:`install`."""
        if not self._installed:
            return
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()
        self._installed = False

    def action(self) -> str:
        """The requested action (SIGHUP checked first, as in Caffe); the signal flag is cleared."""
        if self._got_sighup:
            self._got_sighup = False
            return self.sighup_effect
        if self._got_sigint:
            self._got_sigint = False
            return self.sigint_effect
        return NONE

    def get_action_function(self) -> Callable[[], str]:
        """The function to hand to ``Solver.set_action_function``."""
        return self.action

    def __enter__(self) -> SignalHandler:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()
