"""Candidate kernels that span several GEMMs: MLP-style chains.

The general enumerator keeps one GEMM per kernel. Here every path ``mm_1 -> epilogue
-> mm_2 -> ... -> mm_L`` (L >= 2, each later mm's left operand computed by the
previous stage) becomes ``chain`` candidates: without the last GEMM's epilogue, and
with the part of it within 1, 2, ... steps of that GEMM (a residual add may join when
the layer norm after it cannot). The BLP then weighs a chain against its separate ``gemm`` kernels
on the target's costs. On a GPU it pays when the GEMMs are small and memory-bound, and
the cost model makes it infeasible when the intermediates do not fit on chip. On the CPU
(``codegen/cpu/chain.py``) a chain runs row block by row block in one parallel region:
it pays when separate GEMMs would spend their time opening regions and waiting for each
other, and loses when there are too few rows to split between the threads.
"""

from __future__ import annotations

from kiln.compiler.fusion.aliases import GraphIndex, members
from kiln.compiler.fusion.candidates import (
    CPU_TARGET,
    Candidate,
    FusionTarget,
    TemplateRules,
    build_candidate,
)
from kiln.compiler.ir.graph import Graph


def chain_row_blocks(m: int, threads: int, mr: int) -> int:
    """Row blocks a CPU chain of ``m`` rows runs in (``mr``: the GEMM register block's
    rows): blocks of at most 8 register blocks (their scratch stays in L2), at least one
    per thread while each gets a register block's rows, and a multiple of the threads so
    their shares are equal."""
    units = -(-m // (8 * mr))
    if threads > 1:
        units = max(units, min(threads, -(-m // mr)))
        if units > 1:
            units = -(-units // threads) * threads
    return max(1, min(units, m))


def chain_candidates(
    graph: Graph,
    index: GraphIndex | None = None,
    target: FusionTarget = CPU_TARGET,
    max_len: int = 8,
) -> list[Candidate]:
    """Every legal GEMM chain of 2..``max_len`` GEMMs (none unless ``target.chains``)."""
    if not target.chains:
        return []
    ix = index or GraphIndex(graph)
    rules = TemplateRules(ix, target)
    mms = [i for i in members(ix.fusible) if rules.kind[i] == "mm" and ix.nodes[i].op == "mm"]
    levels = {i: _epilogue_levels(ix, rules, i) for i in mms}
    closure = {i: levels[i][-1] for i in mms}
    links: dict[int, list[tuple[int, int]]] = {i: [] for i in mms}  # mm -> (next mm, link node)
    for j in mms:
        p = ix.producer_pos(ix.nodes[j].inputs[0])
        if p is None:
            continue
        via = [p]  # the node the previous stage must hold; through a cat (row-block
        if target.chain_rows and ix.nodes[p].op == "cat":  # chains), one of its pieces
            via = [q for q in map(ix.producer_pos, ix.nodes[p].inputs) if q is not None]
        for i in mms:
            if i != j and any(closure[i] >> q & 1 for q in via):
                links[i].append((j, p))
    out: dict[frozenset[str], Candidate] = {}

    def grow(path: list[int], core: int) -> None:
        last = path[-1]
        if len(path) >= 2:
            for mask in (core, *(core | level for level in levels[last])):
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


def _epilogue_levels(ix: GraphIndex, rules: TemplateRules, i: int) -> list[int]:
    """The mm at ``i`` plus the pointwise nodes of its output shape reachable from it
    through such nodes within 1, 2, ... steps: the last is the whole closure."""
    shape = rules.shape[i]
    out = frontier = 1 << i
    levels = []
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
        levels.append(out)
    return levels


def _hull(ix: GraphIndex, mask: int) -> int:
    """``mask`` plus every node on a path between two of its members."""
    desc = anc = 0
    for i in members(mask):
        desc |= ix.desc[i]
        anc |= ix.anc[i]
    return mask | (desc & anc)
