"""Storage aliasing, the graph index and regions shared by the fusion stages.

Layout views (``view``, ``permute``, ``expand``, ``slice``) never run as kernels:
a view's output is an alias of its input's storage. ``layout.storage_root`` follows view
producers back to the value that owns the storage; kernels read and write
storage roots only.

``GraphIndex`` precomputes, once per graph, what candidate enumeration, the
binary linear program and the greedy baseline all ask many times: node
positions, liveness (does a node contribute to a graph output?), storage roots,
reachability bitsets and the producer/consumer edges that kernels may fuse over.
Node sets are Python ints used as bitsets over node positions (bit ``i`` is
``graph.nodes[i]``), which keeps set algebra on 500-node graphs cheap.

Regions split a graph, for kernel selection, at positions no candidate kernel
spans (see ``orchestrate.py`` for why that split is exact).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence

from kiln.compiler.ir.graph import LAYOUT_VIEWS, Graph, Node, ValueKind
from kiln.compiler.ir.layout import storage_root


def is_view(node: Node) -> bool:
    """True for layout views: aliases of their input, never inside a kernel."""
    return node.op in LAYOUT_VIEWS


def bits(positions: Iterable[int]) -> int:
    """Bitset with the given positions set."""
    out = 0
    for p in positions:
        out |= 1 << p
    return out


def members(mask: int) -> Iterator[int]:
    """Positions set in a bitset, ascending."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class GraphIndex:
    """Read-only facts about one graph, indexed by node position.

    Attributes (``i`` is a node position in ``graph.nodes``):
      pos[name]       position of a node
      root[value]     storage root of every value
      live            bitset of nodes whose output reaches a graph output (views included)
      fusible         bitset of live non-view nodes: the nodes kernels are made of
      desc[i]/anc[i]  bitsets of strict descendants/ancestors over all nodes (views too)
      succ[i]         bitset of nodes reading node i's output directly
      nbr[i]          fusible nodes joined to i by a direct (view-free) value edge
      view_src[i]     bitset of producers of storage roots node i reads through views
      consumers[v]    positions of live nodes reading value v directly (views included)
      output_roots    storage roots of the graph outputs
    """

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.nodes: list[Node] = list(graph.nodes)
        self.by_name: dict[str, Node] = {n.name: n for n in self.nodes}
        self.pos: dict[str, int] = {n.name: i for i, n in enumerate(self.nodes)}
        self.root: dict[str, str] = {}
        for v in graph.values:
            self.root[v] = storage_root(graph, v)
        self.outputs: frozenset[str] = frozenset(graph.outputs)
        self.output_roots: frozenset[str] = frozenset(self.root[o] for o in graph.outputs)
        self._index_edges()

    # -- construction -------------------------------------------------------
    def _producer_pos(self, value: str) -> int | None:
        p = self.graph.values[value].producer
        return None if p is None else self.pos[p]

    def _index_edges(self) -> None:
        n = len(self.nodes)
        self.succ = [0] * n
        self.view_src = [0] * n
        self.consumers: dict[str, list[int]] = {v: [] for v in self.graph.values}
        for i, node in enumerate(self.nodes):
            for v in dict.fromkeys(node.inputs):
                p = self._producer_pos(v)
                if p is not None:
                    self.succ[p] |= 1 << i
                rp = self._producer_pos(self.root[v])
                if rp is not None and rp != p:
                    self.view_src[i] |= 1 << rp  # read through a view chain
        live_values = set(self.graph.outputs)
        self.live = 0
        for i in range(n - 1, -1, -1):
            if self.nodes[i].output in live_values:
                self.live |= 1 << i
                live_values.update(self.nodes[i].inputs)
        for i, node in enumerate(self.nodes):
            if self.live >> i & 1:
                for v in dict.fromkeys(node.inputs):
                    self.consumers[v].append(i)
        self.fusible = bits(
            i for i, nd in enumerate(self.nodes) if self.live >> i & 1 and not is_view(nd)
        )
        self.desc = [0] * n
        for i in range(n - 1, -1, -1):
            d = self.succ[i]
            for j in members(self.succ[i]):
                d |= self.desc[j]
            self.desc[i] = d
        self.anc = [0] * n
        for i in range(n):
            for j in members(self.succ[i]):
                self.anc[j] |= self.anc[i] | (1 << i)
        self.nbr = [0] * n
        for i in members(self.fusible):
            direct = self.succ[i] & self.fusible
            self.nbr[i] |= direct
            for j in members(direct):
                self.nbr[j] |= 1 << i

    # -- queries ------------------------------------------------------------
    def producer_pos(self, value: str) -> int | None:
        """Position of the node producing ``value`` (None for inputs and constants)."""
        return self._producer_pos(value)

    def is_constant(self, value: str) -> bool:
        return self.graph.values[value].kind in (ValueKind.PARAM, ValueKind.CONST)

    def is_intermediate(self, value: str) -> bool:
        return self.graph.values[value].kind == ValueKind.INTERMEDIATE

    def is_live(self, i: int) -> bool:
        return bool(self.live >> i & 1)

    def names(self, mask: int) -> frozenset[str]:
        """Node names of a bitset."""
        return frozenset(self.nodes[i].name for i in members(mask))

    def mask(self, names: Iterable[str]) -> int:
        """Bitset of node names."""
        return bits(self.pos[n] for n in names)

    def is_convex(self, mask: int) -> bool:
        """No path leaves the set and re-enters it (views count as outside nodes)."""
        return self.hull(mask) == mask

    def hull(self, mask: int) -> int:
        """Smallest convex superset: the set plus every node on a path between two members."""
        d = a = 0
        for i in members(mask):
            d |= self.desc[i]
            a |= self.anc[i]
        return mask | (d & a)


