"""Plan a net: price every configuration on a cluster, then the chosen plan next to data parallelism and
OWT (what ``cct plan`` and the benchmark run)."""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..net import Net
from .cluster import Cluster
from .costs import ComputeModel, PricedGraph, StepEstimate, price
from .graph import graph_from_net
from .plans import Plan, data_parallel, one_weird_trick, optimal, plan_for


@dataclass
class PlanResult:
    """The chosen plan, its estimate, those of data parallelism and OWT, and how the search went."""

    plan: Plan
    estimates: dict[str, StepEstimate]
    priced: PricedGraph
    residual: int
    search_seconds: float

    @property
    def chosen(self) -> StepEstimate:
        """The estimate of :attr:`plan`."""
        return self.estimates["chosen"]


def plan_net(net: Net, cluster: Cluster, compute: ComputeModel, parallel: str | Plan = "auto",
             batch: int | None = None) -> PlanResult:
    """Price ``net`` (at global ``batch``; default the net's) on ``cluster`` and pick ``parallel``: ``auto``
    (the optimum), ``data``, ``owt`` or a :class:`Plan`. The estimates of all three strategies are kept."""
    graph = graph_from_net(net, batch)
    priced = price(graph, cluster.workers, cluster.inv_bandwidth(), compute)
    t = time.perf_counter()
    auto, residual = optimal(priced)
    search_s = time.perf_counter() - t
    plans = {"data": data_parallel(priced), "owt": one_weird_trick(priced), "auto": auto}
    if isinstance(parallel, Plan):
        chosen = parallel
    else:
        chosen = plans[parallel] if parallel in plans else plan_for(str(parallel), priced)  # (raises)
    estimates = {name: priced.estimate(p.assignment(priced)) for name, p in plans.items()}
    estimates["chosen"] = priced.estimate(chosen.assignment(priced))
    return PlanResult(chosen, estimates, priced, residual, search_s)
