"""Asynchrony is momentum (4.2, Theorem 1, D.5).

g asynchronous groups with explicit momentum 0 update, in expectation, as synchronous SGD with
momentum 1 - 1/g and step eta / g: ``E V(t+1) = (1 - 1/g) E V(t) - (eta/g) E grad l(W(t))``.

- :func:`implicit_momentum`: the prediction 1 - 1/g;
- :func:`simulate_async`: an event-driven simulation of g groups with exponentially distributed step
  times on a quadratic (A2), recording W(t) and the full gradient at W(t) after every update;
- :func:`fit_momentum`: the least-squares fit of ``V(t+1) = m V(t) - eta' grad(W(t))`` (Figure 6),
  also used on trajectories recorded from real MPI ranks;
- :func:`compensate_momentum`: the explicit momentum for g groups so that the total matches a tuned
  synchronous momentum, with total = 1 - (1 - mu)(1 - implicit) (momenta compose as two first-order
  filters in series); 0 once the implicit momentum alone exceeds the target (D.5: then SE suffers).
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np


def implicit_momentum(g: int) -> float:
    """Theorem 1: the momentum that g asynchronous groups add, 1 - 1/g."""
    if g < 1:
        raise ValueError(f"g must be >= 1, not {g}")
    return 1.0 - 1.0 / g


def total_momentum(mu: float, g: int) -> float:
    """Explicit momentum mu run by g groups: 1 - (1 - mu) / g."""
    return 1.0 - (1.0 - mu) * (1.0 - implicit_momentum(g))


def compensate_momentum(mu_sync: float, g: int) -> float:
    """The explicit momentum for g groups whose total equals ``mu_sync``: 1 - g (1 - mu_sync), at least 0."""
    return max(0.0, 1.0 - g * (1.0 - mu_sync))


def simulate_async(g: int, steps: int, *, runs: int = 100, lr: float = 0.01, mu: float = 0.0, dim: int = 8,
                   seed: int = 0, curvature: tuple[float, float] = (0.5, 2.0)) -> tuple[np.ndarray, np.ndarray]:
    """Simulate g asynchronous groups on l(W) = 0.5 sum_i a_i (w_i - 1)^2 for ``steps`` updates.

    Each group reads the model, computes its gradient at what it read, and after an exponential time
    (mean 1, assumption A2) pushes it; the server applies ``V = mu V - lr grad; W += V`` at once.
    Theorem 1 is about expectations, so ``runs`` independent runs are averaged. Returns (W, G): W[t]
    the mean model after t updates (``steps + 1`` rows), G[t] the full gradient at W[t].
    """
    rng = np.random.default_rng(seed)
    a = np.linspace(curvature[0], curvature[1], dim)
    W = np.mean([_one_run(g, steps, lr, mu, a, rng) for _ in range(runs)], axis=0)
    return W, a * (W - 1.0)


def _one_run(g: int, steps: int, lr: float, mu: float, a: np.ndarray, rng) -> np.ndarray:
    dim = len(a)
    w = np.zeros(dim)
    v = np.zeros(dim)
    events: list[tuple[float, int, np.ndarray]] = []
    for grp in range(g):
        heapq.heappush(events, (rng.exponential(1.0), grp, w.copy()))
    ws = [w.copy()]
    for _ in range(steps):
        t, grp, read = heapq.heappop(events)
        grad = a * (read - 1.0)
        v = mu * v - lr * grad
        w = w + v
        ws.append(w.copy())
        heapq.heappush(events, (t + rng.exponential(1.0), grp, w.copy()))
    return np.asarray(ws)


def fit_momentum(weights: Sequence[np.ndarray] | np.ndarray, grads: Sequence[np.ndarray] | np.ndarray,
                 skip: int = 0) -> tuple[float, float]:
    """Fit ``V(t+1) = m V(t) - eta' G(t)`` with V(t) = W(t) - W(t-1) by least squares over every t and
    coordinate; returns (m, eta'). ``weights[t]``/``grads[t]``: flat model and full gradient after t
    updates; ``skip`` drops the first updates (the transient before every group has pushed once)."""
    W = np.asarray(weights, dtype=np.float64).reshape(len(weights), -1)
    G = np.asarray(grads, dtype=np.float64).reshape(len(grads), -1)
    if W.shape != G.shape or len(W) < 3 + skip:
        raise ValueError(f"need matching weights/grads with >= {3 + skip} rows (got {W.shape} and {G.shape})")
    V = np.diff(W, axis=0)  # V[t] = W[t+1] - W[t]
    y = V[1 + skip:].ravel()  # V(t+1) for t >= 1
    x1 = V[skip:-1].ravel()  # V(t)
    x2 = -G[1 + skip:len(W) - 1].ravel()  # grad at W(t)
    A = np.stack([x1, x2], axis=1)
    (m, eta), *_ = np.linalg.lstsq(A, y, rcond=None)
    return float(m), float(eta)
