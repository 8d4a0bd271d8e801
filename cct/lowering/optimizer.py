"""CcT's automatic lowering optimizer: pick the lowering with the least predicted time.

For each convolution the optimizer prices every lowering that :meth:`supports` the geometry
with :func:`cct.lowering.cost_model.predict_seconds` on the calibrated :class:`Machine`, and
picks the cheapest -- per pass (forward, data gradient, weight gradient) when mixing saves
more than ``min_gain`` of the total, else one lowering for all passes. All lowerings compute
the same function, so mixing them is exact.

An override (the engine's ``{layer_name: lowering}`` mapping, :attr:`cct.config.EngineConfig.overrides`,
or ``CCT_LOWERING``) wins over the model. :func:`plan_convolution` makes a layer's whole :class:`Plan`
(strategy per pass, then partitions and ``b_p`` by :func:`cct.lowering.chunking.choose_chunking`, close
calls settled by :mod:`cct.lowering.tune`); :func:`describe_plan` is its log line.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import blas
from .base import LoweringStrategy, get_strategy, strategy_names, supports
from .budget import max_batch_partition, memory_budget
from .calibrate import ensure_kernel_width_rate, load_machine
from .chunking import choose_chunking
from .cost_model import PASSES, Machine, best_batch_partition, chunked_seconds, predict_seconds
from .cost_model import strategy as priced_strategy
from .geometry import ConvGeometry
from .tune import TuneCache, cache_for, measure_partitions, refine


def candidates(geom: ConvGeometry, names: list[str] | None = None) -> list[str]:
    """Registered strategies that declare their operations and can compute ``geom``."""
    pool = names if names is not None else strategy_names()
    out = []
    for n in pool:
        s = priced_strategy(n)
        if supports(s, geom) and (names is not None or s.priced()):
            out.append(n)
    return out


def predictions(geom: ConvGeometry, batch: int, machine: Machine | None = None, pass_: str = "fwd",
                names: list[str] | None = None, budget: int | str | None = None,
                passes: tuple[str, ...] = PASSES) -> dict[str, float]:
    """Predicted seconds of ``pass_`` for every candidate lowering.

    Chunk-aware: every lowering is priced as the ``b_p``-image chunks
    :class:`~cct.lowering.partition.BatchedLowering` would run -- the chunk size with the least
    predicted time among those whose workspace fits the memory budget
    (:func:`cct.lowering.budget.memory_budget`), see
    :func:`cct.lowering.cost_model.best_batch_partition` -- for a layer running ``passes``.
    """
    machine = _machine(machine)
    return {n: _chunked_seconds(n, geom, batch, machine, pass_, budget, passes) for n in candidates(geom, names)}


def priced_chunk(name: str, geom: ConvGeometry, batch: int, machine: Machine, budget: int | str | None,
                 passes: tuple[str, ...] = PASSES) -> int:
    """The images per chunk :func:`predictions` prices ``name`` at: the fastest predicted chunk size for the
    passes the layer runs (the whole iteration, as BatchedLowering chooses it) among those whose workspace fits."""
    if batch <= 1:
        return max(batch, 1)
    cap = max_batch_partition(get_strategy(name), geom, batch, 4, budget, passes)
    run = name if tuple(passes) == PASSES else {p: name for p in passes}
    return best_batch_partition(run, geom, batch, machine, "total", max_bp=cap)[0]


def _chunked_seconds(name: str, geom: ConvGeometry, batch: int, machine: Machine, pass_: str,
                     budget: int | str | None, passes: tuple[str, ...] = PASSES) -> float:
    if batch <= 1:
        return predict_seconds(name, geom, max(batch, 1), machine, pass_)
    bp = priced_chunk(name, geom, batch, machine, budget, passes)
    return chunked_seconds(name, geom, batch, bp, machine, pass_)


@dataclass
class Plan:
    """One conv layer's plan: the strategy per pass, the batch chunk ``b_p``, the parallel batch
    partitions, and the predictions behind the choice (what :class:`BatchedLowering` executes).

    ``predictions[pass][name]``: predicted seconds of every candidate at its own best chunking;
    ``workspace[name]``: its peak temporary bytes at that chunking (times the partitions);
    ``budget``: the memory budget the plan was checked against (``fits``: the chosen workspace is
    within it -- False only when no candidate fits, then the smallest workspace was taken).
    """

    fwd: str
    bwd_data: str
    bwd_weights: str
    predictions: dict[str, dict[str, float]] = field(default_factory=dict)
    overridden: bool = False
    b_p: int = 0  # 0: not chosen (the executing wrapper chooses)
    partitions: int = 1
    workspace: dict[str, int] = field(default_factory=dict)
    budget: int = 0
    fits: bool = True
    passes: tuple[str, ...] = PASSES  # the passes the layer runs (no data gradient below a data layer)
    measured: dict[str, float] = field(default_factory=dict)  # {candidate: s} of a close call (tune.refine)
    partition_seconds: dict[int, float] = field(default_factory=dict)  # {p: s} measured for partitions="auto"

    @property
    def single(self) -> str | None:
        """The lowering name when every pass uses the same one, else None."""
        return self.fwd if self.fwd == self.bwd_data == self.bwd_weights else None

    @property
    def names(self) -> dict[str, str]:
        """``{pass: strategy name}``."""
        return {p: getattr(self, p) for p in PASSES}

    def strategy(self) -> LoweringStrategy:
        """A strategy object implementing this plan's passes (plain or :class:`PerPassLowering`)."""
        if self.single is not None:
            return get_strategy(self.single)
        bwd_data = get_strategy(self.bwd_data)  # one object for both gradients when they agree (fused backward)
        bwd_weights = bwd_data if self.bwd_weights == self.bwd_data else get_strategy(self.bwd_weights)
        return PerPassLowering(get_strategy(self.fwd), bwd_data, bwd_weights)

    def predicted(self, pass_: str) -> float:
        """Predicted seconds of the chosen lowering for ``pass_`` (or ``total``)."""
        if pass_ == "total":
            return sum(self.predicted(p) for p in self.passes)
        return self.predictions[pass_][getattr(self, pass_)]

    def chosen_workspace(self) -> int:
        """Peak temporary bytes of the chosen strategies (the largest of the passes)."""
        return max((self.workspace.get(n, 0) for n in set(self.names.values())), default=0)


