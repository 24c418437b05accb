"""What an orchestration is and how its kernels are ordered, shared by the BLP and the greedy baseline.

``Orchestration`` is the chosen kernel set with the solver's figures; ``schedule_order``
orders kernels so each runs after a kernel that stores every intermediate it reads (and
finds the ones that deadlock); ``check_program`` checks a kernel list end to end.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kiln.compiler.fusion.aliases import GraphIndex
from kiln.compiler.fusion.candidates import (
    CPU_TARGET,
    Candidate,
    FusionTarget,
    TemplateRules,
    kernel_io,
)
from kiln.compiler.ir.graph import Graph


@dataclass(frozen=True)
class Orchestration:
    """The chosen kernels in a valid execution order, and how the choice was made.

    status:      "optimal"; "time_limit" (best found in time, or candidates were dropped
                 to keep regions small); "greedy_fallback" (greedy fusion beat that);
                 "greedy" (from ``greedy_fusion``)
    objective:   total predicted cost (µs); bound: the solver's dual (lower) bound
                 (nan when candidates were dropped); gap: (objective - bound) / objective
    solve_time:  seconds; n_variables: candidates in the BLP (n_candidates - n_dropped);
    cuts:        deadlock cuts added; n_regions: independent sub-programs solved
    """

    kernels: tuple[Candidate, ...]
    costs: tuple[float, ...]
    status: str
    objective: float
    bound: float
    gap: float
    solve_time: float
    n_candidates: int
    n_variables: int
    cuts: int
    n_regions: int
    n_dropped: int = 0  # candidates dropped to keep regions small


def cost_list(
    candidates: Sequence[Candidate], costs: Mapping[Candidate, float] | Sequence[float]
) -> list[float]:
    """Costs aligned with ``candidates`` (from a mapping or a parallel sequence)."""
    if isinstance(costs, Mapping):
        out = [float(costs[c]) for c in candidates]
    else:
        out = [float(c) for c in costs]
        if len(out) != len(candidates):
            raise ValueError(f"{len(out)} costs for {len(candidates)} candidates")
    if any(not math.isfinite(c) or c < 0 for c in out):
        raise ValueError("candidate costs must be finite and >= 0")
    return out


# -- scheduling ----------------------------------------------------------------
def schedule_order(
    ix: GraphIndex, kernels: Sequence[Candidate], available: Iterable[str] = ()
) -> tuple[list[int], list[int], set[str]]:
    """Order kernels so each runs after some kernel storing each intermediate it reads.

    Returns (order, stuck, missing): indices run in order, indices that can never run,
    and the values the stuck ones wait for. Ready kernels run earliest node first.
    """
    avail = set(available)
    waiting: dict[str, list[int]] = {}
    need = []
    heap: list[tuple[int, int]] = []
    for k, c in enumerate(kernels):
        miss = {t for t in c.inputs if ix.is_intermediate(t) and t not in avail}
        need.append(miss)
        for t in miss:
            waiting.setdefault(t, []).append(k)
        if not miss:
            heapq.heappush(heap, (min(ix.pos[n] for n in c.nodes), k))
    order: list[int] = []
    while heap:
        _, k = heapq.heappop(heap)
        order.append(k)
        for t in kernels[k].outputs:
            if t in avail:
                continue
            avail.add(t)
            for w in waiting.pop(t, []):
                need[w].discard(t)
                if not need[w]:
                    heapq.heappush(heap, (min(ix.pos[n] for n in kernels[w].nodes), w))
    ran = set(order)
    stuck = [k for k in range(len(kernels)) if k not in ran]
    return order, stuck, set().union(*(need[k] for k in stuck))


def schedule_kernels(graph: Graph, kernels: Sequence[Candidate]) -> list[Candidate]:
    """``kernels`` in a valid execution order; ValueError if they deadlock."""
    ix = GraphIndex(graph)
    order, stuck, missing = schedule_order(ix, kernels)
    if stuck:
        raise ValueError(f"{len(stuck)} kernels deadlock waiting for {sorted(missing)}")
    return [kernels[k] for k in order]


def check_program(
    graph: Graph, kernels: Sequence[Candidate], target: FusionTarget = CPU_TARGET
) -> None:
    """Raise ValueError unless ``kernels``, run in this order, are each template-legal
    with the right in/out sets, read only values stored earlier, and store every output."""
    ix = GraphIndex(graph)
    rules = TemplateRules(ix, target)
    avail: set[str] = set()
    for c in kernels:
        mask = ix.mask(c.nodes)
        if rules.template(mask) != c.template:
            raise ValueError(f"{sorted(c.nodes)} is not a legal {c.template!r} kernel")
        if kernel_io(ix, mask) != (c.outputs, c.inputs):
            raise ValueError(f"wrong in/out sets for kernel {sorted(c.nodes)}")
        missing = [t for t in c.inputs if ix.is_intermediate(t) and t not in avail]
        if missing:
            raise ValueError(f"kernel {sorted(c.nodes)} runs before {missing} is stored")
        avail.update(c.outputs)
    for o in graph.outputs:
        if ix.is_intermediate(ix.root[o]) and ix.root[o] not in avail:
            raise ValueError(f"graph output {o} (storage {ix.root[o]}) is never stored")
