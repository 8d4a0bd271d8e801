"""Exceptions raised by cct. Every message names the file, line, layer or blob at fault."""
from __future__ import annotations


class CctError(Exception):
    """Base class of every error cct raises on bad input or bad use."""


class ProtoParseError(CctError):
    """A prototxt/caffemodel/solverstate that cannot be parsed (message carries file:line:column)."""


class LayerError(CctError):
    """A layer was configured or used wrongly; the message names the layer."""

    def __init__(self, layer_name: str, layer_type: str, message: str):
        self.layer_name = layer_name
        self.layer_type = layer_type
        self.message = message
        super().__init__(f"layer '{layer_name}' (type {layer_type}): {message}")

    def in_context(self, context: str) -> LayerError:
        """The same error with ``context`` (e.g. ``"iteration 12"``) appended to its message."""
        return LayerError(self.layer_name, self.layer_type, f"{self.message} ({context})")


class NetError(CctError):
    """The net graph is inconsistent (unknown bottom, duplicate top, sharing conflict...)."""


class SolverError(CctError):
    """Bad solver configuration or a failed training run."""


class MemoryBudgetError(CctError):
    """A blob larger than the memory budget or than INT_MAX elements, refused before allocation."""
