"""Eq. 1's terms for every configuration of a plan graph: ``compute(c)``, ``update(c)`` per node and
``xfer(c_u, c_v)`` per edge, in seconds and bytes, and the step estimate of a global configuration."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .graph import PlanGraph, PlanNode
from .search import CostGraph
from .split import DIMS, Split, enumerate_splits
from .transfer import EdgeCost, edge_cost, loss_reduction_cost, update_cost


class ComputeModel(Protocol):
    """Prices ``compute(c)``: :class:`~.compute.MeasuredCompute` or :class:`~.compute.ScaledCompute`."""

    def seconds(self, graph: PlanGraph, index: int, splits: list[Split]) -> np.ndarray: ...


@dataclass
class NodeEstimate:
    """One node's share of a step under its chosen configuration."""

    name: str
    split: Split
    compute_s: float
    update_s: float
    xfer_s: float
    xfer_bytes: float
    update_bytes: float


@dataclass
class StepEstimate:
    """The modelled step of a global configuration (Eq. 1) with its per-node rows."""

    nodes: list[NodeEstimate]

    @property
    def seconds(self) -> float:
        """Predicted step time (compute + update + transfers, nothing overlapped)."""
        return sum(n.compute_s + n.update_s + n.xfer_s for n in self.nodes)

    @property
    def xfer_bytes(self) -> float:
        """Bytes of activations and their gradients moved between workers per step."""
        return sum(n.xfer_bytes for n in self.nodes)

    @property
    def update_bytes(self) -> float:
        """Bytes moved reducing parameter gradients per step."""
        return sum(n.update_bytes for n in self.nodes)

    @property
    def total_bytes(self) -> float:
        """All bytes moved between workers per step."""
        return self.xfer_bytes + self.update_bytes

    def totals(self) -> dict[str, float]:
        """``{seconds, compute_s, update_s, xfer_s, xfer_bytes, update_bytes, total_bytes}``."""
        return {"seconds": self.seconds, "compute_s": sum(n.compute_s for n in self.nodes),
                "update_s": sum(n.update_s for n in self.nodes), "xfer_s": sum(n.xfer_s for n in self.nodes),
                "xfer_bytes": self.xfer_bytes, "update_bytes": self.update_bytes, "total_bytes": self.total_bytes}


@dataclass
class PricedGraph:
    """A plan graph with every configuration of every node priced for ``workers`` workers."""

    graph: PlanGraph
    workers: int
    splits: list[list[Split]]
    compute: list[np.ndarray]
    update: list[EdgeCost]
    edges: list[tuple[tuple[int, int, int, int], EdgeCost]]

    def cost_graph(self) -> CostGraph:
        """The search problem: node costs ``compute + update``, edge costs ``xfer`` (seconds)."""
        return CostGraph([c + u.seconds[0] for c, u in zip(self.compute, self.update)],
                         [(e[0], e[2], cost.seconds) for e, cost in self.edges])

    def index_of(self, node: int, split: Split) -> int | None:
        """The index of ``split`` among node ``node``'s configurations (None: not one of them)."""
        try:
            return self.splits[node].index(split)
        except ValueError:
            return None

    def estimate(self, assignment: list[int]) -> StepEstimate:
        """Per node: compute, update, and the transfers into it (forward and backward)."""
        xs = np.zeros(len(self.splits))
        xb = np.zeros(len(self.splits))
        for (u, _, v, _), cost in self.edges:
            xs[v] += cost.seconds[assignment[u], assignment[v]]
            xb[v] += cost.bytes[assignment[u], assignment[v]]
        return StepEstimate([NodeEstimate(n.name, self.splits[i][assignment[i]], float(self.compute[i][assignment[i]]),
                                          float(self.update[i].seconds[0, assignment[i]]), float(xs[i]), float(xb[i]),
                                          float(self.update[i].bytes[0, assignment[i]]))
                             for i, n in enumerate(self.graph.nodes)])


def price(graph: PlanGraph, workers: int, inv_bw: np.ndarray, compute: ComputeModel,
          keep: Callable[[PlanNode, Split], bool] | None = None) -> PricedGraph:
    """Every configuration of every node (:func:`~.split.enumerate_splits`; a data layer may take any; only
    those ``keep`` accepts when given) and its costs on ``workers`` workers linked by ``inv_bw`` (seconds
    per byte between worker pairs)."""
    splits = [enumerate_splits(workers, n.out_shape, DIMS if n.kind == "source" else n.dims) for n in graph.nodes]
    if keep is not None:
        splits = [[s for s in options if keep(n, s)] for n, options in zip(graph.nodes, splits)]
    comp = [compute.seconds(graph, i, s) for i, s in enumerate(splits)]
    upd = [update_cost(n.param_bytes, s, inv_bw) for n, s in zip(graph.nodes, splits)]
    for k, (n, s) in enumerate(zip(graph.nodes, splits)):
        if n.kind in ("loss", "metric"):  # a split loss's (Accuracy's) reductions over channels
            red = loss_reduction_cost(n.out_shape, s, graph.itemsize, inv_bw)
            upd[k] = EdgeCost(upd[k].bytes + red.bytes, upd[k].seconds + red.seconds)
    edges = [(e, edge_cost(graph, e, splits[e[0]], splits[e[2]], inv_bw)) for e in graph.edges()]
    return PricedGraph(graph, workers, splits, comp, upd, edges)
