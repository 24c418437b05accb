"""Attention candidates (GPU targets): ``bmm(q, k^T) -> scale, mask -> softmax -> bmm(., v)``
as one kernel, the (M, N) scores never stored (online softmax, ``kernels.gpu.attention``).

The pattern, as capture lowers ``softmax(q @ k^T / sqrt(d) + mask) @ v``:

    s0 = bmm(q, kT)                     (B, M, N)
    s  = s0 * c | s0 / c | s + mask     any of these, scales before the mask, views between
    mx = max(s, -1, keepdim);  e = exp(s - mx);  l = sum(e, -1, keepdim);  p = e / l
    o  = bmm(p, v)                      (B, M, Dv)

Views that only regroup the batch (``(B*H, M, N) <-> (B, H, M, N)``) may sit between the
nodes. ``match_attention`` returns the scale, the mask value and the nodes; the candidate
stores only ``o``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.compiler.fusion.aliases import GraphIndex
from kiln.compiler.fusion.candidates import Candidate, FusionTarget, TemplateRules
from kiln.compiler.ir.graph import Graph, Node, ValueKind


@dataclass(frozen=True)
class AttentionMatch:
    nodes: tuple[str, ...]  # compute nodes, topological
    q: str
    kt: str  # (B, D, N): k transposed, as the first bmm reads it
    v: str
    mask: str | None  # additive, as the score node reads it
    score_shape: tuple[int, ...]  # shape at which the mask is added
    scale: float
    out: str


def _through_views(g: Graph, v: str) -> str:
    """The computed value ``v`` aliases (following view producers back)."""
    p = g.producer(v)
    while p is not None and p.op == "view":
        v = p.inputs[0]
        p = g.producer(v)
    return v


def match_attention(g: Graph, b2: Node) -> AttentionMatch | None:
    """The attention pattern ending at the bmm ``b2``, or None."""
    if b2.op != "bmm":
        return None
    p = g.producer(_through_views(g, b2.inputs[0]))
    if p is None or p.op != "div":
        return None
    e_val, l_val = (_through_views(g, v) for v in p.inputs)
    e, lsum = g.producer(e_val), g.producer(l_val)
    if e is None or lsum is None or e.op != "exp" or lsum.op != "sum":
        return None
    if _through_views(g, lsum.inputs[0]) != e.output:
        return None
    sub = g.producer(_through_views(g, e.inputs[0]))
    if sub is None or sub.op != "sub":
        return None
    s_val, mx_val = (_through_views(g, v) for v in sub.inputs)
    mx = g.producer(mx_val)
    if mx is None or mx.op != "max" or _through_views(g, mx.inputs[0]) != s_val:
        return None
    for red in (mx, lsum):
        nd = len(g.meta(red.inputs[0]).shape)
        if [d % nd for d in red.attrs["dims"]] != [nd - 1] or not red.attrs["keepdim"]:
            return None
    chain: list[Node] = []
    scale, mask, mask_shape = 1.0, None, g.meta(s_val).shape
    v, scaled = s_val, False  # walking back from the scores: a mask must come after scales
    while True:
        n = g.producer(v)
        if n is None:
            return None
        if n.op == "bmm":
            break
        if n.op == "view":
            v = n.inputs[0]
            continue
        a, b = n.inputs
        if n.op in ("mul", "div") and g.values[b].kind == ValueKind.CONST:
            c = float(g.constants[b].item())
            scale, scaled = (scale * c if n.op == "mul" else scale / c), True
        elif n.op == "add" and mask is None and not scaled:
            mask, mask_shape = b, g.meta(n.output).shape
        else:
            return None
        chain.append(n)
        v = _through_views(g, a)
    b1 = g.producer(v)
    assert b1 is not None
    nodes = [b1, *reversed(chain), mx, sub, e, lsum, p, b2]
    return AttentionMatch(
        tuple(n.name for n in nodes), b1.inputs[0], b1.inputs[1], b2.inputs[1],
        mask, mask_shape, scale, b2.output,
    )  # fmt: skip


def attention_candidates(
    graph: Graph, index: GraphIndex | None = None, target: FusionTarget | None = None
) -> list[Candidate]:
    """One ``attention`` candidate per matched pattern whose intermediates nothing else
    reads (GPU targets only)."""
    if target is None or not target.attention:
        return []
    ix = index or GraphIndex(graph)
    rules = TemplateRules(ix, target)
    consumers = graph.consumers()
    out = []
    for b2 in graph.nodes:
        m = match_attention(graph, b2)
        if m is None:
            continue
        names = set(m.nodes)
        pos = [ix.pos[n] for n in m.nodes]
        if any(rules.kind[i] not in ("pw", "red", "mm") for i in pos):
            continue
        inner = [graph.node(n).output for n in m.nodes if n != b2.name]
        if any(o in graph.outputs for o in inner):
            continue
        if any(_readers_outside(consumers, o, names) for o in inner):
            continue
        if m.mask is not None:  # computed apart from the scores, or it would be a cycle
            mp = ix.producer_pos(ix.root[m.mask])
            if mp is not None and ix.anc[mp] >> ix.pos[m.nodes[0]] & 1:
                continue
        roots = (ix.root[v] for v in (m.q, m.kt, m.v, m.mask) if v is not None)
        ins = tuple(dict.fromkeys(r for r in roots if not ix.is_constant(r)))
        out.append(Candidate("attention", frozenset(names), (m.out,), ins))
    return out


def _readers_outside(consumers: dict[str, list[Node]], v: str, inside: set[str]) -> bool:
    stack = list(consumers[v])
    while stack:
        n = stack.pop()
        if n.op == "view":
            stack.extend(consumers[n.output])
        elif n.name not in inside:
            return True
    return False
