"""Per-layer parallelism (DeePa, Jia et al. 2018): each layer's output split over workers by sample,
height, width and output channel, chosen to minimise the modelled step time.

One module per job:

- :mod:`.split`: a configuration (:class:`Split`: degrees n, h, w, c) and the enumeration of a layer's;
- :mod:`.regions`: the input region each worker reads (convolution and pooling halos, LRN's channel
  window, Concat's channel ranges);
- :mod:`.graph`: the planner's graph of a net (element-wise layers follow their producer);
- :mod:`.transfer`: exact bytes and times of ``xfer(c_u, c_v)`` and ``update(c)``;
- :mod:`.search`: node and edge elimination, residual enumeration, reverse recovery (section 4).
"""
from .graph import PlanGraph, PlanNode, graph_from_net
from .search import CostGraph, Solution, solve
from .split import DIMS, PlanError, Split, enumerate_splits

__all__ = ["DIMS", "CostGraph", "PlanError", "PlanGraph", "PlanNode", "Solution", "Split", "enumerate_splits",
           "graph_from_net", "solve"]
