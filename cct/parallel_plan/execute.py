"""Which plans ``cct train`` executes, and setting a distributed solver up for one (``--parallel``).

The executed family: every layer split by sample over all N ranks (data parallelism) except, in any
combination (:mod:`.combined`): the fully-connected tail's InnerProduct layers (with the element-wise
layers between them) all split ``n=a, c=N/a`` (:func:`~.owt.enable_owt` with ``a`` sample groups; ``a =
1`` is OWT), convolutions split ``c=N`` by output channel (:mod:`.convsplit`), convolutions and poolings
split ``h=a w=N/a`` by height and width (:mod:`.spatial`). A plan file may use any member. ``auto``
prices the tail's splits with the cost model, logs the cheapest next to DeePa's unrestricted optimum,
then measures them on the ranks (:mod:`.measured`) with the optimum's convolution channel splits and
spatial splits, if it has any, as candidates of their own (every other layer by sample), and runs data
parallelism unless another candidate is measured faster by a margin (so ``auto`` is never meaningfully
slower than data parallelism); a plan file outside the family is refused, naming the
first layer that cannot be executed yet.
"""
from __future__ import annotations

import logging

from .. import blas
from .cluster import Cluster
from .combined import build_splits, describe, enable_splits
from .compute import ScaledCompute, compute_cache, reference_rates
from .convsplit import ConvChannelSplitExecutor, enable_conv_split
from .costs import PricedGraph, price
from .graph import graph_from_net
from .links import cluster_of_ranks, measure_links
from .measured import Candidate, measured_choice
from .owt import ChannelSplitExecutor, attach, enable_owt, tail_layers
from .planfile import read_plan
from .plans import Plan, optimal
from .report import comparison, plan_table
from .spatial import SpatialSplitExecutor, enable_spatial_split
from .split import PlanError, Split, divisors

log = logging.getLogger("cct")


