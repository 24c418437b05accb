"""Choose kernels with a binary linear program (scipy.optimize.milp, HiGHS).

Variables: x_k in {0, 1} per candidate. For every intermediate storage value t,
b_t = sum of x_k over the candidates with t in out(k). The program

    minimise  sum_k c_k x_k
    s.t.      b_t >= 1     for the storage root t of every graph output
              b_t >= x_k   for every candidate k and intermediate t in in(k)

picks a set of kernels that produces the outputs with every kernel's inputs
produced by some chosen kernel. Kernels may overlap (a node recomputed in two
kernels), so a solution can deadlock: A reads a value only B stores and B one
only A stores. After each solve the chosen kernels are scheduled; if some are
stuck (set U, missing values M), the cut

    sum_{k in U} x_k - sum_{k' not in U, out(k') meets M} x_k' <= |U| - 1

removes that solution and no schedulable one (the first kernel of U to run
needs a value of M from a kernel outside U), and the program is solved again.

Regions (``aliases.split_regions``): the graph's nodes are split at positions
(in topological order) that no candidate spans. Regions only interact through
the values a later region reads from an earlier one; those become required
outputs of the earlier region, which keeps the split exact (every such value is
read by any program of the later region, since no kernel there can recompute
it). Each region is one small BLP. A region with too many candidates (a graph
without natural cuts) is cut further, dropping the candidates across the cut.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import csr_matrix

from kiln.compiler.fusion.aliases import (
    GraphIndex,
    candidate_spans,
    cut_large_regions,
    required_storage,
    split_regions,
)
from kiln.compiler.fusion.candidates import CPU_TARGET, Candidate, FusionTarget
from kiln.compiler.fusion.greedy import greedy_fusion
from kiln.compiler.fusion.schedule import Orchestration, cost_list, schedule_order
from kiln.compiler.ir.graph import Graph


# -- the program ---------------------------------------------------------------
@dataclass
class _Solved:
    chosen: list[int]  # candidate indices, execution order
    status: str
    objective: float
    bound: float
    cuts: int


def _solve_region(
    ix: GraphIndex,
    cands: Sequence[Candidate],
    costs: Sequence[float],
    ks: list[int],
    start: int,
    required: set[str],
    stored: set[str],
    budget_s: float,
    mip_rel_gap: float,
    max_cuts: int,
) -> _Solved:
    """One region's BLP with deadlock cuts. ``start``: the region's first node position;
    ``stored``: values stored by the kernels chosen in earlier regions."""
    n = len(ks)
    prod: dict[str, list[int]] = {}
    for j, k in enumerate(ks):
        for t in cands[k].outputs:
            prod.setdefault(t, []).append(j)
    rows: list[dict[int, float]] = []
    lbs: list[float] = []
    ubs: list[float] = []
    for t in sorted(required):
        if t not in prod:
            raise ValueError(f"no candidate stores required value {t}")
        rows.append(dict.fromkeys(prod[t], 1.0))
        lbs.append(1.0)
        ubs.append(np.inf)
    covers: dict[str, list[int]] = {}
    for j, k in enumerate(ks):
        for name in cands[k].nodes:
            covers.setdefault(name, []).append(j)
    for name, js in covers.items():  # every needed node runs somewhere (tightens the LP)
        if ix.is_live(ix.pos[name]):
            rows.append(dict.fromkeys(js, 1.0))
            lbs.append(1.0)
            ubs.append(np.inf)
    for j, k in enumerate(ks):
        for t in cands[k].inputs:
            p = ix.producer_pos(t)
            if p is not None and p >= start:  # made in this region: a chosen kernel stores it
                row = dict.fromkeys(prod.get(t, []), 1.0)
                row[j] = -1.0
                rows.append(row)
                lbs.append(0.0)
                ubs.append(np.inf)
    c = np.array([costs[k] for k in ks])
    deadline = time.perf_counter() + budget_s
    cuts = 0
    while True:
        x, status, obj, bound = _milp(c, rows, lbs, ubs, deadline, mip_rel_gap)
        if x is None:  # out of time before any solution: one kernel per node
            return _singles(ix, cands, costs, ks, bound, cuts)
        chosen = [j for j in range(n) if x[j] > 0.5]
        order, stuck, missing = schedule_order(ix, [cands[ks[j]] for j in chosen], stored)
        if not stuck:
            return _Solved([ks[chosen[i]] for i in order], status, obj, bound, cuts)
        if cuts >= max_cuts or time.perf_counter() > deadline:
            return _singles(ix, cands, costs, ks, bound, cuts)
        stuck_j = {chosen[i] for i in stuck}
        row = dict.fromkeys(stuck_j, 1.0)
        for j, k in enumerate(ks):
            if j not in stuck_j and missing.intersection(cands[k].outputs):
                row[j] = -1.0
        rows.append(row)
        lbs.append(-np.inf)
        ubs.append(len(stuck_j) - 1.0)
        cuts += 1


def _singles(
    ix: GraphIndex,
    cands: Sequence[Candidate],
    costs: Sequence[float],
    ks: list[int],
    bound: float,
    cuts: int,
) -> _Solved:
    """The always-valid fallback: one single-node kernel per needed node, in graph order."""
    single = {next(iter(cands[k].nodes)): k for k in ks if len(cands[k].nodes) == 1}
    needed = {n for k in ks for n in cands[k].nodes if ix.is_live(ix.pos[n])}
    if not needed <= single.keys():
        raise RuntimeError("BLP out of time and some node has no single-node candidate")
    chosen = [single[n] for n in sorted(needed, key=ix.pos.__getitem__)]
    obj = sum(costs[k] for k in chosen)
    return _Solved(chosen, "time_limit", obj, min(bound, obj), cuts)


def _milp(
    c: np.ndarray,
    rows: list[dict[int, float]],
    lbs: list[float],
    ubs: list[float],
    deadline: float,
    mip_rel_gap: float,
) -> tuple[np.ndarray | None, str, float, float]:
    """Solve one 0/1 program; returns (x or None, status, objective, dual bound)."""
    n = len(c)
    if not rows:  # nothing required: choose nothing
        return np.zeros(n), "optimal", 0.0, 0.0
    data, ri, ci = [], [], []
    for r, row in enumerate(rows):
        for j, v in row.items():
            ri.append(r)
            ci.append(j)
            data.append(v)
    a = csr_matrix((data, (ri, ci)), shape=(len(rows), n))
    options = {"time_limit": max(deadline - time.perf_counter(), 0.1), "mip_rel_gap": mip_rel_gap}
    res = milp(
        c,
        constraints=LinearConstraint(a, np.array(lbs), np.array(ubs)),
        integrality=np.ones(n),
        bounds=Bounds(0, 1),
        options=options,
    )
    if res.status == 2:
        raise ValueError(f"kernel selection is infeasible: {res.message}")
    raw = getattr(res, "mip_dual_bound", None)
    bound = float(raw) if raw is not None and math.isfinite(raw) else None
    if res.x is None:
        return None, "time_limit", math.inf, bound or 0.0
    obj = float(res.fun)
    if res.status == 0:
        return np.round(res.x), "optimal", obj, obj if bound is None else min(bound, obj)
    return np.round(res.x), "time_limit", obj, bound or 0.0


def orchestrate(
    graph: Graph,
    candidates: Sequence[Candidate],
    costs: Mapping[Candidate, float] | Sequence[float],
    *,
    time_limit_s: float = 5.0,
    mip_rel_gap: float = 0.0,
    max_cuts: int = 1000,
    max_region_candidates: int = 500,
    target: FusionTarget = CPU_TARGET,
) -> Orchestration:
    """Choose the cheapest deadlock-free set of candidate kernels (see module docstring).

    ``costs`` maps each candidate to µs (or is a sequence parallel to ``candidates``).
    Regions with more than ``max_region_candidates`` candidates are cut further,
    dropping the candidates that cross the cut (reported as ``n_dropped``).
    The solver gets ``time_limit_s`` in all, shared among regions by size; a region
    out of time keeps its best program (status "time_limit", see ``gap``), or one
    kernel per node if it found none. Realistic graphs solve to optimality in far less.
    Raises ValueError when a needed node has no candidate.
    """
    t0 = time.perf_counter()
    deadline = t0 + time_limit_s
    cands = list(candidates)
    cost = cost_list(cands, costs)
    ix = GraphIndex(graph)
    spans = candidate_spans(ix, [c.nodes for c in cands])
    keep = cut_large_regions(spans, max_region_candidates)
    starts, region_of = split_regions(spans, keep)
    required = required_storage(ix, starts)
    by_region: list[list[int]] = [[] for _ in starts]
    for k, r in zip(keep, region_of):
        by_region[r].append(k)
    chosen: list[int] = []
    stored: set[str] = set()
    statuses, bound, cuts = set(), 0.0, 0
    left = len(keep)
    for r, ks in enumerate(by_region):
        budget = max(deadline - time.perf_counter(), 0.0) * len(ks) / left
        left -= len(ks)
        s = _solve_region(
            ix, cands, cost, ks, starts[r], required[r], stored, budget, mip_rel_gap, max_cuts
        )
        chosen += s.chosen
        stored.update(t for k in s.chosen for t in cands[k].outputs)
        statuses.add(s.status)
        bound += s.bound
        cuts += s.cuts
    objective = sum(cost[k] for k in chosen)
    exact = len(keep) == len(cands)  # else the bound only holds for the kept candidates
    result = Orchestration(
        kernels=tuple(cands[k] for k in chosen),
        costs=tuple(cost[k] for k in chosen),
        status="optimal" if statuses <= {"optimal"} and exact else "time_limit",
        objective=objective,
        bound=min(bound, objective) if exact else math.nan,
        gap=max(objective - bound, 0.0) / max(abs(objective), 1e-12) if exact else math.nan,
        solve_time=time.perf_counter() - t0,
        n_candidates=len(cands),
        n_variables=len(keep),
        cuts=cuts,
        n_regions=len(starts),
        n_dropped=len(cands) - len(keep),
    )
    if result.status == "optimal":
        return result
    return _no_worse_than_greedy(graph, cands, cost, result, t0, target)


def _no_worse_than_greedy(
    graph: Graph,
    cands: Sequence[Candidate],
    cost: Sequence[float],
    result: Orchestration,
    t0: float,
    target: FusionTarget,
) -> Orchestration:
    """When the BLP was cut short (time limit, dropped candidates), return greedy
    fusion over the same candidates if that is cheaper: never worse than the baseline."""
    size = max(len(c.nodes) for c in cands)
    try:
        greedy = greedy_fusion(graph, dict(zip(cands, cost)), max_nodes=size, target=target)
    except ValueError:  # candidates not from enumerate_candidates: no greedy baseline
        return replace(result, solve_time=time.perf_counter() - t0)
    if greedy.objective >= result.objective:
        return replace(result, solve_time=time.perf_counter() - t0)
    return replace(
        greedy,
        status="greedy_fallback",
        bound=result.bound,
        gap=max(greedy.objective - result.bound, 0.0) / max(greedy.objective, 1e-12),
        solve_time=time.perf_counter() - t0,
        n_candidates=result.n_candidates,
        n_variables=result.n_variables,
        cuts=result.cuts,
        n_regions=result.n_regions,
        n_dropped=result.n_dropped,
    )
