"""Omnivore's hardware-efficiency model (4.1, D.4): time per iteration for g compute groups.

With N conv ranks in g groups of k = N / g, one merged FC server that serves one group at a time::

    HE(g) = max(t_fc, (t_conv(k) + t_fc) / g)
    t_conv(k) = max(T_cc / k, T_nc * k)       (compute shrinks with k, model traffic grows with k)

``T_cc`` is one rank's conv forward+backward for the whole batch (t_conv(1)), ``T_nc`` one copy of the
conv model down and its gradient up over the network, ``t_fc`` the FC server's time per group request.
``T_cc`` and ``t_fc`` are measured (or counted from the GEMM flops at a device's throughput),
``T_nc`` is the conv model's bytes over the measured bandwidth (D.4).
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class HEModel:
    """The D.4 model. Times in seconds."""

    t_fc: float
    t_conv1: float
    t_net1: float = 0.0

    @classmethod
    def from_counts(cls, conv_flops: float, fc_flops: float, conv_model_bytes: float, flops_per_s: float,
                    bytes_per_s: float) -> HEModel:
        """The model from operation counts and throughputs (D.4: BLAS at the device's peak, the network at
        its peak); ``conv_model_bytes`` counts the conv weights once (sent down, the gradient comes back)."""
        return cls(t_fc=fc_flops / flops_per_s, t_conv1=conv_flops / flops_per_s,
                   t_net1=2.0 * conv_model_bytes / bytes_per_s)

    def t_conv(self, k: int) -> float:
        """A group of k ranks' conv phase: max(T_cc / k, T_nc * k)."""
        if k < 1:
            raise ValueError(f"group size must be >= 1, not {k}")
        return max(self.t_conv1 / k, self.t_net1 * k)

    def time_per_iteration(self, g: int, n_conv: int) -> float:
        """HE(g) for ``n_conv`` conv ranks split into g groups (k = n_conv / g, fractional when g does
        not divide n_conv: the groups' mean size)."""
        if not 1 <= g <= n_conv:
            raise ValueError(f"g must be in 1..{n_conv}, not {g}")
        k = n_conv / g
        return max(self.t_fc, (max(self.t_conv1 / k, self.t_net1 * k) + self.t_fc) / g)

    def saturated(self, g: int, n_conv: int) -> bool:
        """True when the FC server is the bottleneck (t_conv(k) + t_fc <= g t_fc)."""
        k = n_conv / g
        return max(self.t_conv1 / k, self.t_net1 * k) + self.t_fc <= g * self.t_fc

    def saturating_groups(self, n_conv: int, choices=None) -> int:
        """The smallest g (among ``choices``, default powers of two up to n_conv, and n_conv) that saturates the
        FC server; n_conv (fully asynchronous) when none does. Algorithm 1 starts its search there (E.3)."""
        gs = sorted(set(choices) if choices is not None else _default_groups(n_conv))
        for g in gs:
            if self.saturated(g, n_conv):
                return g
        return gs[-1]

    def table(self, n_conv: int, choices=None) -> list[dict]:
        """Rows ``{g, k, t_conv_k, time_per_iter, speedup_vs_sync, saturated}`` for every g."""
        gs = sorted(set(choices) if choices is not None else _default_groups(n_conv))
        sync = self.time_per_iteration(1, n_conv)
        rows = []
        for g in gs:
            t = self.time_per_iteration(g, n_conv)
            k = n_conv / g
            rows.append({"g": g, "k": k, "t_conv_k": max(self.t_conv1 / k, self.t_net1 * k), "time_per_iter": t,
                         "speedup_vs_sync": sync / t, "saturated": self.saturated(g, n_conv)})
        return rows


def _default_groups(n_conv: int) -> list[int]:
    gs, g = [], 1
    while g < n_conv:
        gs.append(g)
        g *= 2
    gs.append(n_conv)
    return gs


def group_sizes(n_conv: int, g: int) -> list[int]:
    """Sizes of g groups over n_conv ranks, as equal as possible (the first ones one larger)."""
    if not 1 <= g <= n_conv:
        raise ValueError(f"cannot make {g} groups of {n_conv} conv ranks (g must be in 1..{n_conv})")
    base, extra = divmod(n_conv, g)
    return [base + (1 if i < extra else 0) for i in range(g)]


def simulate_schedule(t_conv: Sequence[float], t_fc: float, iterations: int) -> float:
    """Time per iteration of a scripted schedule: group i's conv phase takes ``t_conv[i]``, then it
    queues for the FC server (one group at a time, ``t_fc`` each, first come first served), then
    starts its next conv phase. Returns the mean time between FC completions once every group has
    gone through once: the quantity HE(g) predicts."""
    g = len(t_conv)
    ready = [(t, i) for i, t in enumerate(t_conv)]  # when each group's conv output reaches the server
    heapq.heapify(ready)
    server_free = 0.0
    done: list[float] = []
    while len(done) < iterations + g:
        t, i = heapq.heappop(ready)
        finish = max(t, server_free) + t_fc
        server_free = finish
        done.append(finish)
        heapq.heappush(ready, (finish + t_conv[i], i))
    return (done[-1] - done[g - 1]) / iterations
