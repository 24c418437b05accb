"""Candidate kernels: template-legal, convex, connected sets of primitive nodes.

A ``Candidate`` is a set of IR nodes plus the codegen template that runs it
(``pointwise``, ``reduction``, ``gemm``, ``conv``, ``dwconv``, ``dconv``, ``wconv`` or
``single``; the rules are in ``legal_template``). A node set may have several templates (a
depthwise conv with a bias and a ReLU runs natively as ``dwconv`` or through oneDNN as
``conv``; a 3x3 channels-last conv directly as ``dconv``, by Winograd's algorithm as
``wconv`` on targets that have it, or through oneDNN): each is a candidate of its own,
and the cost model picks. ``out(k)`` are the values it must store (graph outputs
or values read outside the kernel, views included); ``in(k)`` are the storage
roots it reads that it does not produce (constants excluded: always available).

``enumerate_candidates`` grows connected sets from every seed node over direct
producer/consumer edges, smallest first, using only nodes after the seed (so
each set is generated from one seed, its first node). Each step adds one
neighbour and takes the convex hull (every node on a path between members):
any legal kernel containing the set contains its hull, so only convex sets are
visited. A hull that breaks a rule no superset can repair (a view or an opaque
op inside, two GEMMs, mismatched reductions, ...) is not grown further. Size
and a per-seed budget bound the work: enumeration is polynomial in graph size.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from kiln.compiler.fusion.aliases import GraphIndex, members
from kiln.compiler.fusion.convs import (
    is_dense_nhwc_conv,
    is_depthwise_conv,
    is_pointwise_conv,
    onednn_chained,
    onednn_post_ops_ok,
    winograd_ok,
)
from kiln.compiler.ir.graph import LAYOUT_VIEWS, Graph, Node, OpClass

log = logging.getLogger(__name__)

TEMPLATES = ("pointwise", "reduction", "gemm", "conv", "dwconv", "dconv", "wconv", "single")
BOOL_OPS = frozenset(
    {"eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not"}
)
CHAIN_MAX_WIDTH = 256  # widest GEMM-chain intermediate a GPU kernel keeps on chip
CPU_CHAIN_MAX_WIDTH = 1024  # ... a CPU thread keeps in its scratch rows (L2-resident)


@dataclass(frozen=True)
class FusionTarget:
    """What a backend's templates can hold: the dtypes its kernels load and store;
    whether it fuses chains of GEMMs (``chain``: GEMM -> epilogue -> GEMM ..., the
    intermediates never stored) up to ``chain_width`` columns wide, and whether its
    chains run row block by row block (``chain_rows``, the CPU: each right operand a
    constant packed at compile time, each stage reading only its own values and the
    previous stage's result); whether it has an ``attention`` template, and a ``wconv``
    template (3x3 convs by Winograd's algorithm)."""

    name: str
    dtypes: tuple[torch.dtype, ...]
    chains: bool = False
    chain_width: int = CHAIN_MAX_WIDTH
    chain_rows: bool = False
    attention: bool = False
    winograd: bool = False


CPU_TARGET = FusionTarget(
    "cpu", (torch.float32, torch.bool), chains=True, chain_width=CPU_CHAIN_MAX_WIDTH,
    chain_rows=True, winograd=True,
)  # fmt: skip
GPU_TARGET = FusionTarget(
    "gpu", (torch.float32, torch.float16, torch.bfloat16, torch.bool), chains=True,
    attention=True,
)  # fmt: skip


@dataclass(frozen=True)
class Candidate:
    """One possible kernel. ``outputs``/``inputs`` are value names in graph order."""

    template: str
    nodes: frozenset[str]
    outputs: tuple[str, ...]
    inputs: tuple[str, ...]


# -- per-node facts ------------------------------------------------------------
def _node_kind(
    graph: Graph, node: Node, dtypes: tuple[torch.dtype, ...], chained: set[str] | None
) -> str:
    """'pw', 'red', 'mm', 'conv', 'dw' (a depthwise conv the CPU's native template runs,
    see ``convs.py``: not one of the ``chained``; None: no such template), 'pwc' (a 1x1
    conv the CPU's gemm template runs), 'dc' (a dense channels-last conv the CPU's dconv
    template runs) for nodes a native template may hold, else 'other'.

    Native templates compute in float (bool only from comparison/logical ops and casts),
    on values of the target's ``dtypes``.
    """
    if node.cls == OpClass.LAYOUT:
        return "view" if node.op in LAYOUT_VIEWS else "other"
    out = graph.meta(node.output).dtype
    out_ok = (out in dtypes and out.is_floating_point) or (
        out == torch.bool and node.op in BOOL_OPS | {"cast"}
    )
    ins_ok = all(graph.meta(v).dtype in dtypes for v in node.inputs)
    if not (out_ok and ins_ok):
        return "other"
    if node.cls == OpClass.POINTWISE:
        return "pw"
    if node.cls == OpClass.REDUCTION:
        return "red"
    if node.op in ("mm", "bmm"):
        return "mm"
    if chained is not None and node.name not in chained and is_depthwise_conv(graph, node):
        return "dw"
    if chained is not None and is_pointwise_conv(graph, node):
        return "pwc"
    if chained is not None and is_dense_nhwc_conv(graph, node):
        return "dc"
    return "conv" if node.op == "conv" else "other"


class TemplateRules:
    """Template legality over one ``GraphIndex`` (node sets are bitsets).

    ``template(mask)`` decides legality exactly; ``extendable(hull)`` checks only the
    rules no superset can repair, to prune enumeration and greedy merging."""

    def __init__(self, index: GraphIndex, target: FusionTarget = CPU_TARGET) -> None:
        self.ix = index
        self.target = target
        g = index.graph
        chained = onednn_chained(g) if target.name == "cpu" else None
        self.kind = [_node_kind(g, n, target.dtypes, chained) for n in index.nodes]
        self.shape = [g.meta(n.output).shape for n in index.nodes]
        self.winograd = {  # dense convs the wconv template may run
            i for i, k in enumerate(self.kind)
            if k == "dc" and target.winograd and winograd_ok(g, index.nodes[i])
        }  # fmt: skip
        self.blocked = 0  # nodes that never share a kernel
        self.heavy = 0  # mm/bmm/conv: at most one per kernel
        for i, k in enumerate(self.kind):
            if k in ("view", "other"):
                self.blocked |= 1 << i
            if k in ("mm", "conv", "dw", "pwc", "dc"):
                self.heavy |= 1 << i

    def _red_key(self, i: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """(input shape, dims) of a row reduction (trailing dims, keepdim), else None."""
        node = self.ix.nodes[i]
        s_in = self.ix.graph.meta(node.inputs[0]).shape
        r = len(s_in)
        dims = tuple(sorted({d % r for d in node.attrs["dims"]})) if r else ()
        if not dims or not node.attrs.get("keepdim") or dims != tuple(range(r - len(dims), r)):
            return None
        return s_in, dims

    def extendable(self, hull: int) -> bool:
        """Can some legal multi-node kernel contain ``hull``? (Monotone rules only.)"""
        if hull & self.blocked or (hull & self.heavy).bit_count() > 1:
            return False
        ix, kinds = self.ix, self.kind
        red_keys, shapes, mm_shape, conv_eps = set(), set(), None, 0
        for i in members(hull):
            if ix.view_src[i] & hull:
                return False
            k = kinds[i]
            if k == "red":
                red_keys.add(self._red_key(i))
            elif k in ("mm", "dw", "pwc", "dc"):  # a superset of what the conv template allows
                mm_shape = self.shape[i]
            elif k == "pw":
                shapes.add(self.shape[i])
                conv_eps += 1
        if None in red_keys or len(red_keys) > 1 or len(shapes) > 2:
            return False
        if mm_shape is not None:
            return not red_keys and shapes <= {mm_shape}
        if hull & self.heavy:  # conv: bias add, then relu or a clamp (hardtanh) at most
            return not red_keys and conv_eps <= 3
        if red_keys:
            s_in, dims = next(iter(red_keys))  # type: ignore[misc]
            return shapes <= {s_in, _keepdim(s_in, dims)}
        return True

    def template(self, mask: int) -> str | None:
        """The template that runs this node set (the first of ``templates``), or None if
        no template is legal."""
        return next(iter(self.templates(mask)), None)

    def templates(self, mask: int) -> list[str]:
        """Every template that may run this node set: a depthwise or 1x1 conv with oneDNN's
        post-ops runs natively (``dwconv`` / ``gemm``) or as oneDNN's call (``conv``), a
        dense channels-last one also by Winograd's algorithm (``wconv``, where
        ``convs.winograd_ok``); other sets have at most one."""
        main = self._template(mask)
        heavy = self.heavy & mask
        if (
            main in ("dwconv", "gemm", "dconv")
            and self.ix.nodes[heavy.bit_length() - 1].op == "conv"
        ):
            out = [main]
            if main == "dconv" and heavy.bit_length() - 1 in self.winograd:
                out.append("wconv")
            eps = list(members(mask & ~heavy))
            if onednn_post_ops_ok(self.ix, mask, heavy.bit_length() - 1, eps):
                out.append("conv")
            return out
        return [main] if main else []

    def _template(self, mask: int) -> str | None:
        ix = self.ix
        if not mask or mask & ~ix.fusible:
            return None
        if mask.bit_count() == 1:
            k = self.kind[mask.bit_length() - 1]
            single = {"pw": "pointwise", "red": "reduction", "mm": "gemm", "conv": "conv"}
            return {**single, "dw": "dwconv", "pwc": "gemm", "dc": "dconv"}.get(k, "single")
        if self.target.chains and (mask & self.heavy).bit_count() > 1:
            return "chain" if self._chain_ok(mask) else None
        if not self.extendable(mask) or not ix.is_convex(mask) or not self._connected(mask):
            return None
        kinds = ("pw", "red", "mm", "conv", "dw", "pwc", "dc")
        by_kind: dict[str, list[int]] = {k: [] for k in kinds}
        for i in members(mask):
            by_kind[self.kind[i]].append(i)
        if by_kind["mm"] or by_kind["pwc"]:
            return "gemm" if self._gemm_ok(mask, (by_kind["mm"] + by_kind["pwc"])[0]) else None
        if by_kind["dw"]:
            return "dwconv" if self._gemm_ok(mask, by_kind["dw"][0]) else None
        if by_kind["dc"]:
            return "dconv" if self._gemm_ok(mask, by_kind["dc"][0]) else None
        if by_kind["conv"]:
            conv_ok = onednn_post_ops_ok(self.ix, mask, by_kind["conv"][0], by_kind["pw"])
            return "conv" if conv_ok else None
        if by_kind["red"]:
            return "reduction" if self._reduction_ok(mask, by_kind["red"][0]) else None
        # pointwise: in-kernel reads are then same-shape by construction
        return "pointwise" if len({self.shape[i] for i in by_kind["pw"]}) == 1 else None

    def _reach(self, start: int, mask: int, edges: Sequence[int]) -> int:
        """Nodes of ``mask`` reachable from the bitset ``start`` along ``edges``."""
        seen, frontier = start, start
        while frontier:
            nxt = 0
            for i in members(frontier):
                nxt |= edges[i]
            frontier = nxt & mask & ~seen
            seen |= frontier
        return seen

    def _connected(self, mask: int) -> bool:
        return self._reach(mask & -mask, mask, self.ix.nbr) == mask

    def _gemm_ok(self, mask: int, g: int) -> bool:
        """One mm/bmm (or depthwise conv); every other node is an epilogue of its output
        shape fed by it."""
        reach = self._reach(1 << g, mask, self.ix.succ)
        return reach == mask and all(self.shape[i] == self.shape[g] for i in members(mask))

    def _chain_ok(self, mask: int) -> bool:
        """GEMM chain: mm nodes only (no bmm/conv/reduction), each later mm's left operand
        computed by the previous stage and its right operand read from outside (a
        constant, for ``chain_rows`` targets); every other node a pointwise epilogue of
        its stage's output shape (reading no earlier stage's values, for ``chain_rows``,
        whose left operands may also be a ``cat`` of the previous stage's value and
        outside values); widths within the target's ``chain_width``."""
        if not self.ix.is_convex(mask) or not self._connected(mask):
            return False
        ix = self.ix
        stage: dict[str, int] = {}  # value computed in the chain -> its stage
        shapes: list[tuple[int, ...]] = []  # stage -> its mm's output shape
        for i in members(mask):  # topological order
            node, kind, shape = ix.nodes[i], self.kind[i], self.shape[i]
            if ix.view_src[i] & mask:  # reads a chain value through a view
                return False
            if kind == "mm":
                a, b = node.inputs
                s = len(shapes)
                if node.op != "mm" or shape[1] > self.target.chain_width:
                    return False
                if shapes and shape[0] != shapes[0][0]:
                    return False
                if stage.get(a, -1) != s - 1 or b in stage:
                    return False
                if self.target.chain_rows and not ix.is_constant(ix.root[b]):
                    return False
                stage[node.output] = s
                shapes.append(shape)
            elif kind == "pw":
                own = [stage[v] for v in node.inputs if v in stage]
                if not own or shape != shapes[max(own)]:
                    return False
                if self.target.chain_rows and min(own) != max(own):
                    return False
                stage[node.output] = max(own)
            elif node.op == "cat" and self.target.chain_rows and self._chain_cat_ok(i, mask, stage):
                stage[node.output] = len(shapes) - 1
            else:
                return False
        return len(shapes) >= 2

    def _chain_cat_ok(self, i: int, mask: int, stage: dict[str, int]) -> bool:
        """A ``cat`` inside a row-block chain (a skip connection, NeRF's and DeepSDF's
        input re-fed mid-network): along the last dim of a 2-D value, one piece the
        latest stage's value and the others read from outside, read by nothing but the
        chain's next GEMMs as their left operand."""
        ix, node = self.ix, self.ix.nodes[i]
        if len(self.shape[i]) != 2 or node.attrs["dim"] % 2 != 1:
            return False
        own = [v for v in node.inputs if v in stage]
        if len(own) != 1 or stage[own[0]] != max(stage.values()) or node.output in ix.outputs:
            return False
        readers = ix.consumers[node.output]
        return bool(readers) and all(
            mask >> j & 1 and ix.nodes[j].op == "mm" and ix.nodes[j].inputs[0] == node.output
            for j in readers
        )

    def _reduction_ok(self, mask: int, r0: int) -> bool:
        """Row kernel: reductions share (input shape, trailing dims); pointwise nodes are
        S_in or S_out shaped; in-kernel reads are same-shape or keepdim broadcasts."""
        key = self._red_key(r0)
        if key is None:
            return False
        s_in, s_out = key[0], _keepdim(*key)
        ix, nodes = self.ix, self.ix.nodes
        for i in members(mask):
            for v in nodes[i].inputs:
                p = ix.producer_pos(v)
                if p is None or not mask >> p & 1:
                    continue
                have, want = self.shape[p], self.shape[i]
                if self.kind[i] == "red":
                    want = s_in
                if have != want and not (have == s_out and want == s_in):
                    return False
        return True


def _keepdim(s_in: tuple[int, ...], dims: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(1 if d in dims else s for d, s in enumerate(s_in))


# -- candidate construction ----------------------------------------------------
def kernel_io(index: GraphIndex, mask: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(out(k), in(k)) of a node bitset: stored values (graph outputs, or read by a node
    outside, views included) and non-constant storage roots read from outside."""
    outs: list[str] = []
    ins: dict[str, None] = {}
    for i in members(mask):
        node = index.nodes[i]
        v = node.output
        if v in index.outputs or any(not mask >> j & 1 for j in index.consumers[v]):
            outs.append(v)
        for u in node.inputs:
            r = index.root[u]
            p = index.producer_pos(r)
            if index.is_constant(r) or (p is not None and mask >> p & 1):
                continue
            ins[r] = None
    return tuple(outs), tuple(ins)


def build_candidate(index: GraphIndex, mask: int, template: str) -> Candidate:
    """The candidate for a node bitset whose template is already known."""
    outs, ins = kernel_io(index, mask)
    return Candidate(template, index.names(mask), outs, ins)


def legal_template(
    graph: Graph,
    nodes: Iterable[str],
    index: GraphIndex | None = None,
    target: FusionTarget = CPU_TARGET,
) -> str | None:
    """The template that may run ``nodes`` as one kernel, or None if none may."""
    ix = index or GraphIndex(graph)
    return TemplateRules(ix, target).template(ix.mask(nodes))


def make_candidate(
    graph: Graph,
    nodes: Iterable[str],
    index: GraphIndex | None = None,
    target: FusionTarget = CPU_TARGET,
) -> Candidate:
    """The candidate kernel for a node set; raises ValueError if no template is legal."""
    ix = index or GraphIndex(graph)
    mask = ix.mask(nodes)
    template = TemplateRules(ix, target).template(mask)
    if template is None:
        raise ValueError(f"no legal kernel template for nodes {sorted(ix.names(mask))}")
    return build_candidate(ix, mask, template)


def enumerate_candidates(
    graph: Graph,
    max_nodes: int = 12,
    max_sets_per_seed: int = 128,
    index: GraphIndex | None = None,
    target: FusionTarget = CPU_TARGET,
) -> list[Candidate]:
    """All legal candidate kernels of up to ``max_nodes`` live non-view nodes.

    Every live non-view node gets its singleton candidate, so a program always
    exists. ``max_sets_per_seed`` caps the sets explored from one seed (smallest
    first); hitting it is logged, and only costs fusion opportunities.
    """
    ix = index or GraphIndex(graph)
    rules = TemplateRules(ix, target)
    out: list[Candidate] = []
    for seed in members(ix.fusible):
        seed_bit = 1 << seed
        for t in rules.templates(seed_bit) or ["single"]:
            out.append(build_candidate(ix, seed_bit, t))
        if not rules.extendable(seed_bit):
            continue
        above = ix.fusible & ~(seed_bit - 1)  # the seed and the nodes after it
        # smallest sets first; each entry's descendants/ancestors ride along
        heap = [(1, seed_bit)]
        reach = {seed_bit: (ix.desc[seed], ix.anc[seed])}
        while heap and len(reach) <= max_sets_per_seed:
            _, mask = heapq.heappop(heap)
            d, a = reach[mask]
            frontier = 0
            for i in members(mask):
                frontier |= ix.nbr[i]
            for u in members(frontier & above & ~mask):
                d2, a2 = d | ix.desc[u], a | ix.anc[u]
                hull = mask | 1 << u | (d2 & a2)  # any convex superset contains it
                if hull in reach:
                    continue
                reach[hull] = (d2, a2)
                if hull & ~above or hull.bit_count() > max_nodes or not rules.extendable(hull):
                    continue
                heapq.heappush(heap, (hull.bit_count(), hull))
                for t in rules.templates(hull):
                    out.append(build_candidate(ix, hull, t))
        if heap:
            log.info("candidate budget reached at seed %s", ix.nodes[seed].name)
    return out
