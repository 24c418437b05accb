"""Opaque ATen calls that may join a channels-last region (``channels_last.py``).

Some ATen ops kiln runs as opaque calls have CPU kernels that follow their input's
memory format: fed a channels-last tensor they run their channels-last kernel
(measured, 1 thread: a 3x3/2 max pool over 64x56x56 in 81 us instead of 1.5 ms, a 2x
nearest upsample of it in 115 us instead of 600-900 us), so inside a region they cost
less than outside it. Most pools are ``pool2d`` primitives now (``lower_pool.py``); the
ones left here are those it does not take (ceil mode, dilation, a divisor override).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln.compiler.ir.graph import Graph, Node
from kiln.compiler.ir.semantics import TensorArg

aten = torch.ops.aten

FORMAT_FOLLOWING = frozenset(
    {
        aten.max_pool2d_with_indices.default,
        aten.max_pool2d.default,
        aten.avg_pool2d.default,
        aten.upsample_nearest2d.vec,
        aten.upsample_nearest2d.default,
        aten.upsample_bilinear2d.vec,
        aten.upsample_bilinear2d.default,
    }
)


class ChannelsLastCall:
    """An NCHW ATen op (one of ``FORMAT_FOLLOWING``) as the target of an opaque node on
    (N, H, W, C) values: it is called on the NCHW-shaped channels-last view of its input,
    and every result (N, C', H', W') comes back as (N, H', W', C') contiguous."""

    def __init__(self, target: Callable[..., object]) -> None:
        self.target = target

    def __call__(self, x: torch.Tensor, *args: object, **kwargs: object) -> object:
        out = self.target(x.permute(0, 3, 1, 2), *args, **kwargs)
        if isinstance(out, (tuple, list)):
            return type(out)(o.permute(0, 2, 3, 1).contiguous() for o in out)
        assert isinstance(out, torch.Tensor)
        return out.permute(0, 2, 3, 1).contiguous()

    def __str__(self) -> str:  # fallback reports name the ATen op
        return str(self.target)

    def __repr__(self) -> str:
        return f"ChannelsLastCall({self.target})"


def format_following(graph: Graph, n: Node) -> bool:
    """An opaque call of a ``FORMAT_FOLLOWING`` op on one fp32 4-D tensor, its first argument."""
    a = n.attrs
    args = a.get("args", ())
    return (
        n.op == "opaque"
        and a.get("target") in FORMAT_FOLLOWING
        and len(n.inputs) == 1
        and bool(args)
        and isinstance(args[0], TensorArg)
        and len(graph.meta(n.inputs[0]).shape) == len(graph.meta(n.output).shape) == 4
        and graph.meta(n.inputs[0]).dtype == graph.meta(n.output).dtype == torch.float32
    )
