"""The setup log of a plan: each node's configuration with its predicted compute, update and transfer
times, then the step time and bytes of the plan next to data parallelism and OWT."""
from __future__ import annotations

from ..membudget import human
from .costs import StepEstimate


def plan_table(estimate: StepEstimate) -> list[str]:
    """One line per node: name, configuration, workers, compute / update / transfer-in ms, bytes it moves."""
    w = max([len(n.name) for n in estimate.nodes] + [5])
    lines = [f"{'layer':<{w}}  {'configuration':<21s} {'workers':>7s} {'compute ms':>11s} {'update ms':>10s} "
             f"{'xfer in ms':>11s} {'bytes':>10s}"]
    for n in estimate.nodes:
        moved = human(int(n.xfer_bytes + n.update_bytes))
        lines.append(f"{n.name:<{w}}  {str(n.split):<21s} {n.split.workers:>7d} {n.compute_s * 1e3:>11.3f} "
                     f"{n.update_s * 1e3:>10.3f} {n.xfer_s * 1e3:>11.3f} {moved:>10s}")
    return lines


def comparison(estimates: dict[str, StepEstimate]) -> list[str]:
    """One line per strategy: predicted step time and its parts, bytes moved per step."""
    lines = [f"{'plan':<6s} {'step ms':>10s} {'compute ms':>11s} {'update ms':>10s} {'xfer ms':>10s} "
             f"{'bytes/step':>11s} {'activations':>12s} {'gradients':>10s}"]
    for name, e in estimates.items():
        t = e.totals()
        lines.append(f"{name:<6s} {t['seconds'] * 1e3:>10.3f} {t['compute_s'] * 1e3:>11.3f} "
                     f"{t['update_s'] * 1e3:>10.3f} {t['xfer_s'] * 1e3:>10.3f} {human(int(t['total_bytes'])):>11s} "
                     f"{human(int(t['xfer_bytes'])):>12s} {human(int(t['update_bytes'])):>10s}")
    return lines
