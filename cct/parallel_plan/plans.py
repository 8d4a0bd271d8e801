"""Global configurations: data parallelism, OWT, the DeePa optimum, or a user's plan (a :class:`Plan`).

* ``data``: every layer split by sample over all workers (cct's data parallelism);
* ``owt``: Krizhevsky's "one weird trick": convolution and pooling by sample, fully-connected layers
  by output channel, over all workers;
* ``auto``: the configuration minimising Eq. 1 (:func:`~.search.solve`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .costs import PricedGraph
from .search import solve
from .split import PlanError, Split

STRATEGIES = ("data", "owt", "auto")


@dataclass
class Plan:
    """A global configuration: ``splits[node name]`` for a net on ``workers`` workers."""

    workers: int
    splits: dict[str, Split]
    strategy: str = "file"
    #: where the plan came from (a file name) and each node's line in it, for messages
    source: str = ""
    lines: dict[str, int] = field(default_factory=dict)

    def assignment(self, priced: PricedGraph) -> list[int]:
        """Each node's configuration index in ``priced``; a missing node or impossible split is an error."""
        where = f"{self.source}: " if self.source else ""
        if self.workers != priced.workers:
            raise PlanError(f"{where}the plan is for {self.workers} workers, this run has {priced.workers}")
        names = {n.name for n in priced.graph.nodes}
        unknown = sorted(set(self.splits) - names)
        if unknown:
            line = self.lines.get(unknown[0])
            raise PlanError(f"{where}{f'line {line}: ' if line else ''}no layer '{unknown[0]}' heads a node of this "
                            f"net (nodes: {', '.join(n.name for n in priced.graph.nodes)})")
        out = []
        for i, node in enumerate(priced.graph.nodes):
            if node.name not in self.splits:
                raise PlanError(f"{where}no configuration for layer '{node.name}'")
            k = priced.index_of(i, self.splits[node.name])
            if k is None:
                line = self.lines.get(node.name)
                raise PlanError(f"{where}{f'line {line}: ' if line else ''}layer '{node.name}' ({node.kind}, output "
                                f"{list(node.out_shape)}) cannot take {self.splits[node.name]}: it splits "
                                f"{', '.join(node.dims)} only, each degree at most the dimension, workers "
                                f"dividing {priced.workers}")
            out.append(k)
        return out


def _fixed(priced: PricedGraph, choose) -> Plan:
    splits = {}
    for i, node in enumerate(priced.graph.nodes):
        s = choose(node)
        if priced.index_of(i, s) is None:
            raise PlanError(f"layer '{node.name}' (output {list(node.out_shape)}) cannot be split as {s} on "
                            f"{priced.workers} workers")
        splits[node.name] = s
    return Plan(priced.workers, splits)


def data_parallel(priced: PricedGraph) -> Plan:
    """Every node split by sample over every worker."""
    plan = _fixed(priced, lambda node: Split(n=priced.workers))
    plan.strategy = "data"
    return plan


def one_weird_trick(priced: PricedGraph) -> Plan:
    """Fully-connected layers split by output channel, every other node by sample, over every worker."""
    plan = _fixed(priced, lambda node: Split(c=priced.workers) if node.kind == "fc" else Split(n=priced.workers))
    plan.strategy = "owt"
    return plan


def optimal(priced: PricedGraph) -> tuple[Plan, int]:
    """The DeePa optimum and how many nodes the eliminations left to enumerate."""
    sol = solve(priced.cost_graph())
    splits = {n.name: priced.splits[i][sol.assignment[i]] for i, n in enumerate(priced.graph.nodes)}
    return Plan(priced.workers, splits, "auto"), sol.residual


def plan_for(strategy: str, priced: PricedGraph) -> Plan:
    """The plan of ``strategy`` (``data``, ``owt`` or ``auto``)."""
    if strategy == "data":
        return data_parallel(priced)
    if strategy == "owt":
        return one_weird_trick(priced)
    if strategy == "auto":
        return optimal(priced)[0]
    raise PlanError(f"unknown parallelism '{strategy}': expected one of {', '.join(STRATEGIES)} or a plan file")
