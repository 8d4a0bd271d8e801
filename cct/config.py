"""Run configuration: engine settings, devices and BLAS choice as one object handed to nets and solvers.

A :class:`Config` holds everything that used to be process-wide state::

    from cct.config import Config, EngineConfig, using_config

    fast = Config(engine=EngineConfig(mode="cct"))
    caffe_like = fast.replace(engine={"mode": "caffe"}, blas={"backend": "openblas"})
    a = cct.Net("lenet.prototxt", cct.TEST, config=fast)        # each net keeps its own config
    b = cct.Net("lenet.prototxt", cct.TEST, config=caffe_like)
    solver = cct.solver.get_solver("solver.prototxt", config=fast)  # and hands it to its nets

    with using_config(engine={"partitions": 1}):                 # scoped override (Chainer style)
        c = cct.Net("lenet.prototxt", cct.TEST)                  # built with the override

:func:`current` is the configuration in effect for the calling thread: the innermost
:func:`using_config` block (a :mod:`contextvars` variable, so every thread, and every task that
does not copy the context, starts outside any block), else the process default. A net or solver
built without ``config=`` takes :func:`current` at construction and keeps it; while it runs, its
own config is current (``Net.forward``/``backward``/``reshape`` enter it), so the GEMMs, lowering
plans and Python-layer checks of that net see it. Work a net hands to other threads (device
workers, batch partitions) runs in a copy of the submitting context.

The old functions (``cct.set_devices``, ``cct.blas.set_backend``,
``cct.lowering.engine.configure``) are thin wrappers that change the process default
(:func:`update_default`); they do not touch a config already given to a net.
"""
from __future__ import annotations

import contextvars
import dataclasses
import functools
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from . import env
from .errors import CctError
from .membudget import default_budget
from .random_source import RandomSource

if TYPE_CHECKING:
    from .scheduler.config import DeviceConfig

BLAS_REQUESTS = ("openblas", "mkl", "auto")


@dataclass(frozen=True)
class BlasConfig:
    """The GEMM backend request: ``"openblas"``, ``"mkl"``, ``"auto"`` (measured once per machine), or
    None to follow ``$CCT_BLAS`` (default ``auto``). A device's own ``blas=`` option wins in its worker."""

    backend: str | None = None

    def __post_init__(self) -> None:
        if self.backend is not None:
            name = str(self.backend).strip().lower()
            if name not in BLAS_REQUESTS:
                raise CctError(f"unknown BLAS backend {self.backend!r}: expected one of {', '.join(BLAS_REQUESTS)}")
            object.__setattr__(self, "backend", name)


LOWERING_MODES = ("cct", "caffe")


def parse_overrides(spec: str | None = None) -> dict[str, str]:
    """Parse ``CCT_LOWERING`` (or ``spec``): ``"type1"`` -> ``{"*": "type1"}``; ``"conv1=type3,conv5=type1"``
    -> per-layer mapping. The names are checked against the strategies registered when a layer is planned."""
    spec = env.text("CCT_LOWERING") if spec is None else spec
    out: dict[str, str] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if "=" in part:
            k, v = part.split("=", 1)
            out[k.strip()] = v.strip()
        else:
            out["*"] = part
    return out


