"""Greedy fusion: the baseline the BLP is compared with.

Start with one kernel per live non-view node. Repeatedly merge the producer/
consumer pair of kernels whose merge saves the most predicted time
(cost(A) + cost(B) - cost(A u B) > 0), as long as the merged node set is a
legal template, at most ``max_nodes`` nodes, and the kernels still have an
execution order (no kernel both before and after the merged one). This is
how pairwise fusers such as Inductor's scheduler work; it never recomputes
a node, so its programs are a subset of what the BLP can choose.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Mapping

from kiln.compiler.fusion.aliases import GraphIndex, members
from kiln.compiler.fusion.candidates import (
    CPU_TARGET,
    Candidate,
    FusionTarget,
    TemplateRules,
    build_candidate,
)
from kiln.compiler.fusion.schedule import Orchestration, schedule_order
from kiln.compiler.ir.graph import Graph

CostFn = Mapping[Candidate, float] | Callable[[Candidate], float]


class _Partition:
    """Disjoint kernels (node bitsets) keyed by a representative node position."""

    def __init__(self, ix: GraphIndex) -> None:
        self.ix = ix
        self.mask = {i: 1 << i for i in members(ix.fusible)}
        self.group = {i: i for i in members(ix.fusible)}
        self.version = dict.fromkeys(self.mask, 0)

    def neighbours(self, g: int) -> set[int]:
        """Kernels joined to ``g`` by a direct producer/consumer edge."""
        near = 0
        for i in members(self.mask[g]):
            near |= self.ix.nbr[i]
        return {self.group[i] for i in members(near & ~self.mask[g])}

    def cyclic_after_merge(self, merged: int) -> bool:
        """Would a kernel made of ``merged`` both depend on and feed another kernel?"""
        ix, reach = self.ix, 0
        frontier = 0
        for i in members(merged):
            frontier |= ix.succ[i]
        frontier &= ~merged
        while frontier:
            reach |= frontier
            new = 0
            for i in members(frontier):
                new |= ix.succ[i]
                g = self.group.get(i)
                if g is not None:
                    new |= self.mask[g]  # the whole kernel runs after ``merged``
            if new & merged:
                return True
            frontier = new & ~reach
        return False

    def merge(self, a: int, b: int) -> None:
        self.mask[a] |= self.mask.pop(b)
        for i in members(self.mask[a]):
            self.group[i] = a
        self.version[a] += 1
        del self.version[b]


def greedy_fusion(
    graph: Graph, costs: CostFn, max_nodes: int = 16, target: FusionTarget = CPU_TARGET
) -> Orchestration:
    """Greedy pairwise fusion under ``costs`` (a mapping from candidates to µs, e.g. the
    BLP's, or a callable). With a mapping, merges outside it are not considered."""
    t0 = time.perf_counter()
    ix = GraphIndex(graph)
    rules = TemplateRules(ix, target)
    part = _Partition(ix)
    evaluated = 0

    def price(mask: int) -> tuple[Candidate, float] | None:
        nonlocal evaluated
        template = rules.template(mask)
        if template is None:
            return None
        cand = build_candidate(ix, mask, template)
        evaluated += 1
        if isinstance(costs, Mapping):
            return (cand, float(costs[cand])) if cand in costs else None
        return cand, float(costs(cand))

    kernel: dict[int, tuple[Candidate, float]] = {}
    for g, mask in part.mask.items():
        priced = price(mask)
        if priced is None:
            raise ValueError(f"no cost for the single-node kernel {ix.nodes[g].name}")
        kernel[g] = priced

    heap: list[tuple[float, int, int, int, int, int]] = []
    tie = itertools.count()
    merged_kernels: dict[int, tuple[Candidate, float]] = {}

    def consider(a: int, b: int) -> None:
        mask = part.mask[a] | part.mask[b]
        if mask.bit_count() > max_nodes:
            return
        priced = price(mask)
        if priced is None:
            return
        saving = kernel[a][1] + kernel[b][1] - priced[1]
        if saving > 1e-12:
            key = next(tie)
            merged_kernels[key] = priced
            heapq.heappush(heap, (-saving, key, a, b, part.version[a], part.version[b]))

    for a in list(part.mask):
        for b in part.neighbours(a):
            if a < b:
                consider(a, b)
    while heap:
        _, key, a, b, va, vb = heapq.heappop(heap)
        priced = merged_kernels.pop(key)
        if part.version.get(a) != va or part.version.get(b) != vb:
            continue  # one side changed since this pair was priced
        if part.cyclic_after_merge(part.mask[a] | part.mask[b]):
            continue
        part.merge(a, b)
        del kernel[b]
        kernel[a] = priced
        for g in part.neighbours(a):
            consider(a, g)

    chosen = [kernel[g][0] for g in sorted(kernel)]
    order, stuck, _ = schedule_order(ix, chosen)
    assert not stuck, "greedy partitions are acyclic by construction"
    kernels = tuple(chosen[k] for k in order)
    cost = tuple(kernel[g][1] for g in sorted(kernel))
    ordered_costs = tuple(cost[k] for k in order)
    total = sum(ordered_costs)
    return Orchestration(
        kernels=kernels,
        costs=ordered_costs,
        status="greedy",
        objective=total,
        bound=float("nan"),
        gap=float("nan"),
        solve_time=time.perf_counter() - t0,
        n_candidates=evaluated,
        n_variables=0,
        cuts=0,
        n_regions=1,
    )