def tail_plan(priced: PricedGraph, tail: set[str], groups: int) -> Plan:
    """The family member with ``groups`` sample groups in the tail (see module docstring)."""
    n = priced.workers
    splits = {node.name: Split(n=groups, c=n // groups) if node.name in tail else Split(n=n)
              for node in priced.graph.nodes}
    return Plan(n, splits, "data" if groups == n else "owt" if groups == 1 else f"tail n={groups}")


def channel_split_convs(plan: Plan, priced: PricedGraph) -> list[str]:
    """The convolution nodes ``plan`` splits by output channel over all workers (``c=N``), in net order."""
    n = priced.workers
    return [node.name for node in priced.graph.nodes
            if node.kind == "conv" and plan.splits.get(node.name) == Split(c=n)]


def spatial_split_layers(plan: Plan, priced: PricedGraph) -> dict[str, Split]:
    """The convolution and pooling nodes ``plan`` splits by height and width over all workers
    (``h=a w=N/a``, :mod:`.spatial`), in net order."""
    n = priced.workers
    return {node.name: s for node in priced.graph.nodes
            if node.kind in ("conv", "pool") and (s := plan.splits.get(node.name)) is not None
            and s.n == s.c == 1 and s.workers == n and s.h * s.w > 1}


def sample_groups_of(plan: Plan, priced: PricedGraph, tail: set[str]) -> int:
    """The tail's sample groups of ``plan`` if it is in the executed family; else a :class:`PlanError`.
    The family: every layer ``n=N`` except the tail's ``n=a c=N/a`` (one for all its layers), convolutions
    ``c=N`` (:mod:`.convsplit`) and convolutions and poolings ``h=a w=N/a`` (:mod:`.spatial`), in any
    combination (:mod:`.combined`)."""
    plan.assignment(priced)  # every node configured, each configuration possible
    n = priced.workers
    groups = {plan.splits[name].n for name in tail}
    below = set(channel_split_convs(plan, priced)) | set(spatial_split_layers(plan, priced))
    for node in priced.graph.nodes:
        s = plan.splits[node.name]
        if node.name in tail:
            ok = s.h == s.w == 1 and s.workers == n and len(groups) == 1
        else:
            ok = s == Split(n=n) or node.name in below
        if not ok:
            line = plan.lines.get(node.name)
            where = f"{plan.source}: line {line}: " if plan.source and line else ""
            raise PlanError(f"{where}layer '{node.name}' {s}: cct train executes plans whose layers are split n={n} "
                            f"except the fully-connected tail ({', '.join(sorted(tail))}), which takes one n=a c={n}/a "
                            f"for all its layers, convolutions split c={n} and convolutions and poolings h*w={n}; "
                            f"'cct plan --parallel FILE' prices any plan")
    return groups.pop()


def setup_parallel(solver, parallel: str) -> None:
    """Set a distributed ``solver`` up for ``--parallel`` (``data``, ``owt``, ``auto`` or a plan file)."""
    par = solver.parallel
    if parallel == "data" or par is None:
        if parallel != "data":
            log.info("--parallel %s on one process: nothing to split, the net runs whole", parallel)
        return
    if parallel == "owt":
        enable_owt(solver)
        return
    comm, n, net = par.comm, par.size, solver.net
    if parallel == "auto" and not any(layer.type == "InnerProduct" for layer in net.layers):
        if comm.is_root:
            log.info("--parallel auto: no fully-connected layer to split; every layer by sample (data parallel)")
        return
    tail = {net.layer_names[i] for i in tail_layers(net) if net.layers[i].type == "InnerProduct"}
    plan = None if parallel == "auto" else read_plan(parallel)
    cluster = cluster_of_ranks(comm, measure_links(comm))
    chosen = None
    if comm.is_root:
        chosen = _choose(solver, plan, tail, cluster)
    groups, convs, spatial = comm.bcast_obj(chosen)
    if plan is None and net.executor is not None:  # --devices: the tail splits cannot run with it yet
        if comm.is_root:
            log.info("--parallel auto: the train net has its own executor (--devices); data parallelism")
        return
    if plan is None:  # auto: the model's pick is checked against the measured candidates
        run_measured(solver, convs, spatial, groups)
        return
    if bool(convs) + bool(spatial) + (groups != n) > 1:
        enable_splits(solver, groups, convs, spatial)
    elif convs:
        enable_conv_split(solver, convs)
    elif spatial:
        enable_spatial_split(solver, spatial)
    elif groups != n:
        enable_owt(solver, groups)


def measured_candidates(solver, convs: list[str], spatial: dict[str, Split],
                        groups: int | None = None) -> dict[str, Candidate]:
    """``auto``'s candidates (name -> makes the executor it runs): data parallelism (``data``), the tail
    splits (``owt``, ``tail n=a``), and where DeePa's optimum uses them, its convolutions split by channel
    (``conv c=N``) and its convolutions and poolings split by height and width (``spatial``), every other
    layer by sample, and all of the optimum's executable parts together with its tail split ``n=groups``
    (``deepa``, when that is more than one part); a part the executors refuse (logged by the root) is
    left out."""
    par, net = solver.parallel, solver.net
    comm, n = par.comm, par.size
    groups = n if groups is None else groups
    out: dict[str, Candidate] = {}
    for a in sorted(divisors(n), reverse=True):
        out["data" if a == n else "owt" if a == 1 else f"tail n={a}"] = \
            (lambda: None) if a == n else (lambda a=a: ChannelSplitExecutor(net, comm, a))
    parts = {f"conv c={n}": (lambda: ConvChannelSplitExecutor(net, comm, convs)) if convs else None,
             "spatial": (lambda: SpatialSplitExecutor(net, comm, spatial)) if spatial else None}
    for name, make in parts.items():
        if make is None:
            continue
        try:
            make()  # local (no communication): the same answer on every rank
        except PlanError as e:
            if comm.is_root:
                log.info("--parallel auto: candidate '%s' of DeePa's optimum left out: %s", name, e)
            continue
        out[name] = make
    ok = [name for name in parts if name in out]
    if len(ok) + (groups != n) > 1:
        use_convs = convs if f"conv c={n}" in ok else []
        use_spatial = spatial if "spatial" in ok else {}
        out["deepa"] = lambda: build_splits(net, comm, groups, use_convs, use_spatial)
    return out


def run_measured(solver, convs: list[str], spatial: dict[str, Split], groups: int | None = None) -> str:
    """Measure :func:`measured_candidates` on the ranks and attach the pick (data parallelism unless another
    is faster by the margin); returns its name."""
    n = solver.parallel.size
    candidates = measured_candidates(solver, convs, spatial, groups)
    choice = measured_choice(solver, candidates, _rank_batch(solver.net))
    if choice == f"conv c={n}":
        enable_conv_split(solver, convs)
    elif choice == "spatial":
        enable_spatial_split(solver, spatial)
    elif choice == "deepa":
        ex = attach(solver, candidates["deepa"]())
        if solver.parallel.is_root:
            log.info("--parallel auto: running DeePa's executable parts: %s", describe(ex))
    elif choice != "data":
        enable_owt(solver, 1 if choice == "owt" else int(choice.split("=")[1]))
    return choice


def _uniform_tail(plan: Plan, tail: set[str], n: int) -> int:
    """The tail's sample groups ``a`` if ``plan`` splits every tail layer ``n=a c=N/a``, else ``n`` (by sample)."""
    splits = {plan.splits[name] for name in tail}
    s = next(iter(splits))
    return s.n if len(splits) == 1 and s.h == s.w == 1 and s.workers == n else n


def _rank_batch(net) -> int:
    """Each rank's samples (the batch at the fully-connected tail's input)."""
    return int(net.blobs[net.bottom_names[tail_layers(net)[0]][0]].shape[0])


def _choose(solver, plan: Plan | None, tail: set[str],
            cluster: Cluster) -> tuple[int, list[str], dict[str, Split]]:
    """(the tail's sample groups, the convolutions split by channel, the layers split by height and width)
    of the plan file, or of the model's cheapest family member (``plan`` None); logs the estimates."""
    net, n = solver.net, cluster.workers
    batch = _rank_batch(net)
    graph = graph_from_net(net, n * batch)
    with blas.blas_threads(1):  # each rank's share of this machine's cores
        rates = reference_rates(net, graph, batch, compute_cache())
    priced = price(graph, n, cluster.inv_bandwidth(), ScaledCompute(rates, cluster.speed))
    family = {a: tail_plan(priced, tail, a) for a in divisors(n)}
    estimates = {p.strategy: priced.estimate(p.assignment(priced)) for p in family.values()}
    convs: list[str] = []
    spatial: dict[str, Split] = {}
    if plan is not None:
        groups = sample_groups_of(plan, priced, tail)
        convs = channel_split_convs(plan, priced)
        spatial = spatial_split_layers(plan, priced)
        chosen = plan if convs or spatial else family[groups]
        if convs or spatial:
            estimates[plan.strategy] = priced.estimate(plan.assignment(priced))
    best, residual = optimal(priced)
    if plan is None:
        chosen = min(family.values(), key=lambda p: estimates[p.strategy].seconds)
        groups = chosen.splits[next(iter(tail))].n
        convs, spatial = channel_split_convs(best, priced), spatial_split_layers(best, priced)  # to measure
        groups = _uniform_tail(best, tail, n)
    shown = dict(estimates)
    shown["DeePa"] = priced.estimate(best.assignment(priced))
    log.info("Per-layer parallelism on %s: %s (predicted by the cost model)", cluster.describe(),
             "the plan file's" if plan is not None else "the model's cheapest executable plan")
    for line in plan_table(estimates[chosen.strategy]):
        log.info("%s", line)
    for line in comparison(shown):
        log.info("%s", line)
    log.info("DeePa's unrestricted optimum (%d nodes left after elimination) is priced, not executed: it splits %s",
             residual, ", ".join(f"{k} {v}" for k, v in best.splits.items() if v != Split(n=n)) or "nothing else")
    if plan is None and (convs or spatial):
        log.info("--parallel auto: measuring its executable parts as candidates too:%s%s",
                 f" convolutions {', '.join(convs)} by channel" if convs else "",
                 f" {', '.join(f'{k} {v}' for k, v in spatial.items())} by height/width" if spatial else "")
    return groups, convs, spatial
