"""Omnivore (Hadjis et al., 2016): compute groups, the merged FC server, asynchrony as momentum,
and the automatic optimizer of Algorithm 1.

Modules, one job each:

- :mod:`.mapping`: the physical map's net split (data layers, conv phase, FC tail) from the net graph;
- :mod:`.he_model`: the hardware-efficiency model HE(g) = max(t_fc, (t_conv(k) + t_fc) / g) of 4.1/D.4;
- :mod:`.momentum`: Theorem 1 (implicit momentum 1 - 1/g), the event-driven simulation of g groups, the
  momentum fit of Figure 6 and the explicit-momentum compensation;
- :mod:`.optimizer`: Algorithm 1 with the cold start (E.4) and the pruned grid (E.3) over a
  :class:`~cct.omnivore.optimizer.TrialRunner`;
- :mod:`.mpi_exec`: execution on MPI ranks (FC server + conv model server, conv compute groups), over
  :mod:`cct.distributed`'s communicator with polled waits.
"""
from .he_model import HEModel
from .mapping import NetSplit, split_net
from .momentum import compensate_momentum, fit_momentum, implicit_momentum, simulate_async
from .optimizer import Decision, OmnivoreOptimizer, Trial, TrialRunner

__all__ = ["Decision", "HEModel", "NetSplit", "OmnivoreOptimizer", "Trial", "TrialRunner", "compensate_momentum",
           "fit_momentum", "implicit_momentum", "simulate_async", "split_net"]
