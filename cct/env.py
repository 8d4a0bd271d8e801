"""Every ``CCT_*`` environment variable cct reads, declared once: name, default, kind and what it does.

Code reads a variable through :func:`text` (or :func:`flag`), never ``os.environ`` directly, so this
table is the whole list; ``docs/commands.md`` carries it (:func:`markdown_table`, checked by the tests).
Values are read when called: a setting object (:class:`cct.config.Config`, :class:`cct.config.EngineConfig`)
reads its variables when it is built.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Knob:
    """One environment variable: its ``name``, the ``default`` used when it is unset, the values it takes
    (``values``) and what it does (``help``)."""

    name: str
    default: str
    values: str
    help: str


KNOBS: tuple[Knob, ...] = (
    Knob("CCT_BLAS", "auto", "openblas | mkl | auto",
         "GEMM backend; `auto` measures both once and caches the faster"),
    Knob("CCT_BLAS_THREAD_TIMEOUT", "", "exponent | off",
         "idle spin of OpenBLAS's workers (2^16 cycles by default); `off` keeps OpenBLAS's own"),
    Knob("CCT_CACHE_DIR", "", "path", "cct's cache (calibrations, tunings); default `$XDG_CACHE_HOME/cct`"),
    Knob("CCT_CALIBRATE", "0", "0 | 1",
         "Python API: measure this machine's cost-model constants when none are cached (`cct train`/`time` "
         "do unless 0)"),
    Knob("CCT_KERNELS", "auto", "auto | numpy", "`numpy` skips the compiled (numba) kernels"),
    Knob("CCT_LOWERING", "", "strategy | layer=strategy,...", "override the cost model's convolution strategy"),
    Knob("CCT_LOWERING_MEMORY", "", "size (8G, 512M)",
         "workspace one conv pass may use; default a quarter of the available RAM and of the memory budget"),
    Knob("CCT_MALLOC_TUNE", "1", "0 | 1", "`0` leaves glibc malloc's thresholds as they are"),
    Knob("CCT_MEMORY_BUDGET", "", "size | off", "bytes a net's blobs (data and diff) may take; default the "
         "physical memory"),
    Knob("CCT_OMP_SPINCOUNT", "", "count | off",
         "idle OpenMP workers of MKL spin this many times before sleeping (default 1000), set at import"),
    Knob("CCT_PROGRESS", "1", "0 | 1", "`0` turns the progress bars off"),
    Knob("CCT_PYTHON_LAYERS", "1", "0 | 1", "`0` refuses `type: \"Python\"` layers (they run code the "
         "prototxt names)"),
    Knob("CCT_SHARED_DIR", "", "path", "the shared material (papers, reference outputs); default `../shared` "
         "beside the repository"),
    Knob("CCT_TUNE", "0", "0 | 1", "Python API: measure the cost model's close calls on the layer at setup "
         "(`cct train`/`time` do unless 0)"),
    Knob("CCT_TUNE_DEVICE", "0", "0 | 1", "measure each conv layer's strategy on the GPU of a resident net"),
)
_BY_NAME = {k.name: k for k in KNOBS}


def knob(name: str) -> Knob:
    """The declaration of ``name`` (KeyError for a variable cct does not declare)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not one of cct's environment variables (cct/env.py)") from None


def is_set(name: str) -> bool:
    """Whether ``name`` is set to a non-empty value."""
    knob(name)
    return bool(os.environ.get(name, "").strip())


def text(name: str) -> str:
    """The value of ``name`` (stripped), or its declared default when unset or empty."""
    value = os.environ.get(name, "").strip()
    return value if value else knob(name).default


def flag(name: str) -> bool:
    """``name`` read as on/off (``1``/``true``/``yes``/``on`` is on; ``0``/``false``/``no``/``off`` or the
    default otherwise)."""
    return text(name).lower() in _ON


def is_off(name: str) -> bool:
    """Whether ``name`` is set and switched off (``0``/``false``/``no``/``off``); an unset variable is not."""
    knob(name)
    return os.environ.get(name, "").strip().lower() in _OFF


def markdown_table() -> str:
    """The variables as a Markdown table (the one in ``docs/commands.md``)."""
    rows = ["| variable | values | default | what it does |", "| --- | --- | --- | --- |"]
    rows += [f"| `{k.name}` | {k.values.replace('|', '/')} | {k.default or '-'} | {k.help} |" for k in KNOBS]
    return "\n".join(rows)


__all__ = ["KNOBS", "Knob", "flag", "is_off", "is_set", "knob", "markdown_table", "text"]
