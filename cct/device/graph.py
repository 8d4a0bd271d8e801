"""CUDA graphs of a training iteration: record the kernels of a step once, replay them every iteration.

A GPU step issued from Python is launch-bound (hundreds of small kernels, each a few microseconds of host
work). :class:`StepGraphs` runs named pieces of an iteration (the forward+backward pass, the update) on one
stream of its own: the first call of a piece runs it eagerly (warm-up: kernels compile, buffers are
allocated), the second captures it with ``Stream.begin_capture``/``end_capture`` and launches the graph, and
every later call launches that graph again. Everything a captured piece allocates comes from a memory pool
private to these graphs, so a replay reuses the very addresses the capture recorded and nothing else ever
receives them. GEMMs inside a capture go through :mod:`cct.device.cublas` (CuPy's wrappers refuse capture).

What may be captured is decided by the net (:func:`capture_blockers`): the layers that feed the net from the
host (data layers) run eagerly before each pass on the same stream; a layer that cannot run inside a graph
(a Python layer, HDF5 output, anything that reads device memory on the host) keeps the whole net eager, and
a capture that fails anyway (an operation CUDA refuses while capturing) is abandoned: the piece then runs
eagerly for the rest of the run. Both are logged once, naming the layer and the reason.

The stream is a blocking one, so work on CuPy's default stream (test nets, snapshots, reads at display) stays
ordered after the graphs without explicit synchronisation.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from . import cublas

log = logging.getLogger("cct")


def capture_blockers(layers: Sequence[Any]) -> list[str]:
    """Why the layers after the net's data layers cannot be captured: one ``'name (type): reason'`` per
    blocking layer (empty when the net can run as graphs)."""
    out = []
    started = False
    for layer in layers:
        if getattr(layer, "feeds_from_host", False) and not started:
            continue
        started = True
        if getattr(layer, "feeds_from_host", False):
            out.append(f"{layer.name} ({layer.type}): a data layer after the first compute layer")
        elif not getattr(layer, "capturable", True):
            out.append(f"{layer.name} ({layer.type}): {getattr(layer, 'capture_blocker', 'runs on the host')}")
    return out


def first_compute_layer(layers: Sequence[Any]) -> int:
    """Index of the first layer after the leading data layers (the first one a graph captures)."""
    for i, layer in enumerate(layers):
        if not getattr(layer, "feeds_from_host", False):
            return i
    return len(layers)


class StepGraphs:
    """Named pieces of a training iteration captured once and replayed (see module docstring)."""

    def __init__(self, what: str = "train net"):
        import cupy

        self.cupy = cupy
        self.what = what
        self.stream = cupy.cuda.Stream(non_blocking=False)
        self.pool = cupy.cuda.MemoryPool()
        self.graphs: dict[str, Any] = {}
        self.warm: set[str] = set()
        self.eager: dict[str, str] = {}  # piece -> why it runs eagerly

    @staticmethod
    def available() -> str | None:
        """None when graphs can be used here, else why not."""
        if not cublas.available():
            return "cuBLAS could not be bound (GEMMs cannot run inside a capture)"
        return None

    def run(self, name: str, fn: Callable[[], None]) -> None:
        """Run piece ``name`` (``fn`` issues its kernels) on the graphs' stream: eagerly on the first call,
        captured and launched on the second, replayed afterwards."""
        cupy = self.cupy
        graph = self.graphs.get(name)
        with self.stream:
            if graph is not None:
                graph.launch(self.stream)
                return
            if name in self.eager:
                fn()
                return
            with cupy.cuda.using_allocator(self.pool.malloc):
                if name not in self.warm:
                    fn()
                    self.warm.add(name)
                    return
                graph, failure = self._capture(fn)
                if graph is None:
                    self.eager[name] = failure
                    log.warning("CUDA graph of the %s's %s not used (capture failed: %s); it runs eagerly",
                                self.what, name, failure)
                    fn()  # nothing of the abandoned capture ran
                    return
            self.graphs[name] = graph
            log.info("CUDA graph of the %s's %s captured (%d nodes); replayed from now on", self.what, name,
                     graph_nodes(graph))
            graph.launch(self.stream)

    def _capture(self, fn: Callable[[], None]) -> tuple[Any, str | None]:
        """(graph, None) for ``fn``'s kernels captured on the stream, or (None, why) when CUDA or ``fn`` refused
        (the capture is always ended: the stream is usable afterwards)."""
        cupy = self.cupy
        # relaxed: the pool may still call cudaMalloc, and other threads (data prefetch) are not stopped
        mode = getattr(cupy.cuda.runtime, "streamCaptureModeRelaxed", None)
        try:
            if mode is None:
                self.stream.begin_capture()
            else:
                self.stream.begin_capture(mode)
        except Exception as e:
            return None, f"{type(e).__name__}: {e}"
        failure = None
        try:
            fn()
        except Exception as e:
            failure = f"{type(e).__name__}: {e}"
        try:
            graph = self.stream.end_capture()
        except Exception as e:  # a refused operation invalidated the capture
            return None, failure or f"{type(e).__name__}: {e}"
        return (None, failure) if failure else (graph, None)

    def forget(self) -> None:
        """Drop the captured graphs (a shape change): the next calls warm up and capture again."""
        self.graphs.clear()
        self.warm.clear()
        self.pool = self.cupy.cuda.MemoryPool()

    def synchronize(self) -> None:
        """Wait for everything issued on the graphs' stream."""
        self.stream.synchronize()


class DirectPieces:
    """:class:`StepGraphs`' interface without CUDA: every piece runs when it is called. What an iteration's
    decomposition into pieces does on a host array module (the CPU tests of that decomposition use it)."""

    def __init__(self):
        self.graphs: dict[str, Any] = {}
        self.eager: dict[str, str] = {}
        self.ran: list[str] = []

    def run(self, name: str, fn: Callable[[], None]) -> None:
        """Run piece ``name`` now."""
        self.ran.append(name)
        fn()

    def forget(self) -> None:
        """Nothing is recorded: nothing to drop."""


def graph_nodes(graph: Any) -> int:
    """Number of nodes (kernels, copies, memsets) in a captured CuPy graph, or -1 when it cannot be read."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
        count = ctypes.c_size_t(0)
        handle = getattr(graph, "graph", None)
        if handle is None:
            return -1
        status = lib.cuGraphGetNodes(ctypes.c_void_p(int(handle)), None, ctypes.byref(count))
        return int(count.value) if status == 0 else -1
    except (OSError, AttributeError, TypeError, ValueError):
        return -1
