"""The lowering registry: ATen OpOverload (or overload packet) -> function
emitting kiln primitives. Importing this module fills ``LOWERINGS`` from the
``lower_*`` modules, one per family of ops."""

from __future__ import annotations

from kiln.compiler.capture import (
    lower_gemm,
    lower_layout,
    lower_pointwise,
    lower_pool,
    lower_reduce,
    rnn,
)
from kiln.compiler.capture.builder import LOWERINGS, LowerFn

FAMILIES = (lower_pointwise, lower_reduce, lower_layout, lower_gemm, lower_pool, rnn)


def find_lowering(target: object) -> LowerFn | None:
    """The lowering for an FX call target: its overload's entry, else its
    overload packet's, else None (the call becomes opaque)."""
    fn = LOWERINGS.get(target)
    if fn is None:
        fn = LOWERINGS.get(getattr(target, "overloadpacket", None))
    return fn