def choose_plan(geom: ConvGeometry, batch: int, machine: Machine | None = None, per_pass: bool = True,
                min_gain: float = 0.05, override: str | None = None,
                names: list[str] | None = None, budget: int | str | None = None,
                passes: tuple[str, ...] = PASSES) -> Plan:
    """Pick the strategy (or one per pass, if that saves more than ``min_gain`` of the predicted total)
    among the candidates whose workspace fits the memory budget at one image per chunk; the fastest
    that fits wins (ZNNi's memory-aware choice). When none fits, the one with the smallest workspace."""
    machine = _machine(machine)
    cap = memory_budget(budget)
    preds = {p: predictions(geom, batch, machine, p, names, cap, passes) for p in PASSES}
    common = [n for n in preds["fwd"] if all(n in preds[p] for p in PASSES)]
    ws = {}
    for n in common:
        bp = max_batch_partition(get_strategy(n), geom, max(batch, 1), 4, cap, passes) if batch > 1 else 1
        ws[n] = int(priced_strategy(n).pass_workspace_bytes(geom, bp, tuple(passes), 4))
    if override:
        if not supports(get_strategy(override), geom):
            raise ValueError(f"lowering '{override}' cannot compute this convolution")
        return Plan(override, override, override, preds, overridden=True, workspace=ws, budget=cap,
                    fits=ws.get(override, 0) <= cap, passes=passes)
    if not common:
        raise ValueError("no lowering supports this convolution")
    fitting = [n for n in common if ws[n] <= cap]
    pool = fitting or [min(common, key=lambda n: (ws[n], n))]
    totals = {n: sum(preds[p][n] for p in passes) for n in pool}
    single = min(pool, key=lambda n: (totals[n], n))
    plan = Plan(single, single, single, preds, workspace=ws, budget=cap, fits=bool(fitting), passes=passes)
    if per_pass:
        best = {p: min(pool, key=lambda n, p=p: (preds[p][n], n)) for p in PASSES}
        for p in PASSES:
            if p not in passes:  # not run: share the weight gradient's strategy (one fused backward)
                best[p] = best["bwd_weights"] if p == "bwd_data" else single
        mixed = sum(preds[p][best[p]] for p in passes)
        if mixed < (1.0 - min_gain) * totals[single]:
            plan = Plan(best["fwd"], best["bwd_data"], best["bwd_weights"], preds, workspace=ws, budget=cap,
                        fits=bool(fitting), passes=passes)
    return plan


def machine_for_threads(threads: int) -> Machine:
    """The calibrated constants cached for ``threads`` BLAS threads (the nominal model when none are)."""
    return load_machine(measure_if_missing=False, threads=threads)


