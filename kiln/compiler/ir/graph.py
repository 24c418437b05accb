"""The primitive graph: the device-neutral IR every fusion stage reads.

A ``Graph`` is a DAG of ``Node``s over named ``Value``s, in topological order.

* Every operand of a node is a ``Value`` name. Scalars are 0-d constant values
  (``ValueKind.CONST``), so pointwise ops only ever see tensors and broadcasting.
* Weights are ``ValueKind.PARAM`` values; their data lives in ``Graph.constants``.
* Each node has one output value (``Node.output``) and an ``OpClass``:

  ========== ===========================================================
  pointwise  elementwise with numpy broadcasting (add, exp, where, ...)
  reduction  sum/max/min over ``attrs["dims"]`` (``attrs["keepdim"]``)
  gemm       ``mm`` (M,K)x(K,N), ``bmm`` (B,M,K)x(B,K,N), ``conv``
  layout     ``view``/``permute``/``expand``/``slice``: aliases, no compute;
             ``cat``/``copy``: materialise data
  opaque     anything else: runs through PyTorch as-is (``attrs["target"]``);
             also the whole-op primitives ``rnn`` and ``pool2d``, which have
             native kernels of their own but never fuse with other nodes
  ========== ===========================================================

The vocabulary of primitive ops (``Node.op``) and their attributes is listed in
``OPS``; capture/ produces only these, and kernels/ consumes only these.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch


class OpClass(str, Enum):
    POINTWISE = "pointwise"
    REDUCTION = "reduction"
    GEMM = "gemm"
    LAYOUT = "layout"
    OPAQUE = "opaque"


class ValueKind(str, Enum):
    INPUT = "input"  # graph input, supplied per call
    PARAM = "param"  # weight/buffer, fixed at compile time
    CONST = "const"  # 0-d scalar constant
    INTERMEDIATE = "intermediate"  # produced by a node


UNARY = {
    "neg",
    "abs",
    "exp",
    "log",
    "sqrt",
    "rsqrt",
    "reciprocal",
    "tanh",
    "sigmoid",
    "erf",
    "relu",
    "sin",
    "cos",
    "log1p",
    "expm1",
    "floor",
    "ceil",
    "round",
    "sign",
    "logical_not",
    "copy",  # identity: materialises a (possibly strided) input contiguously
    "cast",  # attrs["dtype"]: torch.dtype of the output
}
BINARY = {
    "add",
    "sub",
    "mul",
    "div",
    "maximum",
    "minimum",
    "pow",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "logical_and",
    "logical_or",
}
TERNARY = {"where"}  # where(cond, a, b)
REDUCTIONS = {"sum", "max", "min"}  # attrs: dims: tuple[int, ...], keepdim: bool
GEMMS = {
    "mm",  # (M, K) x (K, N) -> (M, N)
    "bmm",  # (B, M, K) x (B, K, N) -> (B, M, N)
    # conv: (x, w[, b]); attrs stride, padding, dilation: tuple[int, ...], groups: int;
    # padding before each spatial dim, and after it too unless attrs["padding_end"]
    # gives that (``conv_padding``: a causal conv pads only before), zeros unless
    # attrs["padding_mode"] is "reflect" (F.pad's mirror of the border, folded in);
    # x (N, C, *spatial) -> (N, C_out, *spatial'), or with attrs["channels_last"] True
    # x (N, *spatial, C) -> (N, *spatial', C_out); w is (C_out, C/groups, *kernel) either way
    "conv",
}
LAYOUT_VIEWS = {
    "view",  # attrs["shape"]: tuple[int, ...]; element order unchanged
    "permute",  # attrs["dims"]: tuple[int, ...]
    "expand",  # attrs["shape"]: tuple[int, ...] (broadcast, stride 0)
    "slice",  # attrs dim, start, end, step
}
LAYOUT_COPIES = {
    "cat",  # attrs["dim"]; inputs are the pieces, in order
    "index_select",  # (x, idx int64 1-D); attrs["dim"]: out = x.index_select(dim, idx)
}
OPAQUE = {"opaque"}  # attrs: target (torch OpOverload), args/kwargs templates
# rnn: one LSTM / GRU layer, run whole (one kernel; eval_node is torch.lstm / torch.gru);
# attrs cell ("lstm" | "gru"), batch_first, final_cell (LSTM: the output is the last cell
# state (B, H) instead of the outputs). Inputs: LSTM (x, h0, c0, w_ih, w_hh, b_ih, b_hh),
# GRU (x, h0, w_ih, w_hh, b_ih, b_hh); x (B, T, I) if batch_first else (T, B, I).
RNNS = {"rnn"}
# pool2d: a 2-D max / average pool run whole (one native kernel); attrs mode ("max" |
# "avg"), kernel, stride, padding: (int, int), channels_last: bool. x (N, C, H, W) ->
# (N, C, H', W'), or with channels_last (N, H, W, C) -> (N, H', W', C); dilation 1, floor
# mode, padding as -inf (max) or counted zeros (avg: PyTorch's count_include_pad).
POOLS = {"pool2d"}

OPS: dict[str, OpClass] = {
    **{op: OpClass.POINTWISE for op in UNARY | BINARY | TERNARY},
    **{op: OpClass.REDUCTION for op in REDUCTIONS},
    **{op: OpClass.GEMM for op in GEMMS},
    **{op: OpClass.LAYOUT for op in LAYOUT_VIEWS | LAYOUT_COPIES},
    **{op: OpClass.OPAQUE for op in OPAQUE | RNNS | POOLS},
}


def conv_padding(attrs: dict) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A conv's padding (before, after) each spatial dim (``attrs["padding_mode"]``: of
    zeros or reflected)."""
    before = tuple(attrs["padding"])
    return before, tuple(attrs.get("padding_end", before))


