"""Reference semantics of every primitive op, as ATen calls.

``eval_node`` is the single definition of what a primitive computes; the
reference executor, the verification step and the kernel tests all use it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from kiln.compiler.ir.graph import Graph, Node, conv_padding, conv_padding_mode

Tensor = torch.Tensor

_UNARY: dict[str, Callable[[Tensor], Tensor]] = {
    "neg": torch.neg,
    "abs": torch.abs,
    "exp": torch.exp,
    "log": torch.log,
    "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt,
    "reciprocal": torch.reciprocal,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "erf": torch.erf,
    "relu": torch.relu,
    "sin": torch.sin,
    "cos": torch.cos,
    "log1p": torch.log1p,
    "expm1": torch.expm1,
    "floor": torch.floor,
    "ceil": torch.ceil,
    "round": torch.round,
    "sign": torch.sign,
    "logical_not": torch.logical_not,
    "copy": lambda x: x.clone(memory_format=torch.contiguous_format),
}
_BINARY: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "div": torch.div,
    "maximum": torch.maximum,
    "minimum": torch.minimum,
    "pow": torch.pow,
    "eq": torch.eq,
    "ne": torch.ne,
    "lt": torch.lt,
    "le": torch.le,
    "gt": torch.gt,
    "ge": torch.ge,
    "logical_and": torch.logical_and,
    "logical_or": torch.logical_or,
}


def eval_node(node: Node, args: Sequence[Tensor]) -> Tensor:
    """Compute one primitive node from its input tensors."""
    op, a = node.op, node.attrs
    if op in _UNARY:
        return _UNARY[op](args[0])
    if op == "cast":
        return args[0].to(a["dtype"])
    if op in _BINARY:
        return _BINARY[op](args[0], args[1])
    if op == "where":
        return torch.where(args[0], args[1], args[2])
    if op == "sum":
        return torch.sum(args[0], dim=list(a["dims"]), keepdim=a["keepdim"])
    if op == "max":
        return torch.amax(args[0], dim=list(a["dims"]), keepdim=a["keepdim"])
    if op == "min":
        return torch.amin(args[0], dim=list(a["dims"]), keepdim=a["keepdim"])
    if op == "mm":
        return torch.mm(args[0], args[1])
    if op == "bmm":
        return torch.bmm(args[0], args[1])
    if op == "conv":
        return _conv(args, a)
    if op == "view":
        return args[0].reshape(a["shape"])
    if op == "permute":
        return args[0].permute(a["dims"])
    if op == "expand":
        return args[0].expand(a["shape"])
    if op == "slice":
        return args[0][(slice(None),) * a["dim"] + (slice(a["start"], a["end"], a["step"]),)]
    if op == "index_select":
        return torch.index_select(args[0], a["dim"], args[1])
    if op == "cat":
        return torch.cat(list(args), dim=a["dim"])
    if op == "opaque":
        return run_opaque(node, args)
    if op == "rnn":
        return rnn_reference(a["cell"], args, a["batch_first"], a.get("final_cell", False))
    if op == "pool2d":
        return _pool2d(args[0], a)
    raise NotImplementedError(f"no reference for primitive {op!r}")


def rnn_reference(
    cell: str, args: Sequence[Tensor], batch_first: bool, final_cell: bool = False
) -> Tensor:
    """One LSTM / GRU layer through PyTorch (the ``rnn`` primitive's meaning): the outputs,
    laid out as x, contiguous; for an LSTM with ``final_cell`` the last cell state (B, H)."""
    if cell == "lstm":
        x, h0, c0, *weights = args
        out, _, c = torch.lstm(x, (h0[None], c0[None]), list(weights), True, 1, 0.0, False,
                               False, batch_first)  # fmt: skip
        return c[0].clone() if final_cell else out.contiguous()
    x, h0, *weights = args
    out, _ = torch.gru(x, h0[None], list(weights), True, 1, 0.0, False, False, batch_first)
    return out.contiguous()


def _conv(args: Sequence[Tensor], a: dict) -> Tensor:
    x, w = args[0], args[1]
    b = args[2] if len(args) > 2 else None
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[w.dim() - 2]
    if a.get("channels_last"):
        # x (N, *spatial, C) -> y (N, *spatial', C_out), both stored contiguously
        y = _conv(
            [x.movedim(-1, 1), *args[1:]], {**a, "channels_last": False}
        )  # (N, C_out, *spatial')
        return y.movedim(1, -1).contiguous()
    before, after = conv_padding(a)
    mode = conv_padding_mode(a)
    padding = before
    if before != after or mode != "zeros":  # pad explicitly (last dim first), then none
        pads = [p for d in reversed(range(len(before))) for p in (before[d], after[d])]
        x = F.pad(x, pads, mode="constant" if mode == "zeros" else mode)
        padding = (0,) * len(before)
    return conv(x, w, b, a["stride"], padding, a["dilation"], a["groups"])


def _pool2d(x: Tensor, a: dict) -> Tensor:
    """max_pool2d / avg_pool2d (count_include_pad); channels_last: (N, H, W, C) in and
    out, both contiguous, as for conv."""
    if a.get("channels_last"):
        return _pool2d(x.movedim(-1, 1), {**a, "channels_last": False}).movedim(1, -1).contiguous()
    k, s, p = list(a["kernel"]), list(a["stride"]), list(a["padding"])
    if a["mode"] == "max":
        return F.max_pool2d(x, k, s, p)
    return F.avg_pool2d(x, k, s, p, count_include_pad=True)


def run_opaque(node: Node, args: Sequence[Tensor]) -> Tensor:
    """Call the original ATen op. ``attrs["args"]``/``["kwargs"]`` hold the call
    template where ``TensorArg(i)`` marks the i-th tensor input."""
    tensors = list(args)

    def fill(x: object) -> object:
        if isinstance(x, TensorArg):
            return tensors[x.index]
        if isinstance(x, (list, tuple)):
            return type(x)(fill(y) for y in x)
        return x

    call_args = fill(node.attrs["args"])
    call_kwargs = {k: fill(v) for k, v in node.attrs.get("kwargs", {}).items()}
    assert isinstance(call_args, (list, tuple))
    out = node.attrs["target"](*call_args, **call_kwargs)
    if isinstance(out, (tuple, list)):
        out = out[node.attrs.get("output_index", 0)]
    return out


class TensorArg:
    """Placeholder for the i-th tensor input inside an opaque op's call template."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"TensorArg({self.index})"


def run_graph(graph: Graph, inputs: Sequence[Tensor]) -> list[Tensor]:
    """Execute a primitive graph node by node with ATen (the correctness oracle)."""
    env: dict[str, Tensor] = dict(graph.constants)
    if len(inputs) != len(graph.inputs):
        raise ValueError(f"expected {len(graph.inputs)} inputs, got {len(inputs)}")
    env.update(zip(graph.inputs, inputs))
    for n in graph.nodes:
        env[n.output] = eval_node(n, [env[i] for i in n.inputs])
    return [env[o] for o in graph.outputs]
