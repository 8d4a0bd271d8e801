"""The memory budget: blobs too large for it are refused before allocation, naming blob, shape and bytes.

A net's blobs are allocated when layers set up and reshape; a prototxt with a huge dimension
(``dim: 2147483647``, ``num_output: 4294967295``) would otherwise end in a bare ``MemoryError`` or in
the kernel's OOM killer. The budget is :attr:`cct.config.Config.memory_budget` (bytes; None: no
limit but the address space), by default ``$CCT_MEMORY_BUDGET`` (``8G``, ``512M``, ``1.5GiB``,
plain bytes; ``0``/``off``: none) else the machine's physical memory (or ``RLIMIT_AS`` if lower).
As in Caffe, a blob may not hold more than INT_MAX elements.
"""
from __future__ import annotations

import os
import re

from . import env
from .errors import MemoryBudgetError

INT_MAX = 2**31 - 1
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str, what: str = "CCT_MEMORY_BUDGET") -> int | None:
    """``"8G"`` / ``"512M"`` / ``"1.5GiB"`` / ``"123456"`` -> bytes; ``"0"``, ``"off"``, ``"none"`` -> None."""
    t = str(text).strip().lower()
    if t in ("", "0", "off", "none", "unlimited"):
        return None
    m = _SIZE.match(t)
    if not m:
        raise MemoryBudgetError(f"{what}: cannot read '{text}' as a size (examples: 8G, 512M, 1.5GiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()]) or None


def physical_memory() -> int | None:
    """Bytes of physical memory, lowered to ``RLIMIT_AS`` when that is set lower (None if unknown)."""
    total = None
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        pass
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY and soft > 0:
            total = soft if total is None else min(total, soft)
    except (ImportError, ValueError, OSError):
        pass
    return total


def default_budget() -> int | None:
    """``$CCT_MEMORY_BUDGET`` if set, else :func:`physical_memory`."""
    if env.is_set("CCT_MEMORY_BUDGET"):
        return parse_size(env.text("CCT_MEMORY_BUDGET"))
    return physical_memory()


def human(nbytes: int) -> str:
    """``1536`` -> ``"1.5 KiB"`` (for messages)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if value < 1024 or unit == "EiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{nbytes} B"  # pragma: no cover


def check_blob_size(name: str, shape: tuple[int, ...], itemsize: int, budget: int | None, arrays: int = 2) -> None:
    """Refuse a blob of ``shape`` before allocation: more than INT_MAX elements (Caffe's "blob size
    exceeds INT_MAX"), or ``arrays`` (data and diff) times its bytes over ``budget``."""
    count = 1
    for d in shape:
        count *= d
    if count > INT_MAX:
        raise MemoryBudgetError(f"blob '{name}' shape {list(shape)}: blob size exceeds INT_MAX "
                                f"({count} elements)")
    need = arrays * count * itemsize
    if budget is not None and need > budget:
        raise MemoryBudgetError(f"blob '{name}' shape {list(shape)} needs {need} bytes ({human(need)}, data and "
                                f"diff), more than the memory budget of {budget} bytes ({human(budget)}; "
                                f"CCT_MEMORY_BUDGET / Config.memory_budget)")


__all__ = ["INT_MAX", "check_blob_size", "default_budget", "human", "parse_size", "physical_memory"]
