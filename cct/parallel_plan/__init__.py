"""Per-layer parallelism (DeePa, Jia et al. 2018): each layer's output split over workers by sample,
height, width and output channel, chosen to minimise the modelled step time; and the splits executed on
MPI ranks.

One module per job:

- :mod:`.split`: a configuration (:class:`Split`: degrees n, h, w, c) and the enumeration of a layer's;
- :mod:`.regions`: the input region each worker reads (convolution and pooling halos, LRN's channel
  window, grouped convolutions, Concat's channel ranges);
- :mod:`.graph`: the planner's graph of a net (element-wise layers follow their producer);
- :mod:`.transfer`: exact bytes and times of ``xfer(c_u, c_v)`` and ``update(c)``;
- :mod:`.compute`: ``compute(c)`` measured on part nets (cached per machine) or scaled from reference rates;
- :mod:`.cluster`, :mod:`.links`: described clusters (a model) and link bandwidths measured by an MPI ping-pong;
- :mod:`.costs`: every configuration priced; the step estimate of a global configuration;
- :mod:`.search`: node and edge elimination, residual enumeration, reverse recovery (section 4);
- :mod:`.plans`, :mod:`.planfile`, :mod:`.planner`, :mod:`.report`: data / OWT / optimal plans, plan files,
  planning a net, the setup-log table; :mod:`.command`: ``cct plan``;
- :mod:`.owt`: OWT training on MPI ranks (``cct train --parallel owt``);
- :mod:`.perlayer`, :mod:`.boxexchange`: any per-layer mix of configurations on MPI ranks, every change of
  configuration one point-to-point exchange of exactly the planner's regions;
- :mod:`.measured`: ``auto``'s measured pick;
  :mod:`.execute`: which plans ``cct train --parallel`` runs.
"""
from .cluster import Cluster
from .graph import PlanGraph, PlanNode, graph_from_net, planning_net
from .planfile import read_plan, write_plan
from .planner import PlanResult, plan_net
from .plans import Plan
from .search import CostGraph, Solution, solve
from .split import DIMS, PlanError, Split, enumerate_splits

__all__ = ["DIMS", "Cluster", "CostGraph", "Plan", "PlanError", "PlanGraph", "PlanNode", "PlanResult", "Solution",
           "Split", "enumerate_splits", "graph_from_net", "plan_net", "planning_net", "read_plan", "solve",
           "write_plan"]
