"""Plan files: a readable text file of one line per node, ``layer: n=.. h=.. w=.. c=..``, written by
``auto`` (with the predicted times as comments) and read back, or written and edited by hand::

    # cct parallel plan
    workers: 4
    conv1: n=4 h=1 w=1 c=1    # compute 12.100 ms, update 0.300 ms, transfer in 0.000 ms; with relu1
    fc6: n=1 h=1 w=1 c=2
"""
from __future__ import annotations

import os

from ..io.atomic import atomic_write
from .costs import StepEstimate
from .plans import Plan
from .split import PlanError, Split


def plan_text(plan: Plan, estimate: StepEstimate | None = None, header: list[str] | None = None,
              members: dict[str, list[str]] | None = None) -> str:
    """The file text of ``plan``; ``estimate`` adds each node's predicted times as a comment, ``members``
    the layers that follow each node's split."""
    lines = ["# cct parallel plan: one line per node, 'layer: n=.. h=.. w=.. c=..' (edit freely)"]
    lines += [f"# {h}" for h in header or []]
    lines.append(f"workers: {plan.workers}")
    rows = {n.name: n for n in estimate.nodes} if estimate is not None else {}
    for name, split in plan.splits.items():
        line = f"{name}: {split}"
        notes = []
        if name in rows:
            r = rows[name]
            notes.append(f"compute {r.compute_s * 1e3:.3f} ms, update {r.update_s * 1e3:.3f} ms, "
                         f"transfer in {r.xfer_s * 1e3:.3f} ms")
        if members and members.get(name, [name])[1:]:
            notes.append("with " + " ".join(members[name][1:]))
        if notes:
            line = f"{line:<40s} # " + "; ".join(notes)
        lines.append(line)
    return "\n".join(lines) + "\n"


def write_plan(path: str | os.PathLike, plan: Plan, estimate: StepEstimate | None = None,
               header: list[str] | None = None, members: dict[str, list[str]] | None = None) -> None:
    """Write ``plan`` to ``path`` atomically (a crash leaves any previous file intact)."""
    text = plan_text(plan, estimate, header, members)

    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)

    atomic_write(path, write)


def read_plan(path: str | os.PathLike) -> Plan:
    """The :class:`Plan` in file ``path``; errors name the file and line."""
    path = os.fspath(path)
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise PlanError(f"cannot read plan file {path}: {e.strerror or e}") from None
    workers, splits, lines = None, {}, {}
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        key, sep, value = line.partition(":")
        key, value = key.strip(), value.strip()
        where = f"{path}:{no}: "
        if not sep or not key or not value:
            raise PlanError(f"{where}expected 'layer: n=.. h=.. w=.. c=..' or 'workers: N', got '{raw.strip()}'")
        if key == "workers":
            if not value.isdigit() or int(value) < 1:
                raise PlanError(f"{where}workers must be a positive integer, not '{value}'")
            workers = int(value)
            continue
        if key in splits:
            raise PlanError(f"{where}layer '{key}' configured twice (first on line {lines[key]})")
        splits[key] = Split.parse(value, where)
        lines[key] = no
    if workers is None:
        raise PlanError(f"{path}: no 'workers: N' line")
    for name, s in splits.items():
        if workers % s.workers:
            raise PlanError(f"{path}:{lines[name]}: layer '{name}' uses {s.workers} workers, which does not divide "
                            f"{workers}")
    return Plan(workers, splits, "file", path, lines)
