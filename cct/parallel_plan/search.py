"""The optimal global configuration (DeePa section 4, appendix A): node and edge eliminations, then
enumeration of what remains, then the eliminated nodes' configurations recovered in reverse order.

The problem is a :class:`CostGraph`: per node a vector of costs (``compute + update`` of each of its
configurations), per edge a matrix (``xfer(c_u, c_v)``); Eq. 1's cost of an assignment is the sum of
the chosen entries. Eliminations keep the optimum (Theorems 1-2):

* edge elimination (Eq. 3): two edges between the same nodes become one, their matrices summed
  (an edge v -> u is first transposed to u -> v: the cost does not depend on direction);
* node elimination (Eq. 2): a node w with exactly two edges, to u and to v, becomes the edge u -> v
  with ``xfer'(c_u, c_v) = min_{c_w} xfer_1(c_u, c_w) + cost_w(c_w) + xfer_2(c_w, c_v)``;
* a node with a single edge (a data layer, a loss) is folded into its neighbour's node cost the same
  way (Eq. 2 with no second edge), and a node with none keeps its cheapest configuration.

The residual graph (none of these apply: a graph that is not series-parallel) is enumerated
exhaustively in blocks, so the result is the exact optimum in every case; :attr:`Solution.residual`
says how many nodes were left to enumerate.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from .split import PlanError

#: the residual graph is enumerated only up to this many global configurations
MAX_ENUMERATION = 50_000_000


@dataclass
class CostGraph:
    """Node cost vectors ``node_cost[v] (K_v,)`` and edges ``(u, v, matrix (K_u, K_v))``."""

    node_cost: list[np.ndarray]
    edges: list[tuple[int, int, np.ndarray]] = field(default_factory=list)

    def cost(self, assignment: list[int] | tuple[int, ...]) -> float:
        """Eq. 1: the total cost of choosing configuration ``assignment[v]`` at every node."""
        total = sum(float(c[a]) for c, a in zip(self.node_cost, assignment))
        return total + sum(float(m[assignment[u], assignment[v]]) for u, v, m in self.edges)


@dataclass
class Solution:
    """The optimum: ``assignment[v]`` (an index into node v's configurations), its ``cost``, how many nodes
    the eliminations left (``residual``) and how many eliminations of each kind ran."""

    assignment: list[int]
    cost: float
    residual: int
    node_eliminations: int
    edge_eliminations: int


def _edge_key(u: int, v: int) -> tuple[int, int]:
    return (u, v) if u < v else (v, u)


def solve(graph: CostGraph, max_enumeration: int = MAX_ENUMERATION) -> Solution:
    """The configuration of every node minimising Eq. 1 (exact; see the module docstring)."""
    n = len(graph.node_cost)
    cost = [np.asarray(c, dtype=np.float64).copy() for c in graph.node_cost]
    # undirected adjacency: (a, b) with a < b -> matrix (K_a, K_b)
    edges: dict[tuple[int, int], np.ndarray] = {}
    edge_elims = 0
    for u, v, m in graph.edges:
        if u == v:
            raise PlanError(f"the cost graph has a self-loop at node {u}")
        m = np.asarray(m, dtype=np.float64)
        if m.shape != (len(cost[u]), len(cost[v])):
            raise PlanError(f"edge {u} -> {v}: matrix of shape {m.shape}, expected {(len(cost[u]), len(cost[v]))}")
        key = _edge_key(u, v)
        m = m if u < v else m.T
        if key in edges:
            edges[key] = edges[key] + m  # Eq. 3
            edge_elims += 1
        else:
            edges[key] = m
    nbrs: dict[int, set[int]] = {v: set() for v in range(n)}
    for a, b in edges:
        nbrs[a].add(b)
        nbrs[b].add(a)

    def mat(a: int, b: int) -> np.ndarray:
        return edges[(a, b)] if a < b else edges[(b, a)].T

    undo: list[tuple] = []  # ("node", w, u, v, argmin (K_u, K_v)) | ("leaf", w, u, argmin (K_u,)) | ("lone", w, c)
    alive = set(range(n))
    queue = list(range(n))
    node_elims = 0
    while queue:
        w = queue.pop()
        if w not in alive:
            continue
        deg = len(nbrs[w])
        if deg == 0 and len(alive) > 1:
            undo.append(("lone", w, int(np.argmin(cost[w]))))
        elif deg == 1 and len(alive) > 2:
            (u,) = nbrs[w]
            t = mat(u, w) + cost[w][None, :]  # (K_u, K_w)
            arg = np.argmin(t, axis=1)
            cost[u] = cost[u] + t[np.arange(len(arg)), arg]
            del edges[_edge_key(u, w)]
            nbrs[u].discard(w)
            undo.append(("leaf", w, u, arg))
            queue.append(u)
        elif deg == 2 and len(alive) > 2:
            u, v = sorted(nbrs[w])
            t = mat(u, w)[:, :, None] + cost[w][None, :, None] + mat(w, v)[None, :, :]  # Eq. 2
            arg = np.argmin(t, axis=1)
            best = np.take_along_axis(t, arg[:, None, :], axis=1)[:, 0, :]
            del edges[_edge_key(u, w)], edges[_edge_key(w, v)]
            nbrs[u].discard(w)
            nbrs[v].discard(w)
            if (u, v) in edges:
                edges[(u, v)] = edges[(u, v)] + best  # Eq. 3 on the new edge and an existing one
                edge_elims += 1
            else:
                edges[(u, v)] = best
                nbrs[u].add(v)
                nbrs[v].add(u)
            undo.append(("node", w, u, v, arg))
            queue.extend((u, v))
        else:
            continue
        alive.discard(w)
        nbrs.pop(w)
        node_elims += 1

    rest = sorted(alive)
    choice = _enumerate(rest, cost, edges, max_enumeration)
    assignment = [-1] * n
    for v, c in zip(rest, choice):
        assignment[v] = c
    for step in reversed(undo):
        if step[0] == "lone":
            assignment[step[1]] = step[2]
        elif step[0] == "leaf":
            _, w, u, arg = step
            assignment[w] = int(arg[assignment[u]])
        else:
            _, w, u, v, arg = step
            assignment[w] = int(arg[assignment[u], assignment[v]])
    return Solution(assignment, graph.cost(assignment), len(rest), node_elims, edge_elims)


def _enumerate(rest: list[int], cost: list[np.ndarray], edges: dict[tuple[int, int], np.ndarray],
               limit: int) -> list[int]:
    """The cheapest assignment of the residual nodes ``rest``: every combination, the last node's
    configurations evaluated at once for each combination of the others."""
    if not rest:
        return []
    sizes = [len(cost[v]) for v in rest]
    total = int(np.prod(sizes, dtype=np.float64))
    if total > limit:
        raise PlanError(f"after node and edge elimination {len(rest)} nodes remain with {total} global "
                        f"configurations, more than the {limit} the planner enumerates; give fewer workers or a "
                        f"plan file")
    last = rest[-1]
    others = rest[:-1]
    pos = {v: i for i, v in enumerate(rest)}
    inner = [(pos[a], pos[b], m) for (a, b), m in edges.items()]
    best, best_choice = np.inf, None
    for combo in itertools.product(*[range(s) for s in sizes[:-1]]):
        vec = cost[last].copy()
        fixed = sum(float(cost[v][c]) for v, c in zip(others, combo))
        for a, b, m in inner:
            if b == len(rest) - 1:
                vec += m[combo[a], :] if a < len(combo) else 0.0
            elif a == len(rest) - 1:
                vec += m[:, combo[b]]
            else:
                fixed += float(m[combo[a], combo[b]])
        k = int(np.argmin(vec))
        if fixed + vec[k] < best:
            best, best_choice = fixed + float(vec[k]), list(combo) + [k]
    return best_choice