def plan_convolution(geom: ConvGeometry, batch: int, machine: Machine | None = None,
                     override: str | None = None, budget: int | str | None = None,
                     partitions: int | str = "model", threads: int | None = None, per_pass: bool = True,
                     min_gain: float = 0.05, machine_for: Callable[[int], Machine] | None = None,
                     passes: tuple[str, ...] = PASSES, names: list[str] | None = None,
                     tune: bool | Any = False) -> Plan:
    """The whole plan of one conv layer, chosen once: strategy per pass (:func:`choose_plan`), then
    the partition count and ``b_p`` (:func:`choose_chunking`; ``partitions`` an int fixes the count,
    ``"model"`` prices the candidates, ``"auto"`` measures them on the layer now,
    :func:`cct.lowering.tune.measure_partitions`). ``tune``: settle the close calls by running them
    (:func:`cct.lowering.tune.refine`; cached per calibrated machine, or in the given
    :class:`~cct.lowering.tune.TuneCache`)."""
    if machine is not None:
        machine = ensure_kernel_width_rate(machine, geom)
    plan = choose_plan(geom, batch, machine, per_pass=per_pass, min_gain=min_gain, override=override,
                       budget=budget, passes=passes, names=names)
    total = int(threads or max(1, blas.get_num_threads()))
    fixed = int(partitions) if isinstance(partitions, int) else (1 if total <= 1 or batch <= 1 else None)
    if machine is not None and machine_for is None:
        full = machine.threads

        def machine_for(t: int, _m=machine, _full=full) -> Machine:
            return _m if t == _full or getattr(_m, "nominal", False) else machine_for_threads(t)
    given = machine_for
    machine_for = machine_for_threads if given is None else (lambda t: ensure_kernel_width_rate(given(t), geom))
    if tune:
        def chunking(run: dict[str, str]) -> tuple[int, int]:
            return choose_chunking(run, geom, batch, total, plan.budget, fixed, machine_for)[:2]

        cache = tune if isinstance(tune, TuneCache) else cache_for(_machine(machine))
        plan = refine(plan, geom, batch, chunking, budget, cache)
    if partitions == "auto" and fixed is None:
        fixed, plan.partition_seconds = measure_partitions(plan.strategy, geom, batch, passes, total, machine_for,
                                                           plan.budget, cache=cache_for(_machine(machine)))
    run = {p: n for p, n in plan.names.items() if p in passes}
    p, bp, _t = choose_chunking(run, geom, batch, total, plan.budget, fixed, machine_for)
    plan.partitions, plan.b_p = p, bp
    names = set(plan.names.values())
    plan.workspace.update({n: int(priced_strategy(n).pass_workspace_bytes(geom, bp, tuple(passes), 4)) * p
                           for n in names})
    return plan


class PerPassLowering(LoweringStrategy):
    """A lowering that delegates each pass to a (possibly different) strategy."""

    name = "per-pass"

    def __init__(self, fwd: LoweringStrategy, bwd_data: LoweringStrategy, bwd_weights: LoweringStrategy):
        self.fwd, self.bwd_data, self.bwd_weights = fwd, bwd_data, bwd_weights
        self.name = f"per-pass({fwd.name},{bwd_data.name},{bwd_weights.name})"

    def supports(self, geom: ConvGeometry) -> bool:
        """True when all three delegates support ``geom``."""
        return all(supports(s, geom) for s in (self.fwd, self.bwd_data, self.bwd_weights))

    def forward(self, x: Any, w: Any, b: Any, geom: ConvGeometry) -> Any:
        return self.fwd.forward(x, w, b, geom)

    def backward_data(self, dy: Any, w: Any, geom: ConvGeometry) -> Any:
        return self.bwd_data.backward_data(dy, w, geom)

    def backward_weights(self, dy: Any, x: Any, geom: ConvGeometry) -> tuple[Any, Any]:
        return self.bwd_weights.backward_weights(dy, x, geom)

    def forward_into(self, x: Any, w: Any, b: Any, geom: ConvGeometry, out: Any) -> Any:
        """The forward delegate's result written into ``out``."""
        into = getattr(self.fwd, "forward_into", None)
        if into is not None:
            return into(x, w, b, geom, out)
        out[...] = self.fwd.forward(x, w, b, geom)
        return out

    def backward_into(self, dy: Any, x: Any, w: Any, geom: ConvGeometry, dw: Any = None, db: Any = None,
                      dx: Any = None) -> None:
        """``dw += ...``, ``db += ...`` by the weight delegate, ``dx[...] = ...`` by the data delegate
        (one fused call when both are the same lowering object)."""
        if self.bwd_weights is self.bwd_data and hasattr(self.bwd_data, "backward_into"):
            self.bwd_data.backward_into(dy, x, w, geom, dw=dw, db=db, dx=dx)
            return
        if dw is not None or db is not None:
            into = getattr(self.bwd_weights, "backward_into", None)
            if into is not None:
                into(dy, x, w, geom, dw=dw, db=db)
            elif dw is not None:
                wgeom = geom if db is not None else dataclasses.replace(geom, bias_term=False)
                gw, gb = self.bwd_weights.backward_weights(dy, x, wgeom)
                dw += gw.reshape(dw.shape)
                if db is not None:
                    db += gb
            else:
                db += dy.reshape(dy.shape[0], geom.channels_out, -1).sum(axis=(0, 2))
        if dx is not None:
            into = getattr(self.bwd_data, "backward_into", None)
            if into is not None:
                into(dy, None, w, geom, dx=dx)
            else:
                dx[...] = self.bwd_data.backward_data(dy, w, geom)

    def prepare(self, w: Any, geom: ConvGeometry, pass_: str) -> None:
        """The shared weight work of ``pass_``'s delegate."""
        getattr(self, pass_).prepare(w, geom, pass_)

    def pass_ops(self, geom: ConvGeometry, batch: int, pass_: str) -> list[tuple]:
        """The operations of ``pass_`` as its delegate declares them."""
        return getattr(self, pass_).pass_ops(geom, batch, pass_)

    def workspace_bytes(self, geom: ConvGeometry, batch: int, itemsize: int = 4) -> int:
        """The largest workspace of the three delegates."""
        return max(int(s.workspace_bytes(geom, batch, itemsize)) for s in (self.fwd, self.bwd_data, self.bwd_weights))


