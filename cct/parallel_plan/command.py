"""``cct plan``: choose each layer's parallelism for a net on W workers and write the plan file.

Without ``mpiexec`` the workers are those of ``--cluster`` (a described cluster: a model), or ``--workers``
on this machine linked by an in-process copy. Under ``mpiexec -n N`` the workers are the job's ranks and
the links are measured by an MPI ping-pong (cached). The setup log prints each node's configuration
with its predicted compute, update and transfer times, and the chosen plan next to data parallelism
and OWT.
"""
from __future__ import annotations

import argparse
import logging
import os

from ..distributed import launch, world
from ..flags import FlagParser
from ..tools import add_flag, run_tool, tool_parser
from .cluster import Cluster
from .compute import MeasuredCompute, ScaledCompute, compute_cache, reference_rates
from .graph import graph_from_net, planning_net
from .links import cluster_of_ranks, copy_bandwidth, measure_links
from .planfile import read_plan, write_plan
from .planner import PlanResult, plan_net
from .report import comparison, plan_table
from .split import PlanError

log = logging.getLogger("cct")


def build_parser() -> FlagParser:
    """The arguments of ``cct plan``."""
    p = tool_parser("plan", "Choose each layer's parallelism (DeePa: sample, height, width, channel splits) for "
                            "a net on several workers; write the plan file.", progress=False)
    add_flag(p, "model", required=True, help="the net prototxt")
    add_flag(p, "phase", default="TRAIN", help="the phase of the net to plan: TRAIN or TEST")
    add_flag(p, "batch", type=int, default=0, help="the global batch (0: the net's own)")
    add_flag(p, "workers", type=int, default=0, help="workers on this machine (0: the MPI ranks under mpiexec)")
    add_flag(p, "cluster", default="",
             help="a described cluster instead, e.g. 4x4,intra=10G,inter=1.25G,speed=100 (machines x workers, "
                  "bandwidths in bytes/s, worker speed relative to this machine): a model")
    add_flag(p, "parallel", default="auto", help="auto (the optimum), data, owt, or a plan file to price")
    add_flag(p, "compute", default="scaled",
             help="scaled: each layer measured once at --reference_batch samples, parts priced by their share; "
                  "measured: every part shape measured")
    add_flag(p, "reference_batch", type=int, default=8, help="samples each layer is measured on (scaled compute)")
    add_flag(p, "out", default="", help="write the chosen plan to this file")
    return p


def _cluster(a: argparse.Namespace, comm) -> Cluster:
    if a.cluster:
        if a.workers:
            raise PlanError("give --workers or --cluster, not both")
        return Cluster.parse(a.cluster)
    if comm is not None:
        return cluster_of_ranks(comm, measure_links(comm))
    if a.workers < 1:
        raise PlanError("--workers N (N >= 1), --cluster, or mpiexec -n N is needed")
    bw = copy_bandwidth()
    return Cluster(1, a.workers, bw, bw)


def _plan(a: argparse.Namespace, cluster: Cluster) -> PlanResult:
    net, net_batch = planning_net(a.model, a.phase)
    batch = a.batch or net_batch
    cache = compute_cache()
    if a.compute == "measured":
        model = MeasuredCompute(net, cache)
    else:
        model = ScaledCompute(reference_rates(net, graph_from_net(net, batch), max(1, a.reference_batch), cache),
                              cluster.speed)
    parallel = a.parallel if a.parallel in ("auto", "data", "owt") else read_plan(a.parallel)
    return plan_net(net, cluster, model, parallel, batch)


def run(a: argparse.Namespace) -> int:
    """``cct plan`` on parsed arguments."""
    comm = None
    if launch.under_mpi() and not a.cluster and not a.workers:
        comm = world()
    if a.compute not in ("scaled", "measured"):
        raise PlanError(f"--compute {a.compute!r}: expected scaled or measured")
    if not os.path.isfile(a.model):
        raise PlanError(f"--model {a.model}: no such file")
    cluster = _cluster(a, comm)  # under mpiexec every rank takes part in the ping-pong
    if comm is not None and comm.rank != 0:
        comm.barrier()  # rank 0 alone measures the layers (the others would share its cores) and plans
        return 0
    try:
        result = _plan(a, cluster)
    finally:  # an error on rank 0 still releases the others
        if comm is not None:
            comm.barrier()
    log.info("Planning %s on %s (%s compute)", a.model, cluster.describe(), a.compute)
    log.info("Search: %d nodes, %d left after node and edge elimination, %.3f s",
             len(result.priced.graph.nodes), result.residual, result.search_seconds)
    for line in plan_table(result.chosen):
        log.info("%s", line)
    shown = {k: v for k, v in result.estimates.items() if k != "chosen"}
    if result.plan.strategy == "file":
        shown["file"] = result.chosen
    for line in comparison(shown):
        log.info("%s", line)
    if a.out:
        t = result.chosen.totals()
        write_plan(a.out, result.plan, result.chosen,
                   [f"{a.model}, global batch {result.priced.graph.nodes[0].out_shape[0]}, {cluster.describe()}",
                    f"predicted step {t['seconds'] * 1e3:.3f} ms, {t['total_bytes'] / 2**20:.1f} MiB moved per step"],
                   {n.name: n.layers for n in result.priced.graph.nodes})
        log.info("Plan written to %s", a.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    return run_tool(run, build_parser(), argv)
