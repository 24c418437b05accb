"""Candidate kernels that span several GEMMs (GPU targets): MLP-style chains.

The general enumerator keeps one GEMM per kernel. Here every path ``mm_1 -> epilogue
-> mm_2 -> ... -> mm_L`` (L >= 2, each later mm's left operand computed by the
previous stage) becomes a ``chain`` candidate, twice: without the last GEMM's epilogue
and with all of it. The BLP then weighs a chain against its separate ``gemm`` kernels
on the target's costs: it pays when the GEMMs are small and memory-bound, and the cost
model makes it infeasible when the intermediates do not fit on chip.
"""

from __future__ import annotations

from kiln.compiler.fusion.aliases import GraphIndex, members
from kiln.compiler.fusion.candidates import (
    GPU_TARGET,
    Candidate,
    FusionTarget,
    TemplateRules,
    build_candidate,
)
from kiln.compiler.ir.graph import Graph


def chain_candidates(
    graph: Graph,
    index: GraphIndex | None = None,
    target: FusionTarget = GPU_TARGET,
    max_len: int = 8,
) -> list[Candidate]:
    """Every legal GEMM chain of 2..``max_len`` GEMMs (none unless ``target.chains``)."""
    if not target.chains:
        return []
    ix = index or GraphIndex(graph)
    rules = TemplateRules(ix, target)
    mms = [i for i in members(ix.fusible) if rules.kind[i] == "mm" and ix.nodes[i].op == "mm"]
    closure = {i: _epilogue_closure(ix, rules, i) for i in mms}
    links: dict[int, list[tuple[int, int]]] = {i: [] for i in mms}  # mm -> (next mm, link node)
    for j in mms:
        p = ix.producer_pos(ix.nodes[j].inputs[0])
        for i in mms:
            if i != j and p is not None and closure[i] >> p & 1:
                links[i].append((j, p))
    out: dict[frozenset[str], Candidate] = {}

    def grow(path: list[int], core: int) -> None:
        last = path[-1]
        if len(path) >= 2:
            for mask in (core, core | closure[last]):
                hull = _hull(ix, mask)
                if rules.template(hull) == "chain":
                    c = build_candidate(ix, hull, "chain")
                    out.setdefault(c.nodes, c)
        if len(path) == max_len:
            return
        for j, p in links[last]:
            if j not in path:
                grow([*path, j], core | 1 << p | 1 << j)

    for i in mms:
        grow([i], 1 << i)
    return list(out.values())


def _epilogue_closure(ix: GraphIndex, rules: TemplateRules, i: int) -> int:
    """The mm at ``i`` plus the pointwise nodes of its output shape reachable from it
    through such nodes."""
    shape = rules.shape[i]
    out = frontier = 1 << i
    while frontier:
        nxt = 0
        for j in members(frontier):
            nxt |= ix.succ[j]
        keep = 0
        for j in members(nxt & ~out & ix.fusible):
            if rules.kind[j] == "pw" and rules.shape[j] == shape:
                keep |= 1 << j
        out |= keep
        frontier = keep
    return out


def _hull(ix: GraphIndex, mask: int) -> int:
    """``mask`` plus every node on a path between two of its members."""
    desc = anc = 0
    for i in members(mask):
        desc |= ix.desc[i]
        anc |= ix.anc[i]
    return mask | (desc & anc)