# -- regions: where the kernel-selection program splits ----------------------------
def candidate_spans(ix: GraphIndex, kernels: Sequence[Iterable[str]]) -> list[tuple[int, int]]:
    """(first, last) node position of each kernel (a set of node names); raises
    ValueError if some needed node is in none of them."""
    spans = []
    covered = 0
    for nodes in kernels:
        pos = [ix.pos[n] for n in nodes]
        spans.append((min(pos), max(pos)))
        for p in pos:
            covered |= 1 << p
    uncovered = ix.fusible & ~covered
    if uncovered:
        raise ValueError(f"no candidate covers nodes {sorted(ix.names(uncovered))}")
    return spans


def split_regions(
    spans: Sequence[tuple[int, int]], keep: Sequence[int]
) -> tuple[list[int], list[int]]:
    """Split node positions into intervals no kept candidate spans.

    Returns (region start positions, region of each kept candidate)."""
    starts: list[int] = []
    hi = -1
    for lo, h in sorted(spans[k] for k in keep):
        if lo > hi:
            starts.append(lo)
        hi = max(hi, h)
    return starts, [bisect.bisect_right(starts, spans[k][0]) - 1 for k in keep]


def cut_large_regions(spans: Sequence[tuple[int, int]], limit: int) -> list[int]:
    """Candidates to keep so that no region has more than ``limit`` of them.

    A region that is too large (a graph with no natural cut, e.g. a dense web of
    pointwise ops) is cut at the position crossed by the fewest candidates, among
    positions leaving at least a quarter of its candidates on each side; the crossing
    candidates are dropped. Single-node candidates never cross, so a program remains.
    """
    keep = list(range(len(spans)))
    while True:
        starts, region_of = split_regions(spans, keep)
        members_of: list[list[int]] = [[] for _ in starts]
        for k, r in zip(keep, region_of):
            members_of[r].append(k)
        big = [ks for ks in members_of if len(ks) > limit]
        if not big:
            return keep
        drop: set[int] = set()
        for ks in big:
            drop.update(_best_cut(spans, ks))
        if not drop:  # only same-position candidates left: nothing to cut
            return keep
        keep = [k for k in keep if k not in drop]


def _best_cut(spans: Sequence[tuple[int, int]], ks: list[int]) -> list[int]:
    """Candidates crossing the best cut of one region (see ``cut_large_regions``)."""
    lo = min(spans[k][0] for k in ks)
    hi = max(spans[k][1] for k in ks)
    n = hi - lo + 2
    crossing = [0] * n  # crossing[b - lo]: candidates with first < b <= last
    ending = [0] * n  # candidates entirely before b
    for k in ks:
        a, z = spans[k]
        crossing[a - lo + 1] += 1
        crossing[z - lo + 1] -= 1
        ending[z - lo + 1] += 1
    best, best_b, run, left = None, lo + 1, 0, 0
    for b in range(lo + 1, hi + 1):
        run += crossing[b - lo]
        left += ending[b - lo]
        balanced = len(ks) // 4 <= left <= len(ks) - len(ks) // 4
        score = (not balanced, run)
        if best is None or score < best:
            best, best_b = score, b
    return [k for k in ks if spans[k][0] < best_b <= spans[k][1]]


def required_storage(ix: GraphIndex, starts: list[int]) -> list[set[str]]:
    """Per region: storage the region must store (graph outputs, reads by later regions)."""

    def region(p: int) -> int:
        return bisect.bisect_right(starts, p) - 1

    req: list[set[str]] = [set() for _ in starts]
    for o in ix.graph.outputs:
        p = ix.producer_pos(ix.root[o])
        if p is not None:
            req[region(p)].add(ix.root[o])
    for i in members(ix.fusible):
        for v in ix.nodes[i].inputs:
            p = ix.producer_pos(ix.root[v])
            if p is not None and region(p) != region(i):
                req[region(p)].add(ix.root[v])
    return req