@dataclass(frozen=True)
class EngineConfig:
    """Engine-wide lowering settings (:mod:`cct.lowering.engine`); part of a :class:`Config`.

    ``mode``: ``"cct"`` (the cost model's plan) or ``"caffe"`` (type 1, one image per GEMM);
    ``partitions``: ``"model"``, ``"auto"`` or a positive int; ``overrides``: ``{layer: strategy}`` (or the
    ``CCT_LOWERING`` string form; the names are checked when a layer is planned); ``calibrate``, ``tune``,
    ``tune_device``: default ``$CCT_CALIBRATE``, ``$CCT_TUNE``, ``$CCT_TUNE_DEVICE`` (read when the settings
    are built). Validated when built (ValueError).
    """

    mode: str = "cct"
    partitions: int | str = "model"
    overrides: dict[str, str] = field(default_factory=dict)
    calibrate: bool = field(default_factory=lambda: env.flag("CCT_CALIBRATE"))
    tune: bool = field(default_factory=lambda: env.flag("CCT_TUNE"))
    tune_device: bool = field(default_factory=lambda: env.flag("CCT_TUNE_DEVICE"))

    def __post_init__(self) -> None:
        if self.mode not in LOWERING_MODES:
            raise ValueError(f"unknown lowering mode '{self.mode}' (use one of {', '.join(LOWERING_MODES)})")
        p = self.partitions
        if not (p in ("auto", "model") or (isinstance(p, int) and not isinstance(p, bool) and p >= 1)):
            raise ValueError(f"partitions must be 'auto', 'model' or a positive int, got {p!r}")
        parsed = parse_overrides(self.overrides) if isinstance(self.overrides, str) else dict(self.overrides)
        object.__setattr__(self, "overrides", parsed)
        object.__setattr__(self, "calibrate", bool(self.calibrate))
        object.__setattr__(self, "tune", bool(self.tune))
        object.__setattr__(self, "tune_device", bool(self.tune_device))


@dataclass(frozen=True)
class GpuConfig:
    """How a net resident on a GPU runs; part of a :class:`Config`.

    ``graphs``: capture each training iteration as CUDA graphs and replay them (:mod:`cct.device.graph`;
    ``--nograph`` turns it off); ``tf32``: float32 GEMMs (convolutions lowered to GEMMs, inner products) on
    TF32 tensor cores (``--tf32``; default off: FP32, Caffe's arithmetic).
    """

    graphs: bool = True
    tf32: bool = False


class PlanningCaches:
    """What planning convolutions learns once and reuses, owned by a :class:`Config` (not by a module): the
    calibrated machines by cache name (``machines``), the measured-pick caches (``tunings``), the
    strategy instances the cost model prices (``priced``) and the BLAS library ``auto`` resolved to
    (``blas_auto``). A config and its :meth:`Config.replace` copies share one; a new ``Config()`` starts empty
    (it reads the on-disk caches again)."""

    def __init__(self) -> None:
        self.machines: dict[str, Any] = {}
        self.tunings: dict[tuple, Any] = {}
        self.priced: dict[str, tuple] = {}
        self.blas_auto: str | None = None

    def clear(self) -> None:
        """Forget everything (as a new process would)."""
        self.machines.clear()
        self.tunings.clear()
        self.priced.clear()
        self.blas_auto = None


def python_layers_from_env() -> bool:
    """``$CCT_PYTHON_LAYERS``: ``0``/``false``/``no``/``off`` refuse ``type: "Python"`` layers (default: allowed)."""
    return not env.is_off("CCT_PYTHON_LAYERS")


