"""CcT's automatic lowering optimizer: pick the lowering with the least predicted time.

For each convolution the optimizer prices every lowering that :meth:`supports` the geometry
with :func:`cct.lowering.cost_model.predict_seconds` on the calibrated :class:`Machine`, and
picks the cheapest -- per pass (forward, data gradient, weight gradient) when mixing saves
more than ``min_gain`` of the total, else one lowering for all passes. All lowerings compute
the same function, so mixing them is exact.

Overrides: a ``{layer_name: lowering}`` mapping, or the ``CCT_LOWERING`` environment variable
(``type1`` for every layer, or ``conv1=type3,conv5=type1``); an override wins over the model.

Log line format (:func:`describe_choice`)::

    conv5: lowering type 3 (predicted fwd 11.2 ms; type 1 13.0, type 2 12.1)
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import type2, type3  # noqa: F401  (register "type2" / "type3")
from .base import LoweringStrategy, get_strategy, strategy_names
from .cost_model import KNOWN_TYPES, PASSES, Machine, best_batch_partition, chunked_seconds, predict_seconds
from .geometry import ConvGeometry


def supports(strategy: LoweringStrategy, geom: ConvGeometry) -> bool:
    """``strategy.supports(geom)`` when the strategy defines it, else True."""
    fn = getattr(strategy, "supports", None)
    return True if fn is None else bool(fn(geom))


def candidates(geom: ConvGeometry, names: list[str] | None = None) -> list[str]:
    """Registered lowerings with a cost model that can compute ``geom``."""
    pool = names if names is not None else [n for n in strategy_names() if n in KNOWN_TYPES]
    return [n for n in pool if supports(get_strategy(n), geom)]


def predictions(geom: ConvGeometry, batch: int, machine: Machine | None = None, pass_: str = "fwd",
                names: list[str] | None = None, budget: int | str | None = None) -> dict[str, float]:
    """Predicted seconds of ``pass_`` for every candidate lowering.

    Chunk-aware: every lowering is priced as the ``b_p``-image chunks
    :class:`~cct.lowering.partition.BatchedLowering` would run -- the chunk size with the least
    predicted time among those whose workspace fits the memory budget
    (:func:`cct.lowering.partition.memory_budget`), see
    :func:`cct.lowering.cost_model.best_batch_partition`.
    """
    machine = _machine(machine)
    return {n: _chunked_seconds(n, geom, batch, machine, pass_, budget) for n in candidates(geom, names)}


def _chunked_seconds(name: str, geom: ConvGeometry, batch: int, machine: Machine, pass_: str,
                     budget: int | str | None) -> float:
    from .partition import max_batch_partition

    if batch <= 1:
        return predict_seconds(name, geom, max(batch, 1), machine, pass_)
    cap = max_batch_partition(get_strategy(name), geom, batch, 4, budget)
    # the chunk size is chosen once for the whole iteration (all three passes), as BatchedLowering does
    bp, _ = best_batch_partition(name, geom, batch, machine, "total", max_bp=cap)
    return chunked_seconds(name, geom, batch, bp, machine, pass_)


def choose_lowering(geom: ConvGeometry, batch: int, machine: Machine | None = None, pass_: str = "fwd",
                    names: list[str] | None = None, override: str | None = None,
                    budget: int | str | None = None) -> tuple[str, dict[str, float]]:
    """``(name, {name: predicted seconds})``: the cheapest lowering for ``pass_``.

    ``pass_``: ``fwd``, ``bwd_data``, ``bwd_weights`` or ``total``. ``override`` (a lowering
    name) is returned as is when it supports ``geom`` (ValueError otherwise).
    """
    preds = predictions(geom, batch, machine, pass_, names, budget)
    if override:
        if not supports(get_strategy(override), geom):
            raise ValueError(f"lowering '{override}' cannot compute this convolution")
        return override, preds
    if not preds:
        raise ValueError("no lowering supports this convolution")
    best = min(preds, key=lambda n: (preds[n], n))
    return best, preds


@dataclass
class LoweringPlan:
    """The chosen lowering per pass and the predictions behind the choice."""

    fwd: str
    bwd_data: str
    bwd_weights: str
    predictions: dict[str, dict[str, float]] = field(default_factory=dict)
    overridden: bool = False

    @property
    def single(self) -> str | None:
        """The lowering name when every pass uses the same one, else None."""
        return self.fwd if self.fwd == self.bwd_data == self.bwd_weights else None

    def strategy(self) -> LoweringStrategy:
        """A strategy object implementing this plan (plain or :class:`PerPassLowering`)."""
        if self.single is not None:
            return get_strategy(self.single)
        bwd_data = get_strategy(self.bwd_data)  # one object for both gradients when they agree (fused backward)
        bwd_weights = bwd_data if self.bwd_weights == self.bwd_data else get_strategy(self.bwd_weights)
        return PerPassLowering(get_strategy(self.fwd), bwd_data, bwd_weights)

    def predicted(self, pass_: str) -> float:
        """Predicted seconds of the chosen lowering for ``pass_`` (or ``total``)."""
        if pass_ == "total":
            return sum(self.predicted(p) for p in PASSES)
        return self.predictions[pass_][getattr(self, pass_)]


def choose_plan(geom: ConvGeometry, batch: int, machine: Machine | None = None, per_pass: bool = True,
                min_gain: float = 0.05, override: str | None = None,
                names: list[str] | None = None, budget: int | str | None = None) -> LoweringPlan:
    """Pick the lowering(s) for a layer: one for all passes, or one per pass if that saves
    more than ``min_gain`` (fraction) of the predicted total."""
    machine = _machine(machine)
    preds = {p: predictions(geom, batch, machine, p, names, budget) for p in PASSES}
    if override:
        if not supports(get_strategy(override), geom):
            raise ValueError(f"lowering '{override}' cannot compute this convolution")
        return LoweringPlan(override, override, override, preds, overridden=True)
    common = [n for n in preds["fwd"] if all(n in preds[p] for p in PASSES)]
    if not common:
        raise ValueError("no lowering supports this convolution")
    totals = {n: sum(preds[p][n] for p in PASSES) for n in common}
    single = min(common, key=lambda n: (totals[n], n))
    if per_pass:
        best = {p: min(preds[p], key=lambda n, p=p: (preds[p][n], n)) for p in PASSES}
        mixed = sum(preds[p][best[p]] for p in PASSES)
        if mixed < (1.0 - min_gain) * totals[single]:
            return LoweringPlan(best["fwd"], best["bwd_data"], best["bwd_weights"], preds)
    return LoweringPlan(single, single, single, preds)


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

    def cost(self, geom: ConvGeometry, batch: int, machine: Any = None) -> float:
        return self.fwd.cost(geom, batch, machine)


def _pretty(name: str) -> str:
    return f"type {name[4:]}" if name.startswith("type") and name[4:].isdigit() else name


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def describe_choice(layer_name: str, name: str | LoweringPlan, preds: Mapping[str, float] | None = None,
                    pass_: str = "fwd") -> str:
    """The optimizer's log line, e.g.
    ``conv5: lowering type 3 (predicted fwd 11.2 ms; type 1 13.0, type 2 12.1)``.

    Accepts ``(layer, name, predictions, pass_)`` or ``(layer, plan)``; a per-pass plan adds
    one clause per pass whose choice differs from the forward one.
    """
    if isinstance(name, LoweringPlan):
        plan = name
        line = describe_choice(layer_name, plan.fwd, plan.predictions.get("fwd", {}), "fwd")
        extra = []
        for p in ("bwd_data", "bwd_weights"):
            chosen = getattr(plan, p)
            if chosen != plan.fwd:
                others = ", ".join(f"{_pretty(n)} {_ms(v)}" for n, v in sorted(plan.predictions[p].items())
                                   if n != chosen)
                extra.append(f"{p} {_pretty(chosen)} (predicted {_ms(plan.predictions[p][chosen])} ms; {others})")
        if plan.overridden:
            line += " [override]"
        return line + ("; " + "; ".join(extra) if extra else "")
    preds = dict(preds or {})
    head = f"{layer_name}: lowering {_pretty(name)}"
    if name not in preds:
        return head
    others = ", ".join(f"{_pretty(n)} {_ms(v)}" for n, v in sorted(preds.items()) if n != name)
    return f"{head} (predicted {pass_} {_ms(preds[name])} ms" + (f"; {others})" if others else ")")


def parse_overrides(spec: str | None = None) -> dict[str, str]:
    """Parse ``CCT_LOWERING`` (or ``spec``): ``"type1"`` -> ``{"*": "type1"}``;
    ``"conv1=type3,conv5=type1"`` -> per-layer mapping."""
    spec = os.environ.get("CCT_LOWERING", "") if spec is None else spec
    out: dict[str, str] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if "=" in part:
            k, v = part.split("=", 1)
            out[k.strip()] = v.strip()
        else:
            out["*"] = part
    for v in out.values():
        get_strategy(v)  # KeyError naming the known lowerings
    return out


def lowering_for_layer(layer_name: str, geom: ConvGeometry, batch: int, machine: Machine | None = None,
                       overrides: Mapping[str, str] | None = None, per_pass: bool = True,
                       min_gain: float = 0.05,
                       budget: int | str | None = None) -> tuple[LoweringStrategy, LoweringPlan, str]:
    """``(strategy, plan, log line)`` for one conv layer (what an engine calls at setup)."""
    ov = dict(parse_overrides()) if overrides is None else dict(overrides)
    override = ov.get(layer_name, ov.get("*"))
    plan = choose_plan(geom, batch, machine, per_pass=per_pass, min_gain=min_gain, override=override,
                       budget=budget)
    return plan.strategy(), plan, describe_choice(layer_name, plan)


def _machine(machine: Machine | None) -> Machine:
    if machine is not None:
        return machine
    from .calibrate import load_machine

    return load_machine(measure_if_missing=True)
