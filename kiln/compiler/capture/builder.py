"""The state shared by every lowering: a growing ``Graph`` plus emit helpers.

A lowering is a function ``(Builder, fx.Node) -> str | list[str | None]`` that
emits kiln primitives for one ATen call and returns the value name of its result
(or one name per output of a multi-output op; ``None`` marks an output it could
not produce, which then runs through PyTorch as an opaque node). Lowerings
register themselves in ``LOWERINGS`` with ``@register(aten.op.overload, ...)``.

The builder infers every emitted node's shape and dtype by running the node's
reference semantics (``eval_node``) on ``meta`` tensors, so lowerings never
compute shapes by hand and the IR can never disagree with the reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import fx

from kiln.compiler.ir.graph import Graph, Node, TensorMeta
from kiln.compiler.ir.semantics import TensorArg, eval_node

LowerResult = str | list[str | None]
LowerFn = Callable[["Builder", fx.Node], LowerResult]

# ATen OpOverload or OpOverloadPacket -> lowering. An overload entry wins over
# its packet's entry.
LOWERINGS: dict[object, LowerFn] = {}


def register(*targets: object) -> Callable[[LowerFn], LowerFn]:
    """Decorator: register ``fn`` as the lowering of each ATen target."""

    def deco(fn: LowerFn) -> LowerFn:
        for t in targets:
            if t in LOWERINGS:
                raise ValueError(f"two lowerings registered for {t}")
            LOWERINGS[t] = fn
        return fn

    return deco


class Unsupported(Exception):
    """Raised by a lowering for a call it cannot express in primitives; the
    message becomes the fallback reason and the call runs as an opaque node."""


class CaptureError(Exception):
    """The exported program has a construct the IR cannot represent at all."""


def pos(node: fx.Node) -> tuple[Any, ...]:
    """The positional arguments of an FX call (FX types them as a wide union;
    lowerings check what they need)."""
    return cast(tuple[Any, ...], node.args)


def call_args(node: fx.Node) -> dict[str, Any]:
    """Map every schema argument of an ATen call to its value (positional,
    keyword or schema default)."""
    schema = node.target._schema  # type: ignore[union-attr]
    out: dict[str, Any] = {}
    args = pos(node)
    for i, a in enumerate(schema.arguments):
        if i < len(args) and not a.kwarg_only:
            out[a.name] = args[i]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
        else:
            out[a.name] = a.default_value if a.has_default_value() else None
    return out


def scalar_dtype(value: object, like: torch.dtype) -> torch.dtype:
    """dtype of a 0-d constant standing for python ``value`` next to a tensor of
    dtype ``like``, chosen so that type promotion gives the same result as the
    scalar did (0-d tensors promote like scalars within a category)."""
    if like.is_floating_point or like.is_complex:
        return like
    if isinstance(value, bool):
        return torch.bool
    if isinstance(value, int):
        return torch.int64
    return torch.get_default_dtype()


def norm_dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


class Builder:
    """Emits primitives into ``graph`` and maps FX nodes to value names."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.env: dict[fx.Node, LowerResult] = {}
        self._metas: dict[str, torch.Tensor] = {}  # value -> meta-device tensor
        self._consts: dict[tuple[str, str], str] = {}  # (dtype, repr(value)) -> name
        self._noncontig: set[str] = set()  # values that are strided views
        self._prefix = "c"
        self._next: dict[str, int] = {}  # base name -> next suffix

    # -- naming --------------------------------------------------------------
    def set_prefix(self, prefix: str) -> None:
        """Name the nodes emitted from now on after FX node ``prefix``."""
        self._prefix = prefix

    def fresh(self, base: str) -> str:
        """A new value name ``{base}__{k}``, unique in the graph."""
        k = self._next.get(base, 0)
        while f"{base}__{k}" in self.graph.values:
            k += 1
        self._next[base] = k + 1
        return f"{base}__{k}"

    # -- values --------------------------------------------------------------
    def meta(self, v: str) -> TensorMeta:
        return self.graph.meta(v)

    def shape(self, v: str) -> tuple[int, ...]:
        return self.graph.meta(v).shape

    def dtype(self, v: str) -> torch.dtype:
        return self.graph.meta(v).dtype

    def tensor(self, arg: object) -> str:
        """The value name of a tensor argument."""
        if not isinstance(arg, fx.Node):
            raise Unsupported(f"expected a tensor argument, got {type(arg).__name__}")
        v = self.env.get(arg)
        if not isinstance(v, str):
            raise Unsupported(f"argument {arg.name} is not a single tensor")
        return v

    def operand(self, arg: object, like: str) -> str:
        """A tensor argument, or a python scalar as a 0-d constant typed to
        promote with value ``like`` exactly as the scalar would."""
        if isinstance(arg, fx.Node):
            return self.tensor(arg)
        if isinstance(arg, (bool, int, float)):
            return self.const(arg, scalar_dtype(arg, self.dtype(like)))
        raise Unsupported(f"unsupported operand {arg!r}")

    def const(self, value: bool | int | float, dtype: torch.dtype) -> str:
        """A (shared) 0-d CONST value."""
        key = (str(dtype), repr(value))
        if key not in self._consts:
            name = self.fresh("const")
            self.graph.add_constant(name, torch.tensor(value, dtype=dtype))
            self._consts[key] = name
        return self._consts[key]

    def is_contiguous(self, v: str) -> bool:
        """False for values that are strided views (permute/expand/slice) of
        their source; those need a ``copy`` to be materialised."""
        return v not in self._noncontig

    def _meta_tensor(self, v: str) -> torch.Tensor:
        t = self._metas.get(v)
        if t is None:
            m = self.meta(v)
            t = torch.empty(m.shape, dtype=m.dtype, device="meta")
            self._metas[v] = t
        return t

    # -- emission ------------------------------------------------------------
    def emit(self, op: str, inputs: Sequence[str], **attrs: Any) -> str:
        """Append primitive ``op``; its output meta comes from the reference
        semantics evaluated on meta tensors."""
        name = self.fresh(self._prefix)
        node = Node(name, op, tuple(inputs), name, attrs)
        try:
            out = eval_node(node, [self._meta_tensor(i) for i in inputs])
        except (RuntimeError, ValueError, IndexError, TypeError) as e:
            raise Unsupported(f"{op} on {[self.shape(i) for i in inputs]}: {e}") from e
        meta = TensorMeta(tuple(out.shape), out.dtype)
        self.graph.add_node(op, tuple(inputs), meta, attrs, name=name)
        self._metas[name] = out
        noncontig_view = op in ("permute", "expand", "slice")
        if noncontig_view or (op == "view" and inputs[0] in self._noncontig):
            self._noncontig.add(name)
        return name

    def opaque(self, node: fx.Node, reason: str, output_index: int | None = None) -> str:
        """Run FX ``node`` as-is through PyTorch: an ``opaque`` primitive whose
        call template holds ``TensorArg`` placeholders for its tensor inputs."""
        inputs: list[str] = []
        index: dict[str, int] = {}

        def template(a: object) -> object:
            if isinstance(a, fx.Node):
                v = self.tensor(a)
                if v not in index:
                    index[v] = len(inputs)
                    inputs.append(v)
                return TensorArg(index[v])
            if isinstance(a, (list, tuple)):
                return type(a)(template(x) for x in a)
            return a

        args = template(tuple(node.args))
        kwargs = {k: template(v) for k, v in node.kwargs.items()}
        val = node.meta.get("val")
        if output_index is not None and isinstance(val, (tuple, list)):
            val = val[output_index]
        if not isinstance(val, torch.Tensor):
            raise CaptureError(f"{node.name} ({node.target}) has no tensor output to fall back on")
        attrs: dict[str, Any] = {
            "target": node.target,
            "args": args,
            "kwargs": kwargs,
            "reason": reason,
        }
        if output_index is not None:
            attrs["output_index"] = output_index
        name = self.fresh(node.name)
        meta = TensorMeta(tuple(val.shape), val.dtype)
        self.graph.add_node("opaque", tuple(inputs), meta, attrs, name=name)
        return name

    # -- layout helpers (skip no-op layout nodes) -----------------------------
    def view(self, v: str, shape: Sequence[int]) -> str:
        shape = tuple(int(s) for s in shape)
        return v if shape == self.shape(v) else self.emit("view", [v], shape=shape)

    def permute(self, v: str, dims: Sequence[int]) -> str:
        rank = len(self.shape(v))
        dims = tuple(norm_dim(int(d), rank) for d in dims)
        if dims == tuple(range(rank)):
            return v
        return self.emit("permute", [v], dims=dims)

    def expand(self, v: str, shape: Sequence[int]) -> str:
        """Broadcast ``v`` to ``shape``, first viewing it to the same rank."""
        shape = tuple(int(s) for s in shape)
        src = self.shape(v)
        if len(src) < len(shape):
            v = self.view(v, (1,) * (len(shape) - len(src)) + src)
        return v if shape == self.shape(v) else self.emit("expand", [v], shape=shape)

    def contiguous(self, v: str) -> str:
        return v if self.is_contiguous(v) else self.emit("copy", [v])

    def cast(self, v: str, dtype: torch.dtype) -> str:
        return v if self.dtype(v) == dtype else self.emit("cast", [v], dtype=dtype)

    def reduce(self, op: str, v: str, dims: Sequence[int] | None, keepdim: bool) -> str:
        """``op`` in sum/max/min over ``dims`` (None or empty: all). Always
        emitted with keepdim=True (so fused consumers broadcast the result
        against the input); a ``view`` drops the dims when keepdim is False."""
        shape = self.shape(v)
        rank = len(shape)
        dims = tuple(range(rank)) if not dims else tuple(sorted(norm_dim(d, rank) for d in dims))
        if rank == 0:
            return v
        r = self.emit(op, [v], dims=dims, keepdim=True)
        if keepdim:
            return r
        return self.view(r, [s for i, s in enumerate(shape) if i not in dims])

    def scale(self, v: str, factor: float) -> str:
        """``v * factor`` with a constant of ``v``'s dtype (no node when 1)."""
        if factor == 1:
            return v
        return self.emit("mul", [v, self.const(factor, scalar_dtype(factor, self.dtype(v)))])
