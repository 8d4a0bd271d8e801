"""A layer's parallelism configuration: how its output tensor is split over workers (DeePa section 3).

A :class:`Split` gives the degree of parallelism in each dimension -- sample ``n``, height ``h``, width
``w``, output channel ``c`` -- and uses ``n*h*w*c`` workers, numbered row-major over the grid
``(n, h, w, c)``: worker ``((i_n*h + i_h)*w + i_w)*c + i_c``. Each worker computes a disjoint box of
the output; a dimension of size S split k ways gives part i the range ``[i*S//k, (i+1)*S//k)`` (equal
parts where k divides S, else parts one element apart, as DeePa's equal partitioning where possible).

Tensors are handled as 4-D ``(N, C, H, W)``: a 2-D FC output is ``(N, C, 1, 1)``.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from ..errors import CctError

#: the split dimensions, in the order a :class:`Split` lists them
DIMS = ("n", "h", "w", "c")
#: the tensor axis (of ``(N, C, H, W)``) each split dimension cuts
AXIS = {"n": 0, "c": 1, "h": 2, "w": 3}

Box = tuple[tuple[int, int], tuple[int, int], tuple[int, int], tuple[int, int]]


class PlanError(CctError):
    """A bad parallelism plan, plan file or planner input (names the file, line, layer or field)."""


@dataclass(frozen=True, order=True)
class Split:
    """Degrees of parallelism ``n, h, w, c`` of one layer's output (``workers = n*h*w*c``)."""

    n: int = 1
    h: int = 1
    w: int = 1
    c: int = 1

    def __post_init__(self) -> None:
        for d in DIMS:
            if not isinstance(getattr(self, d), int) or getattr(self, d) < 1:
                raise PlanError(f"split degree {d}={getattr(self, d)!r}: expected an integer >= 1")

    @property
    def workers(self) -> int:
        """How many workers the configuration uses."""
        return self.n * self.h * self.w * self.c

    def degree(self, dim: str) -> int:
        """The degree of dimension ``dim`` (one of :data:`DIMS`)."""
        return getattr(self, dim)

    def __str__(self) -> str:
        return " ".join(f"{d}={getattr(self, d)}" for d in DIMS)

    @classmethod
    def parse(cls, text: str, where: str = "") -> Split:
        """``"n=2 c=2"`` / ``"n=2,h=1,w=1,c=2"`` / ``"{n=2, c=2}"`` -> Split (omitted degrees are 1)."""
        body = text.strip().strip("{}").replace(",", " ")
        degrees: dict[str, int] = {}
        for item in body.split():
            m = re.fullmatch(r"([nhwc])=(\d+)", item)
            if not m:
                raise PlanError(f"{where}cannot read '{item}' in configuration '{text}': expected n=, h=, w=, c= "
                                f"with a positive integer")
            if m.group(1) in degrees:
                raise PlanError(f"{where}configuration '{text}' gives {m.group(1)} twice")
            degrees[m.group(1)] = int(m.group(2))
        if not degrees:
            raise PlanError(f"{where}empty configuration")
        return cls(**degrees)


def divisors(x: int) -> list[int]:
    """The positive divisors of ``x``, ascending."""
    return [d for d in range(1, x + 1) if x % d == 0]


def part_bounds(size: int, k: int) -> np.ndarray:
    """``(k, 2)`` array of the ``[lo, hi)`` ranges of ``size`` split ``k`` ways."""
    i = np.arange(k + 1, dtype=np.int64)
    edges = i * size // k
    return np.stack([edges[:-1], edges[1:]], axis=1)


def worker_boxes(split: Split, shape: tuple[int, int, int, int]) -> np.ndarray:
    """``(workers, 4, 2)`` int64: worker j's ``[lo, hi)`` per axis of the ``(N, C, H, W)`` tensor ``shape``."""
    grids = [part_bounds(shape[AXIS[d]], split.degree(d)) for d in DIMS]
    idx = np.indices([split.degree(d) for d in DIMS]).reshape(4, -1)  # row-major: worker order
    boxes = np.empty((split.workers, 4, 2), dtype=np.int64)
    for k, d in enumerate(DIMS):
        boxes[:, AXIS[d], :] = grids[k][idx[k]]
    return boxes


def enumerate_splits(workers: int, shape: tuple[int, int, int, int], dims: Iterable[str] = DIMS) -> list[Split]:
    """Every configuration over the dimensions ``dims`` whose worker count divides ``workers`` and whose
    degrees each fit the output ``shape`` (no worker left without output), fewest workers first."""
    allowed = set(dims)
    unknown = allowed - set(DIMS)
    if unknown:
        raise PlanError(f"unknown split dimension(s) {sorted(unknown)}: expected some of {', '.join(DIMS)}")
    out: list[Split] = []

    def rec(k: int, rest: int, chosen: list[int]) -> Iterator[list[int]]:
        if k == len(DIMS):
            yield chosen
            return
        d = DIMS[k]
        options = divisors(rest) if d in allowed else [1]
        for deg in options:
            if deg <= shape[AXIS[d]]:
                yield from rec(k + 1, rest // deg, chosen + [deg])

    for total in divisors(workers):
        for degs in rec(0, total, []):
            if int(np.prod(degs)) == total:
                out.append(Split(*degs))
    return out
