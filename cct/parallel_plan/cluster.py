"""The workers a plan runs on and the links between them (a described cluster: a MODEL).

A :class:`Cluster` is ``machines`` machines of ``workers_per_machine`` workers each; two workers of one
machine exchange data at ``intra`` bytes/s (shared memory, PCIe), of two machines at ``inter`` bytes/s
(the network). ``speed`` is a worker's compute rate relative to the measured rates of this machine
(compute times are divided by it: FLOPS scaling, see :class:`~cct.parallel_plan.compute.ScaledCompute`).
Latency, contention between concurrent transfers on one link and the overlap of transfers with
compute are not modelled. The bandwidths are given, or measured on the MPI ranks of a job
(:mod:`.links`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from .split import PlanError

_SIZE = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: str, what: str) -> float:
    """``"10G"`` / ``"1.25GB/s"`` / ``"500M"`` / ``"1e9"`` -> bytes per second (decimal units)."""
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9+-]+)?)\s*([kmgt]?)(?:b(?:/s)?)?\s*", text.lower())
    if not m:
        raise PlanError(f"{what}: cannot read '{text}' as a bandwidth (examples: 10G, 1.25GB/s, 500M)")
    value = float(m.group(1)) * _SIZE[m.group(2)]
    if value <= 0:
        raise PlanError(f"{what}: bandwidth must be positive, not '{text}'")
    return value


@dataclass(frozen=True)
class Cluster:
    """``machines x workers_per_machine`` workers; bandwidths in bytes/s; ``speed`` relative to this machine."""

    machines: int
    workers_per_machine: int
    intra: float
    inter: float
    speed: float = 1.0

    def __post_init__(self) -> None:
        if self.machines < 1 or self.workers_per_machine < 1:
            raise PlanError(f"a cluster needs at least one machine and one worker per machine, not "
                            f"{self.machines} x {self.workers_per_machine}")
        if self.intra <= 0 or self.inter <= 0 or self.speed <= 0:
            raise PlanError("cluster bandwidths and speed must be positive")

    @property
    def workers(self) -> int:
        """Workers in all."""
        return self.machines * self.workers_per_machine

    def machine_of(self, worker: int) -> int:
        """The machine of ``worker`` (workers are numbered machine by machine)."""
        return worker // self.workers_per_machine

    def inv_bandwidth(self) -> np.ndarray:
        """``(W, W)`` seconds per byte from worker i to worker j (0 on the diagonal)."""
        m = np.arange(self.workers) // self.workers_per_machine
        inv = np.where(m[:, None] == m[None, :], 1.0 / self.intra, 1.0 / self.inter)
        np.fill_diagonal(inv, 0.0)
        return inv

    def describe(self) -> str:
        """One line: shape, links and speed."""
        return (f"{self.machines} machine(s) x {self.workers_per_machine} worker(s), links {self.intra / 1e9:.3g} "
                f"GB/s within a machine, {self.inter / 1e9:.3g} GB/s between machines, worker speed {self.speed:g}x "
                f"this machine")

    @classmethod
    def parse(cls, text: str) -> Cluster:
        """``"4x4,intra=10G,inter=1.25G,speed=50"`` (machines x workers per machine, then options)."""
        head, *opts = [t.strip() for t in text.split(",")]
        m = re.fullmatch(r"(\d+)x(\d+)", head)
        if not m:
            raise PlanError(f"cluster '{text}': expected MACHINESxWORKERS first (e.g. 4x4)")
        kw: dict[str, float] = {"intra": 10e9, "inter": 1.25e9, "speed": 1.0}
        for opt in opts:
            key, _, value = opt.partition("=")
            if key not in kw or not value:
                raise PlanError(f"cluster '{text}': unknown option '{opt}' (intra=, inter=, speed=)")
            kw[key] = float(value) if key == "speed" else parse_rate(value, f"cluster '{text}' {key}")
        return cls(int(m.group(1)), int(m.group(2)), **kw)