def conv_padding_mode(attrs: dict) -> str:
    """What a conv's padding holds: ``"zeros"`` or ``"reflect"``."""
    return str(attrs.get("padding_mode", "zeros"))


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass
class Value:
    name: str
    meta: TensorMeta
    kind: ValueKind
    producer: str | None = None  # node name, for INTERMEDIATE values


@dataclass
class Node:
    name: str
    op: str
    inputs: tuple[str, ...]
    output: str
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def cls(self) -> OpClass:
        return OPS[self.op]


@dataclass
class Graph:
    """A primitive graph. ``nodes`` is in topological order."""

    values: dict[str, Value] = field(default_factory=dict)
    nodes: list[Node] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)  # INPUT value names, call order
    outputs: list[str] = field(default_factory=list)  # returned value names, in order
    constants: dict[str, torch.Tensor] = field(default_factory=dict)  # PARAM and CONST data
    _index: dict[str, Node] = field(default_factory=dict, repr=False, compare=False)

    # -- construction -------------------------------------------------------
    def add_value(
        self, name: str, meta: TensorMeta, kind: ValueKind, producer: str | None = None
    ) -> Value:
        if name in self.values:
            raise ValueError(f"value {name!r} defined twice")
        v = Value(name, meta, kind, producer)
        self.values[name] = v
        return v

    def add_input(self, name: str, meta: TensorMeta) -> str:
        self.add_value(name, meta, ValueKind.INPUT)
        self.inputs.append(name)
        return name

    def add_constant(self, name: str, data: torch.Tensor) -> str:
        kind = ValueKind.CONST if data.dim() == 0 else ValueKind.PARAM
        self.add_value(name, TensorMeta(tuple(data.shape), data.dtype), kind)
        self.constants[name] = data
        return name

    def add_node(
        self,
        op: str,
        inputs: tuple[str, ...],
        meta: TensorMeta,
        attrs: dict[str, Any] | None = None,
        name: str | None = None,
    ) -> str:
        """Append a node computing a new value; returns the output value's name."""
        if op not in OPS:
            raise ValueError(f"unknown primitive op {op!r}")
        for i in inputs:
            if i not in self.values:
                raise ValueError(f"{op}: input {i!r} is not defined")
        name = name or f"n{len(self.nodes)}_{op}"
        out = f"{name}"
        self.add_value(out, meta, ValueKind.INTERMEDIATE, producer=name)
        self.nodes.append(Node(name, op, tuple(inputs), out, dict(attrs or {})))
        return out

    # -- queries ------------------------------------------------------------
    def node(self, name: str) -> Node:
        """The node called ``name`` (an index rebuilt when the node list has changed)."""
        n = self._index.get(name)
        if n is None or n.name != name or len(self._index) != len(self.nodes):
            self._index = {m.name: m for m in self.nodes}
            n = self._index[name]
        return n

    def producer(self, value: str) -> Node | None:
        p = self.values[value].producer
        return None if p is None else self.node(p)

    def consumers(self) -> dict[str, list[Node]]:
        """value name -> nodes that read it."""
        out: dict[str, list[Node]] = {v: [] for v in self.values}
        for n in self.nodes:
            for i in dict.fromkeys(n.inputs):
                out[i].append(n)
        return out

    def is_constant(self, value: str) -> bool:
        return self.values[value].kind in (ValueKind.PARAM, ValueKind.CONST)

    def meta(self, value: str) -> TensorMeta:
        return self.values[value].meta

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def validate(self) -> None:
        """Check topological order, single definitions and known ops."""
        seen = {v for v, val in self.values.items() if val.kind != ValueKind.INTERMEDIATE}
        for n in self.nodes:
            if n.op not in OPS:
                raise ValueError(f"{n.name}: unknown op {n.op!r}")
            for i in n.inputs:
                if i not in seen:
                    raise ValueError(f"{n.name}: input {i!r} used before it is defined")
            seen.add(n.output)
        for o in self.outputs:
            if o not in seen:
                raise ValueError(f"output {o!r} is never defined")

    def summary(self) -> str:
        lines = [f"inputs: {[(i, self.meta(i).shape) for i in self.inputs]}"]
        for n in self.nodes:
            lines.append(
                f"  {n.output} = {n.op}({', '.join(n.inputs)}) {self.meta(n.output).shape}"
                + (f" {n.attrs}" if n.attrs and n.op != "opaque" else "")
            )
        lines.append(f"outputs: {self.outputs}")
        return "\n".join(lines)
