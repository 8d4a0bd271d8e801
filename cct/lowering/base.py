"""The lowering-strategy interface the convolution layers call, and its registry.

A lowering turns a convolution into matrix multiplication (CcT paper, section 2). Every
strategy computes the same three products on whole batches:

* ``forward(x, w, b, geom)``: ``y = conv(x, w) + b`` with ``x`` ``(N, C, *in)``, ``w``
  ``geom.weight_shape``, ``b`` ``(M,)`` or None; returns ``(N, M, *out)``.
* ``backward_data(dy, w, geom)``: gradient of the input, ``(N, C, *in)``.
* ``backward_weights(dy, x, geom)``: ``(dw, db)``; ``db`` is None when ``geom.bias_term`` is False.
  These are fresh arrays: the caller accumulates them into the parameter diffs.

``pass_ops(geom, batch, pass_)`` and ``workspace_bytes(geom, batch)`` declare what a pass does (GEMM
shapes, sweeps, direct-kernel work, FFT work; :mod:`cct.lowering.gemm_ops`): the cost model prices
the operations and the optimizer picks, per layer, the fastest strategy whose workspace fits the
memory budget. Adding a strategy = one module that subclasses this and calls :func:`register_strategy`.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ..device.driver import array_module
from .geometry import ConvGeometry


class LoweringStrategy:
    """Base class of convolution lowerings (see module docstring)."""

    name: str = ""

    def forward(self, x: Any, w: Any, b: Any, geom: ConvGeometry) -> Any:
        """Convolution of the whole batch ``x`` with weights ``w`` plus bias ``b`` (or None)."""
        raise NotImplementedError

    def backward_data(self, dy: Any, w: Any, geom: ConvGeometry) -> Any:
        """Gradient w.r.t. the input (the transposed convolution of ``dy``)."""
        raise NotImplementedError

    def backward_weights(self, dy: Any, x: Any, geom: ConvGeometry) -> tuple[Any, Any]:
        """Gradients w.r.t. the weights and the bias (None without bias)."""
        raise NotImplementedError

    def supports(self, geom: ConvGeometry) -> bool:
        """Whether this lowering can compute ``geom`` (the optimizer never picks one that cannot)."""
        return True

    def prepare(self, w: Any, geom: ConvGeometry, pass_: str) -> None:
        """Work on the weights that every batch chunk of ``pass_`` (``fwd`` or ``bwd_data``) shares,
        done once before the chunks with all of the caller's threads
        (:class:`~cct.lowering.partition.BatchedLowering` calls it); nothing by default."""

    def prepare_for(self, geom: ConvGeometry, batch: int, itemsize: int = 4) -> None:
        """Settle, at setup, everything the lowering decides for ``geom`` at ``batch`` images (its chunking,
        its partition threads), so that the passes only execute; the layer calls it after each plan or
        reshape. Nothing to settle by default."""

    def pass_ops(self, geom: ConvGeometry, batch: int, pass_: str) -> list[tuple]:
        """The operations one pass (``fwd``, ``bwd_data``, ``bwd_weights``) runs on a chunk of ``batch``
        images, in the vocabulary of :mod:`cct.lowering.gemm_ops`; the cost model prices them. A
        strategy without it is never chosen by the optimizer (it can still be set by hand)."""
        raise NotImplementedError

    def workspace_bytes(self, geom: ConvGeometry, batch: int, itemsize: int = 4) -> int:
        """Peak temporary bytes of one pass on ``batch`` images (checked against the memory budget)."""
        raise NotImplementedError

    def pass_workspace_bytes(self, geom: ConvGeometry, batch: int, passes: tuple[str, ...],
                             itemsize: int = 4) -> int:
        """:meth:`workspace_bytes` of a layer that runs only ``passes`` (a strategy whose buffers depend on the
        passes, as FFT's, says less for fewer)."""
        return self.workspace_bytes(geom, batch, itemsize)

    def priced(self) -> bool:
        """Whether this strategy declares its operations and workspace (the optimizer may pick it)."""
        cls, base = type(self), LoweringStrategy
        return cls.pass_ops is not base.pass_ops and cls.workspace_bytes is not base.workspace_bytes

    def __repr__(self) -> str:
        return f"<lowering {self.name}>"


class IntoLowering(LoweringStrategy):
    """A lowering that writes into caller-given arrays (``forward_into`` / ``backward_into``, which the
    conv layer calls to write straight into its blobs); the whole-array passes derive from them."""

    def forward_into(self, x: Any, w: Any, b: Any, geom: ConvGeometry, out: Any) -> Any:
        raise NotImplementedError

    def backward_into(self, dy: Any, x: Any, w: Any, geom: ConvGeometry, dw: Any = None, db: Any = None,
                      dx: Any = None) -> None:
        """Accumulate into ``dw``/``db`` (when given) and write ``dx`` (when given)."""
        raise NotImplementedError

    def forward(self, x: Any, w: Any, b: Any, geom: ConvGeometry) -> Any:
        xp = array_module(x)
        y = xp.empty((x.shape[0], geom.channels_out) + tuple(geom.out_shape), dtype=x.dtype)
        return self.forward_into(x, w, b, geom, y)

    def backward_data(self, dy: Any, w: Any, geom: ConvGeometry) -> Any:
        xp = array_module(dy)
        dx = xp.empty((dy.shape[0], geom.channels_in) + tuple(geom.in_shape), dtype=dy.dtype)
        self.backward_into(dy, None, w, geom, dx=dx)
        return dx

    def backward_weights(self, dy: Any, x: Any, geom: ConvGeometry) -> tuple[Any, Any]:
        xp = array_module(dy)
        dw = xp.zeros(geom.weight_shape, dtype=dy.dtype)
        db = xp.zeros(geom.channels_out, dtype=dy.dtype) if geom.bias_term else None
        self.backward_into(dy, x, None, geom, dw=dw, db=db)
        return dw, db


_STRATEGIES: dict[str, Callable[[], LoweringStrategy]] = {}


def register_strategy(name: str, factory: Callable[[], LoweringStrategy]) -> None:
    """Register a lowering under ``name`` (a class or any zero-argument factory); a name already taken is
    refused (ValueError), as the layer registry refuses a second layer type of one name. The built-in
    strategies register when :mod:`cct.lowering` is imported (which Python does before any of its modules)."""
    if name in _STRATEGIES and _STRATEGIES[name] is not factory:
        raise ValueError(f"a lowering named '{name}' is registered already ({_STRATEGIES[name]!r})")
    _STRATEGIES[name] = factory


def unregister_strategy(name: str) -> None:
    """Remove the lowering registered as ``name`` (KeyError naming the known ones)."""
    registry_factory(name)
    del _STRATEGIES[name]


def strategy_names() -> list[str]:
    """Names of the registered lowerings."""
    return sorted(_STRATEGIES)


def registry_factory(name: str) -> Callable[[], LoweringStrategy]:
    """The factory registered as ``name`` (KeyError naming the known ones)."""
    try:
        return _STRATEGIES[name]
    except KeyError:
        raise KeyError(f"unknown lowering '{name}' (known: {', '.join(sorted(_STRATEGIES))})") from None


def get_strategy(name: str) -> LoweringStrategy:
    """A new instance of the lowering registered as ``name`` (KeyError naming the known ones)."""
    return registry_factory(name)()


def check_names(names: Iterable[str]) -> None:
    """KeyError naming the known lowerings for the first of ``names`` that is not registered."""
    for name in names:
        registry_factory(name)


def supports(strategy: LoweringStrategy, geom: ConvGeometry) -> bool:
    """``strategy.supports(geom)`` when the strategy defines it, else True."""
    fn = getattr(strategy, "supports", None)
    return True if fn is None else bool(fn(geom))