@dataclass(frozen=True)
class Config:
    """Everything a net or solver needs to know about how to run (see module docstring).

    ``engine``: lowering settings (:class:`EngineConfig`); ``devices``: the
    devices each batch is split over (:class:`cct.scheduler.DeviceConfig`; None: the plain
    single-device path); ``blas``: the GEMM backend (:class:`BlasConfig`); ``python_layers``:
    whether ``type: "Python"`` layers may be built (the switch for nets from untrusted sources: a
    Python layer imports and runs code named by the prototxt; default ``$CCT_PYTHON_LAYERS``, on);
    ``memory_budget``: bytes a blob's data and diff may take (None: no limit; default
    ``$CCT_MEMORY_BUDGET``, else the physical memory; see :mod:`cct.membudget`); ``gpu``: CUDA graphs and
    TF32 for nets on a GPU (:class:`GpuConfig`); ``random``: the host random source of the nets built with
    this config (:class:`cct.random_source.RandomSource`; the process default's is what
    :func:`cct.set_random_seed` reseeds). Like ``caches``, :meth:`replace` copies share it and a new
    ``Config()`` starts a fresh, unseeded one.
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    devices: DeviceConfig | None = None
    blas: BlasConfig = field(default_factory=BlasConfig)
    python_layers: bool = field(default_factory=python_layers_from_env)
    memory_budget: int | None = field(default_factory=default_budget)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    caches: PlanningCaches = field(default_factory=PlanningCaches, compare=False, repr=False)
    random: RandomSource = field(default_factory=RandomSource, compare=False, repr=False)

    def replace(self, **changes: Any) -> Config:
        """A copy with ``changes``; a mapping for ``engine`` or ``blas`` changes only those fields
        (``cfg.replace(engine={"mode": "caffe"})``)."""
        for name in ("engine", "blas", "gpu"):
            value = changes.get(name)
            if isinstance(value, Mapping):
                changes[name] = dataclasses.replace(getattr(self, name), **value)
        return dataclasses.replace(self, **changes)

    def close(self) -> None:
        """Stop the devices' worker threads and restore their BLAS thread limits."""
        if self.devices is not None:
            self.devices.close()


_lock = threading.RLock()
_default: Config | None = None
_scoped: contextvars.ContextVar[Config | None] = contextvars.ContextVar("cct_config", default=None)


def default() -> Config:
    """The process default configuration (what a net built outside any :func:`using_config` gets)."""
    global _default
    if _default is None:
        with _lock:
            if _default is None:
                _default = Config()
    return _default


def set_default(config: Config | None) -> Config:
    """Make ``config`` (None: a fresh ``Config()``) the process default; returns it. Nets built
    earlier keep the config they were given."""
    global _default
    with _lock:
        _default = config if config is not None else Config()
        return _default


def update_default(**changes: Any) -> Config:
    """Apply ``changes`` (as :meth:`Config.replace`) to the process default; returns the new default.
    What the old setters (``set_devices``, ``blas.set_backend``, ``engine.configure``) do."""
    global _default
    with _lock:
        _default = (_default or Config()).replace(**changes)
        return _default


def current() -> Config:
    """The configuration in effect in the calling context (see module docstring)."""
    cfg = _scoped.get()
    return cfg if cfg is not None else default()


class using_config:  # noqa: N801 - used as a context manager, named like one (Chainer's using_config)
    """``with using_config(cfg):`` or ``with using_config(engine={"mode": "caffe"}):`` makes ``cfg``
    (or :func:`current` with the changes) current in this thread until the block ends, also when
    it raises. Blocks nest; other threads are unaffected."""

    __slots__ = ("config", "_tokens")

    def __init__(self, config: Config | None = None, /, **changes: Any):
        base = config if config is not None else (current() if changes else None)
        if base is None:
            raise TypeError("using_config() needs a Config or changes")
        self.config = base.replace(**changes) if changes else base
        self._tokens: list[contextvars.Token] = []

    def __enter__(self) -> Config:
        self._tokens.append(_scoped.set(self.config))
        return self.config

    def __exit__(self, *exc: object) -> None:
        _scoped.reset(self._tokens.pop())


F = TypeVar("F", bound=Callable[..., Any])


def runs_in_own_config(method: F) -> F:
    """Method decorator: run the method with ``self.config`` current (a net's forward/backward)."""

    @functools.wraps(method)
    def run(self, *args: Any, **kwargs: Any) -> Any:
        token = _scoped.set(self.config)
        try:
            return method(self, *args, **kwargs)
        finally:
            _scoped.reset(token)

    return run  # type: ignore[return-value]


def submit_in_context(submit: Callable[..., Any], fn: Callable[..., Any], *args: Any) -> Any:
    """``submit(fn, *args)`` so that ``fn`` runs in a copy of the calling context (the current config
    follows work handed to a worker thread)."""
    return submit(contextvars.copy_context().run, fn, *args)
