"""Channels-last regions: convolutions, and the layout-agnostic ops between them, on
(N, *spatial, C) values instead of (N, C, *spatial) ones.

Every materialised value is stored contiguously, so a captured CNN computes on NCHW
values. Channels-last values suit the CPU's convolution kernels better: a 1x1 conv is
then a plain GEMM whose constant weight is packed at compile time (on NCHW values the
activation is the GEMM's right operand, packed on every call), a depthwise conv
vectorises along channels (no lanes wasted on 7-pixel rows) and oneDNN runs NHWC convs
without reorders. A network keeps one layout across consecutive convolutions: the
values of a region are converted once where it begins and ends.

``find_regions`` finds the regions: connected sets of 1-D/2-D fp32 convs and of the
ops between them that work in either layout (pointwise ops with per-channel or scalar
constants, residual adds, reductions such as global average pooling, slices, ``cat``
and ``index_select`` along any dim, ``pool2d``, and the pooling and upsampling ATen
calls that follow their input's memory format), grown over value edges between ops of
the same rank. ``to_channels_last`` rewrites chosen regions: members compute on
permuted values (constants are permuted once, reduction/slice/cat dims remapped, convs
and pools marked ``channels_last``), a ``permute`` view (+ a ``copy`` when the view is
not already contiguous) converts each value entering a region, and one converts back
each value leaving it. Which regions pay off is decided by the caller with the cost model
(``fusion/layouts.py``): this module only rewrites, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.compiler.capture.format_following import ChannelsLastCall, format_following
from kiln.compiler.capture.passes import canonicalize_views, eliminate_dead_code
from kiln.compiler.ir.graph import (
    BINARY,
    REDUCTIONS,
    TERNARY,
    UNARY,
    Graph,
    Node,
    TensorMeta,
    ValueKind,
)
from kiln.compiler.ir.layout import access, contiguous_strides

# (N, C, *spatial) -> (N, *spatial, C) for 1-D and 2-D convs' values
PERM = {3: (0, 2, 1), 4: (0, 2, 3, 1)}
_POINTWISE = UNARY | BINARY | TERNARY
_DIM_OPS = frozenset({"slice", "cat", "index_select"})  # attrs["dim"] is remapped


@dataclass(frozen=True)
class Region:
    """Nodes (names, graph order) that switch layout together; ``rank`` 3 or 4."""

    nodes: tuple[str, ...]
    convs: tuple[str, ...]
    rank: int


def inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(perm.index(i) for i in range(len(perm)))


def _is_cl_conv(graph: Graph, n: Node) -> bool:
    """A 1-D/2-D fp32 NCHW conv with constant weight (and bias)."""
    if n.op != "conv" or n.attrs.get("channels_last"):
        return False
    r = len(graph.meta(n.inputs[0]).shape)
    return (
        r in PERM
        and len(graph.meta(n.inputs[1]).shape) == r
        and all(graph.is_constant(v) for v in n.inputs[1:])
        and all(graph.meta(v).dtype == torch.float32 for v in (*n.inputs, n.output))
    )


def _rank(graph: Graph, n: Node) -> int | None:
    """The region rank a node may join (the rank of the values it works on), else None."""
    if n.op == "conv":
        return len(graph.meta(n.inputs[0]).shape) if _is_cl_conv(graph, n) else None
    if n.op == "pool2d":
        fp32 = graph.meta(n.inputs[0]).dtype == torch.float32
        return 4 if fp32 and not n.attrs["channels_last"] else None
    if n.op == "opaque":
        return 4 if format_following(graph, n) else None
    variable = [v for v in n.inputs if not graph.is_constant(v)]
    if n.op in _POINTWISE:
        r = len(graph.meta(n.output).shape)
        ok = r in PERM and all(len(graph.meta(v).shape) == r for v in variable)
        return r if ok and all(len(graph.meta(v).shape) <= r for v in n.inputs) else None
    if n.op in REDUCTIONS or n.op in _DIM_OPS:
        data = n.inputs if n.op == "cat" else n.inputs[:1]
        ranks = {len(graph.meta(v).shape) for v in data}
        r = ranks.pop() if len(ranks) == 1 else 0
        return r if r in PERM else None
    return None


def find_regions(graph: Graph) -> list[Region]:
    """Connected sets of same-rank nodes that may compute channels-last, each holding at
    least one convolution, in graph order (disjoint)."""
    users = graph.consumers()
    rank = {n.name: _rank(graph, n) for n in graph.nodes}
    pos = {n.name: i for i, n in enumerate(graph.nodes)}
    seen: set[str] = set()
    regions: list[Region] = []
    for seed in graph.nodes:
        r = rank[seed.name]
        if seed.op != "conv" or r is None or seed.name in seen:
            continue
        members, stack = {seed.name}, [seed]
        while stack:
            n = stack.pop()
            near: list[Node] = []
            for v in n.inputs:  # producers of the rank-r values it reads
                p = graph.producer(v)
                if p is not None and len(graph.meta(v).shape) == r:
                    near.append(p)
            if len(graph.meta(n.output).shape) == r:  # readers of its rank-r output
                near += users[n.output]
            for m in near:
                if m.name not in members and m.name not in seen and rank[m.name] == r:
                    members.add(m.name)
                    stack.append(m)
        seen |= members
        order = tuple(sorted(members, key=pos.__getitem__))
        convs = tuple(x for x in order if graph.node(x).op == "conv")
        regions.append(Region(order, convs, r))
    return regions


THIN = 4  # a dense conv over at most this many input channels reads them in place


def _reads_in_place(graph: Graph, n: Node) -> bool:
    """A dense conv over few input channels (an image's stem): its kernels read each
    pixel's channels as scalars, as cheaply from an NCHW image as from a copy of it, so
    the value entering the region for it needs no copy kernel."""
    if n.op != "conv":
        return False
    w = graph.meta(n.inputs[1]).shape
    return n.attrs["groups"] == 1 and w[1] <= THIN and any(k > 1 for k in w[2:])


def _is_contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    dims = [(s, st) for s, st in zip(shape, strides) if s != 1]
    want = contiguous_strides(tuple(s for s, _ in dims))
    return all(st == w for (_, st), w in zip(dims, want))


class _Rewrite:
    """Builds the rewritten graph node by node (see ``to_channels_last``)."""

    def __init__(self, src: Graph, member: set[str]) -> None:
        self.src, self.member = src, member
        self.users = src.consumers()
        self.out = Graph(inputs=list(src.inputs), constants=dict(src.constants))
        for name, v in src.values.items():
            if v.kind != ValueKind.INTERMEDIATE:
                self.out.add_value(name, v.meta, v.kind)
        self.perm: dict[str, tuple[int, ...]] = {}  # member value -> new = old.permute(perm)
        self.memo: dict[tuple[str, ...], str] = {}

    def fresh(self, base: str) -> str:
        name, i = base, 0
        while name in self.out.values or name in self.src.values:
            i += 1
            name = f"{base}{i}"
        return name

    def view(self, value: str, dims: tuple[int, ...], copy: bool | None, tag: str) -> str:
        """``permute(value, dims)``, copied contiguously when ``copy`` (None: when the
        view is not contiguous already)."""
        key = ("view", value, *map(str, dims), str(copy))
        if key in self.memo:
            return self.memo[key]
        meta = self.out.meta(value)
        shape = tuple(meta.shape[d] for d in dims)
        v = self.out.add_node(
            "permute", (value,), TensorMeta(shape, meta.dtype), {"dims": dims},
            name=self.fresh(f"{value}_{tag}"),
        )  # fmt: skip
        if copy is None:
            a = access(self.out, v)
            copy = isinstance(a, str) or not _is_contiguous(a.shape, a.strides)
        if copy:
            v = self.out.add_node("copy", (v,), TensorMeta(shape, meta.dtype), name=self.fresh(v))
        self.memo[key] = v
        return v

    def exit(self, value: str, reader: Node | None) -> str:
        """The NCHW form of member value ``value`` for a non-member ``reader`` (None: a
        graph output): a permute view, copied unless it is contiguous or read by a
        permute (which then collapses with it)."""
        perm = self.perm[value]
        if perm == tuple(range(len(perm))):
            return value
        lazy = reader is not None and reader.op == "permute"
        return self.view(value, inverse(perm), False if lazy else None, "nchw")

    def entry(self, value: str, rank: int) -> str:
        """The channels-last form of ``value`` (not computed channels-last by its
        producer) for the members that read it: copied once, unless the permuted view is
        contiguous already or only thin dense convs read it (then they read it in place)."""
        base = value
        if value in self.perm:  # another region's value, in its own order
            base = self.view(value, inverse(self.perm[value]), False, "nchw")
        readers = [n for n in self.users[value] if n.name in self.member]
        lazy = all(_reads_in_place(self.src, n) for n in readers)
        return self.view(base, PERM[rank], False if lazy else None, "nhwc")

    def constant(self, value: str, rank: int, strip: bool) -> str:
        """A constant operand permuted like the values; with ``strip`` (pointwise
        operands, which broadcast) padded to ``rank`` first and stripped of leading unit
        dims after (a (C, 1, 1) per-channel vector becomes (C,)); 0-d constants stay."""
        data = self.src.constants[value]
        if data.dim() == 0 or (not strip and data.dim() != rank):
            return value
        key = ("const", value, str(rank), str(strip))
        if key not in self.memo:
            t = data.reshape((1,) * (rank - data.dim()) + tuple(data.shape)).permute(PERM[rank])
            while strip and t.dim() > 1 and t.shape[0] == 1:
                t = t[0]
            name = self.fresh(f"{value}_cl")
            self.out.add_constant(name, t.contiguous())
            self.memo[key] = name
        return self.memo[key]

    def member_input(self, n: Node, i: int, v: str, r: int) -> str:
        if n.op == "conv" and i > 0 or n.op == "index_select" and i == 1:
            return v  # the weight and bias, the indices
        if self.perm.get(v) == PERM[r]:
            return v
        if self.src.is_constant(v):
            return self.constant(v, r, strip=n.op in _POINTWISE)
        return self.entry(v, r)

    def member_node(self, n: Node, r: int) -> None:
        p = PERM[r]
        ins = tuple(self.member_input(n, i, v, r) for i, v in enumerate(n.inputs))
        attrs = dict(n.attrs)
        meta = self.src.meta(n.output)
        shape = tuple(meta.shape[d] for d in p)
        out_perm = p
        if n.op in ("conv", "pool2d"):
            attrs["channels_last"] = True
        elif n.op == "opaque":
            attrs["target"] = ChannelsLastCall(attrs["target"])
        elif n.op in _DIM_OPS:
            attrs["dim"] = p.index(attrs["dim"] % r)
        elif n.op in REDUCTIONS:
            dims = sorted({d % r for d in attrs["dims"]})
            attrs["dims"] = tuple(sorted(p.index(d) for d in dims))
            if not attrs["keepdim"]:
                old = [d for d in range(r) if d not in dims]
                new = [d for d in p if d not in dims]
                out_perm = tuple(old.index(d) for d in new)
                shape = tuple(meta.shape[old.index(d)] for d in new)
        self.out.add_node(n.op, ins, TensorMeta(shape, meta.dtype), attrs, name=n.name)
        self.perm[n.output] = out_perm

    def other_node(self, n: Node) -> None:
        ins = tuple(self.exit(v, n) if v in self.perm else v for v in n.inputs)
        self.out.add_node(n.op, ins, self.src.meta(n.output), n.attrs, name=n.name)


def to_channels_last(graph: Graph, regions: list[Region]) -> Graph:
    """``graph`` with the nodes of ``regions`` computing on channels-last values (same
    results; see the module docstring). No regions: ``graph`` itself."""
    if not regions:
        return graph
    member = {n: r.rank for r in regions for n in r.nodes}
    rw = _Rewrite(graph, set(member))
    for n in graph.nodes:
        if n.name in member:
            rw.member_node(n, member[n.name])
        else:
            rw.other_node(n)
    rw.out.outputs = [rw.exit(v, None) if v in rw.perm else v for v in graph.outputs]
    out = eliminate_dead_code(canonicalize_views(rw.out))
    out.validate()
    return out