def _pretty(name: str) -> str:
    return f"type {name[4:]}" if name.startswith("type") and name[4:].isdigit() else name


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f} MiB"


def describe_plan(layer_name: str, plan: Plan) -> str:
    """The plan report of a conv layer (setup log, ``cct time``), e.g.
    ``conv1: direct, b_p=64 p=1 (predicted 3.1 ms = fwd 1.0 + bwd_data 1.1 + bwd_weights 1.0, workspace
    0.9 MiB of 4096.0 MiB; type 1 4.2 ms 12.0 MiB, fft 9.9 ms 30.1 MiB)``; a per-pass plan names each
    pass's strategy; ``[measured direct 3.4, fft 3.1 ms]`` the close candidates' iterations timed on the
    layer (:mod:`cct.lowering.tune`); ``[override]``, ``[over budget]`` flag overrides and budget misses."""
    names = plan.names
    run = plan.passes
    head = plan.single or ", ".join(f"{p} {_pretty(n)}" for p, n in names.items() if p in run)
    chunk = f", b_p={plan.b_p} p={plan.partitions}" if plan.b_p else ""
    parts = " + ".join(f"{p} {_ms(plan.predictions[p][names[p]])}" for p in run if names[p] in plan.predictions[p])
    total = sum(plan.predictions[p].get(names[p], 0.0) for p in run)
    line = (f"{layer_name}: {_pretty(head)}{chunk} (predicted {_ms(total)} ms = {parts}, workspace "
            f"{_mib(plan.chosen_workspace())} of {_mib(plan.budget)}")
    others = []
    for n in sorted(plan.predictions.get("fwd", {})):
        if n in names.values() or not all(n in plan.predictions[p] for p in run):
            continue
        t = sum(plan.predictions[p][n] for p in run)
        w = plan.workspace.get(n, 0)
        flag = " over budget" if plan.budget and w > plan.budget else ""
        others.append(f"{_pretty(n)} {_ms(t)} ms {_mib(w)}{flag}")
    line += ("; " + ", ".join(others) if others else "") + ")"
    if plan.measured:  # the close calls settled by running them: one iteration of the layer's passes each
        line += " [measured " + ", ".join(f"{_pretty(n)} {_ms(t)}" for n, t in sorted(plan.measured.items())) + " ms]"
    if plan.partition_seconds:  # partitions "auto": each count's iteration measured at setup
        timed = ", ".join(f"p={p} {_ms(t)}" for p, t in sorted(plan.partition_seconds.items()))
        line += f" [partitions measured {timed} ms]"
    if plan.overridden:
        line += " [override]"
    if not plan.fits:
        line += " [over budget: no strategy fits]"
    return line


def _machine(machine: Machine | None) -> Machine:
    if machine is not None:
        return machine
    return load_machine(measure_if_missing=True)
