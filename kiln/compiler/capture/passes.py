"""Graph clean-up passes run after capture, each ``(Graph) -> Graph``.

Every pass copies the graph node by node into a new ``Graph`` through
``_Rewriter``, which lets it keep a node, drop it in favour of another value
(an alias) or replace it, and renames all later uses accordingly.
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.compiler.ir.graph import BINARY, UNARY, Graph, Node, OpClass, TensorMeta, ValueKind
from kiln.compiler.ir.semantics import TensorArg, eval_node

aten = torch.ops.aten

NATIVE_DTYPES = (torch.float32, torch.bool)
FOLD_MIN_NUMEL = 4096  # folds never blow a constant up beyond this ...
FOLD_MAX_GROWTH = 4  # ... unless it stays within 4x its inputs' total size


class _Rewriter:
    """Builds the output graph of a pass from ``src``."""

    def __init__(self, src: Graph) -> None:
        self.src = src
        self.out = Graph(inputs=list(src.inputs), constants=dict(src.constants))
        for name, v in src.values.items():
            if v.kind != ValueKind.INTERMEDIATE:
                self.out.add_value(name, v.meta, v.kind)
        self.alias: dict[str, str] = {}
        self.by_output: dict[str, Node] = {}  # kept nodes of ``out``

    def get(self, v: str) -> str:
        return self.alias.get(v, v)

    def inputs(self, n: Node) -> tuple[str, ...]:
        return tuple(self.get(i) for i in n.inputs)

    def producer(self, v: str) -> Node | None:
        return self.by_output.get(v)

    def keep(self, n: Node, op: str | None = None, inputs: tuple[str, ...] | None = None,
             attrs: dict[str, Any] | None = None) -> None:  # fmt: skip
        """Copy ``n`` (optionally with a new op, inputs or attrs)."""
        meta = self.src.meta(n.output)
        ins = self.inputs(n) if inputs is None else inputs
        new_attrs = n.attrs if attrs is None else attrs
        self.out.add_node(op or n.op, ins, meta, new_attrs, name=n.name)
        self.by_output[n.name] = self.out.nodes[-1]

    def constant(self, n: Node, data: torch.Tensor) -> None:
        """Replace ``n`` by a constant holding its value."""
        self.out.add_constant(n.name, data)

    def finish(self) -> Graph:
        self.out.outputs = [self.get(o) for o in self.src.outputs]
        return self.out


def _deterministic(n: Node) -> bool:
    target = n.attrs.get("target")
    tags = getattr(target, "tags", ())
    return n.op != "opaque" or torch.Tag.nondeterministic_seeded not in tags


def fold_constants(graph: Graph) -> Graph:
    """Evaluate every node whose inputs are all constants (``eval_node``) and
    replace it by a contiguous constant; 0-d results stay 0-d CONSTs. A fold
    that would materialise a much larger tensor (an ``expand`` of a scalar,
    say) is skipped: the node then reads its constant input directly."""
    rw = _Rewriter(graph)
    for n in graph.nodes:
        ins = rw.inputs(n)
        if all(rw.out.is_constant(i) for i in ins) and _deterministic(n):
            in_numel = sum(rw.out.meta(i).numel for i in ins)
            out_numel = graph.meta(n.output).numel
            if out_numel <= max(FOLD_MIN_NUMEL, FOLD_MAX_GROWTH * in_numel):
                with torch.no_grad():
                    data = eval_node(n, [rw.out.constants[i] for i in ins])
                rw.constant(n, data.detach().contiguous())
                continue
        rw.keep(n)
    return rw.finish()


def eliminate_dead_code(graph: Graph) -> Graph:
    """Drop nodes that no output depends on, and unused PARAM/CONST values
    (INPUT values always stay: they are the call signature)."""
    live = set(graph.outputs)
    for n in reversed(graph.nodes):
        if n.output in live:
            live.update(n.inputs)
    rw = _Rewriter(graph)
    for name, v in graph.values.items():
        if v.kind in (ValueKind.PARAM, ValueKind.CONST) and name not in live:
            del rw.out.values[name]
            del rw.out.constants[name]
    for n in graph.nodes:
        if n.output in live:
            rw.keep(n)
    return rw.finish()


def _attrs_key(attrs: dict[str, Any]) -> str:
    return repr(sorted(attrs.items()))


def eliminate_common_subexpressions(graph: Graph) -> Graph:
    """Merge nodes with the same op, inputs and attrs, and equal 0-d CONSTs."""
    rw = _Rewriter(graph)
    consts: dict[tuple[str, str], str] = {}
    for name, v in graph.values.items():
        if v.kind == ValueKind.CONST:
            ckey = (str(v.meta.dtype), repr(graph.constants[name].item()))
            rw.alias[name] = consts.setdefault(ckey, name)
    seen: dict[tuple[str, tuple[str, ...], str], str] = {}
    for n in graph.nodes:
        key = (n.op, rw.inputs(n), _attrs_key(n.attrs))
        if key in seen and _deterministic(n):
            rw.alias[n.output] = seen[key]
            continue
        seen[key] = n.output
        rw.keep(n)
    return rw.finish()


def _is_strided_view(rw: _Rewriter, v: str) -> bool:
    """True if ``v`` may be a non-contiguous view (permute/expand/slice)."""
    p = rw.producer(v)
    while p is not None and p.op == "view":
        p = rw.producer(p.inputs[0])
    return p is not None and p.op in ("permute", "expand", "slice")


def canonicalize_views(graph: Graph) -> Graph:
    """Collapse view(view(x)) and permute(permute(x)) and expand(expand(x))
    chains; drop views to the same shape, identity permutes, same-shape
    expands, full slices, same-dtype casts and copies of values that are
    already contiguous results of a computation."""
    rw = _Rewriter(graph)
    for n in graph.nodes:
        ins = rw.inputs(n)
        x = ins[0] if ins else ""
        src = rw.producer(x) if ins else None
        attrs = n.attrs
        if n.op in ("view", "expand") and src is not None and src.op == n.op:
            x, ins = src.inputs[0], (src.inputs[0],)
        if n.op == "permute" and src is not None and src.op == "permute":
            attrs = {"dims": tuple(src.attrs["dims"][d] for d in n.attrs["dims"])}
            x, ins = src.inputs[0], (src.inputs[0],)
        shape = graph.meta(n.output).shape
        same_shape = rw.out.meta(x).shape == shape if ins else False
        if (
            (n.op in ("view", "expand") and same_shape)
            or (n.op == "permute" and tuple(attrs["dims"]) == tuple(range(len(shape))))
            or (n.op == "slice" and same_shape and attrs["step"] == 1)
            or (n.op == "cast" and rw.out.meta(x).dtype == attrs["dtype"])
            or (n.op == "copy" and src is not None and not _is_strided_view(rw, x)
                and src.cls != OpClass.LAYOUT)
        ):  # fmt: skip
            rw.alias[n.output] = x
            continue
        rw.keep(n, inputs=ins, attrs=attrs)
    return rw.finish()


def _aten_call(n: Node) -> tuple[object, tuple[Any, ...], dict[str, Any]]:
    """The ATen call computing primitive ``n``, as an opaque template."""
    t = [TensorArg(i) for i in range(len(n.inputs))]
    a = n.attrs
    if n.op == "copy":
        return aten.clone.default, (t[0],), {"memory_format": torch.contiguous_format}
    if n.op in UNARY:
        return getattr(aten, n.op).default, (t[0],), {}
    if n.op in BINARY:
        packet = getattr(aten, n.op)
        overload = {"pow": "Tensor_Tensor"}.get(n.op, "Tensor")
        target = getattr(packet, overload) if overload in packet.overloads() else packet.default
        return target, (t[0], t[1]), {}
    if n.op == "where":
        return aten.where.self, tuple(t), {}
    if n.op in ("sum", "max", "min"):
        target = {"sum": aten.sum.dim_IntList, "max": aten.amax.default, "min": aten.amin.default}
        return target[n.op], (t[0], list(a["dims"]), a["keepdim"]), {}
    if n.op in ("mm", "bmm"):
        return getattr(aten, n.op).default, (t[0], t[1]), {}
    if n.op == "conv":
        if "padding_end" in a or "padding_mode" in a:
            raise ValueError("no single ATen call pads a conv unevenly or by reflection")
        bias = t[2] if len(t) > 2 else None
        zeros = [0] * len(a["stride"])
        args = (t[0], t[1], bias, list(a["stride"]), list(a["padding"]), list(a["dilation"]))
        return aten.convolution.default, (*args, False, zeros, a["groups"]), {}
    if n.op == "pool2d" and not a["channels_last"]:
        window = (list(a["kernel"]), list(a["stride"]), list(a["padding"]))
        if a["mode"] == "max":
            return aten.max_pool2d.default, (t[0], *window), {}
        return aten.avg_pool2d.default, (t[0], *window), {}  # count_include_pad: default
    raise ValueError(f"no ATen form for primitive {n.op!r}")


def enforce_native_dtypes(graph: Graph) -> Graph:
    """The C++ backend's kernels compute in float32 (plus bool masks). Any compute node
    reading or producing another dtype becomes an opaque ATen call; casts and
    layout ops (which only move data) stay."""
    rw = _Rewriter(graph)
    for n in graph.nodes:
        if n.op == "opaque" or n.op == "cast" or n.cls == OpClass.LAYOUT:
            rw.keep(n)
            continue
        metas: list[TensorMeta] = [graph.meta(v) for v in (*n.inputs, n.output)]
        bad = sorted({str(m.dtype) for m in metas if m.dtype not in NATIVE_DTYPES})
        if not bad:
            rw.keep(n)
            continue
        target, args, kwargs = _aten_call(n)
        reason = f"{n.op} on {', '.join(bad)}: native kernels take float32/bool only"
        attrs = {"target": target, "args": args, "kwargs": kwargs, "reason": reason}
        rw.keep(n, op="opaque", attrs=attrs)
    return rw.finish()


def optimize(graph: Graph) -> Graph:
    """The standard clean-up pipeline run by ``capture``."""
    from kiln.compiler.capture.fold import (
        drop_unit_reduction_dims,
        fold_conv_affine,
        fold_pads_into_convs,
        fold_reflection_pads_into_convs,
        merge_index_selects,
        sink_unit_views,
    )

    graph = eliminate_dead_code(graph)
    graph = canonicalize_views(graph)
    graph = eliminate_common_subexpressions(graph)
    graph = fold_constants(graph)
    graph = canonicalize_views(graph)
    graph = eliminate_common_subexpressions(graph)
    graph = fold_pads_into_convs(graph)
    graph = fold_reflection_pads_into_convs(graph)
    graph = fold_conv_affine(graph)
    graph = merge_index_selects(graph)
    graph = drop_unit_reduction_dims(graph)
    graph = canonicalize_views(sink_unit_views(graph))
    graph = eliminate_dead_code(graph)
    graph.validate()
    return graph


def for_cpu_backend(graph: Graph) -> Graph:
    """The captured graph as the C++ backend takes it: compute on dtypes its kernels do
    not hold (fp16, bf16, ...) becomes opaque ATen calls (the Triton backend keeps them)."""
    graph = eliminate_dead_code(enforce_native_dtypes(graph))
    graph.validate()
    return graph
