"""Which plans ``cct train`` executes, and setting a distributed solver up for one (``--parallel``).

A plan file runs layer by layer (:mod:`.perlayer`): every Convolution, Pooling, InnerProduct, LRN, Softmax,
Concat, Eltwise, Split, SoftmaxWithLoss and data layer under its own configuration ``n=.. h=.. w=.. c=..`` over
the N ranks or a divisor of them (mixed factorisations included), every other layer by sample, each change of
configuration one exchange of exactly the planner's regions; what cannot run is refused naming the file, the
layer and its configuration.
``auto`` prices the fixed family -- the fully-connected tail's InnerProduct layers split ``n=a, c=N/a``
(``a = N``: data parallelism, ``a = 1``: OWT) -- and DeePa's optimum with the cost model, then measures them on the
ranks (:mod:`.measured`): the family, the optimum's convolution channel splits (``conv c=N``) and height/width
splits (``spatial``) alone, and the optimum itself layer by layer (``deepa``), each by :mod:`.perlayer`; it
runs data parallelism unless another candidate is measured faster by a margin (so ``auto`` is never
meaningfully slower than data parallelism).
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from .. import blas
from .cluster import Cluster
from .compute import ScaledCompute, compute_cache, reference_rates
from .costs import PricedGraph, price
from .graph import PlanNode, graph_from_net
from .links import cluster_of_ranks, measure_links
from .measured import Candidate, measured_choice
from .owt import ChannelSplitExecutor, attach, enable_owt, tail_layers
from .perlayer import PerLayerExecutor, build_per_layer, describe_splits, enable_per_layer, follower_refusal, refusal
from .planfile import read_plan
from .plans import Plan, optimal
from .report import comparison, plan_table
from .split import PlanError, Split, divisors

log = logging.getLogger("cct")


def tail_plan(priced: PricedGraph, tail: set[str], groups: int) -> Plan:
    """The family member with ``groups`` sample groups in the tail (see module docstring)."""
    n = priced.workers
    splits = {node.name: Split(n=groups, c=n // groups) if node.name in tail else Split(n=n)
              for node in priced.graph.nodes}
    return Plan(n, splits, "data" if groups == n else "owt" if groups == 1 else f"tail n={groups}")


def plan_splits(plan: Plan, priced: PricedGraph) -> dict[str, Split]:
    """The layers ``plan`` splits other than by sample over all workers (layer name -> Split), every node's
    configuration checked possible first; :class:`~.perlayer.PerLayerExecutor` refuses what it cannot run."""
    plan.assignment(priced)
    n = priced.workers
    return {name: s for name, s in plan.splits.items() if s != Split(n=n)}


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
    comm, net = par.comm, solver.net
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
    splits = comm.bcast_obj(chosen)
    if plan is None and net.executor is not None:  # --devices: the splits cannot run with it yet
        if comm.is_root:
            log.info("--parallel auto: the train net has its own executor (--devices); data parallelism")
        return
    if plan is None:  # auto: the model's pick is checked against the measured candidates
        run_measured(solver, splits)
        return
    try:
        enable_per_layer(solver, splits)
    except PlanError as e:
        raise PlanError(f"{plan.source}: {e}") from None


def measured_candidates(solver, best: dict[str, Split]) -> dict[str, Candidate]:
    """``auto``'s candidates (name -> makes the executor it runs): data parallelism (``data``), the tail
    splits (``owt``, ``tail n=a``), and where DeePa's optimum ``best`` (layer name -> Split, layers by sample
    left out) uses them, its convolutions split by channel (``conv c=N``) and its convolutions and poolings
    split by height and width (``spatial``), every other layer by sample, and the optimum itself, layer by
    layer (``deepa``, :mod:`.perlayer`); a candidate the executors refuse (logged by the root) is left out."""
    par, net = solver.parallel, solver.net
    comm, n = par.comm, par.size
    out: dict[str, Candidate] = {}
    for a in sorted(divisors(n), reverse=True):
        out["data" if a == n else "owt" if a == 1 else f"tail n={a}"] = \
            (lambda: None) if a == n else (lambda a=a: ChannelSplitExecutor(net, comm, a))
    types = dict(zip(net.layer_names, (layer.type for layer in net.layers)))
    convs = {k: s for k, s in best.items() if types.get(k) == "Convolution" and s == Split(c=n)}
    spatial = {k: s for k, s in best.items() if types.get(k) in ("Convolution", "Pooling") and s.n == s.c == 1
               and s.workers == n and s.h * s.w > 1}
    for name, splits in ((f"conv c={n}", convs), ("spatial", spatial), ("deepa", best)):
        if not splits or (name == "deepa" and splits in (convs, spatial)):
            continue
        try:
            PerLayerExecutor(net, comm, splits)  # local (no communication): the same answer on every rank
        except PlanError as e:
            if comm.is_root:
                log.info("--parallel auto: candidate '%s' of DeePa's optimum left out: %s", name, e)
            continue
        out[name] = lambda splits=splits: build_per_layer(net, comm, splits)
    return out


def run_measured(solver, best: dict[str, Split]) -> str:
    """Measure :func:`measured_candidates` on the ranks and attach the pick (data parallelism unless another
    is faster by the margin); returns its name."""
    candidates = measured_candidates(solver, best)
    choice = measured_choice(solver, candidates, _rank_batch(solver.net))
    if choice != "data":
        ex = attach(solver, candidates[choice]())
        if solver.parallel.is_root:
            log.info("--parallel auto: running %s: %s", choice, describe(ex))
    return choice


def _rank_batch(net) -> int:
    """Each rank's samples (the batch at the fully-connected tail's input)."""
    return int(net.blobs[net.bottom_names[tail_layers(net)[0]][0]].shape[0])


def executable(net, ranks: int) -> Callable[[PlanNode, Split], bool]:
    """Whether :mod:`.perlayer` runs a node of ``net`` under a configuration (:func:`~.perlayer.refusal` of its
    first layer, :func:`~.perlayer.follower_refusal` of the others): ``price``'s ``keep`` for the optimum
    ``auto`` executes (data layers by sample: a plan file may split them)."""
    layers = dict(zip(net.layer_names, net.layers))

    def runs(node: PlanNode, s: Split) -> bool:
        if node.kind == "source" and s != Split(n=ranks):  # auto measures its candidates on one data stream
            return False
        if refusal(layers[node.name], s, ranks) is not None:
            return False
        return s == Split(n=ranks) or all(follower_refusal(layers[m], s) is None for m in node.layers[1:])

    return runs


def check_plan(plan: Plan, net, ranks: int) -> None:
    """Refuse, naming the file, line, layer and configuration, a plan line :mod:`.perlayer` cannot run."""
    layers = dict(zip(net.layer_names, net.layers))
    for name, s in plan.splits.items():
        why = refusal(layers[name], s, ranks) if name in layers else None
        if why is not None:
            line = plan.lines.get(name)
            where = f"{plan.source}: line {line}: " if plan.source and line else ""
            raise PlanError(f"{where}layer '{name}' {s}: {why}")


def _choose(solver, plan: Plan | None, tail: set[str], cluster: Cluster) -> dict[str, Split]:
    """The layers split other than by sample (layer name -> Split) of the plan file, or of DeePa's optimum
    among the configurations :mod:`.perlayer` runs (``plan`` None: ``auto`` measures it beside the family);
    logs the estimates and DeePa's unrestricted optimum."""
    net, n = solver.net, cluster.workers
    batch = _rank_batch(net)
    graph = graph_from_net(net, n * batch)
    with blas.blas_threads(1):  # each rank's share of this machine's cores
        rates = reference_rates(net, graph, batch, compute_cache())
    compute = ScaledCompute(rates, cluster.speed)
    priced = price(graph, n, cluster.inv_bandwidth(), compute)
    family = {a: tail_plan(priced, tail, a) for a in divisors(n)}
    estimates = {p.strategy: priced.estimate(p.assignment(priced)) for p in family.values()}
    best, residual = optimal(priced)
    if plan is not None:
        check_plan(plan, net, n)
        splits = plan_splits(plan, priced)
        estimates[plan.strategy] = priced.estimate(plan.assignment(priced))
        chosen = plan.strategy
    else:
        runnable = price(graph, n, cluster.inv_bandwidth(), compute, keep=executable(net, n))
        run_best, _ = optimal(runnable)
        splits = plan_splits(run_best, runnable)
        estimates["deepa"] = runnable.estimate(run_best.assignment(runnable))
        chosen = min(family.values(), key=lambda p: estimates[p.strategy].seconds).strategy
    shown = dict(estimates)
    shown["DeePa"] = priced.estimate(best.assignment(priced))
    log.info("Per-layer parallelism on %s: %s (predicted by the cost model)", cluster.describe(),
             "the plan file's" if plan is not None else "the model's cheapest plan of the fixed family")
    for line in plan_table(estimates[chosen]):
        log.info("%s", line)
    for line in comparison(shown):
        log.info("%s", line)
    log.info("DeePa's unrestricted optimum (%d nodes left after elimination) splits %s", residual,
             ", ".join(f"{k} {v}" for k, v in best.splits.items() if v != Split(n=n)) or "nothing")
    if plan is None:
        log.info("--parallel auto: the optimum cct train executes ('deepa') splits %s; measured layer by layer "
                 "beside the family", ", ".join(f"{k} {v}" for k, v in splits.items()) or "nothing")
    return splits


def describe(ex) -> str:
    """What a split executor splits, for the log."""
    if isinstance(ex, PerLayerExecutor):
        return describe_splits(ex)
    return f"the fully-connected tail n={ex.sample_groups} c={ex.size}"
