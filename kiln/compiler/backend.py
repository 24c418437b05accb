"""kiln as a ``torch.compile`` backend: ``torch.compile(model, backend="kiln")``.

Registered through the ``torch_dynamo_backends`` entry point (pyproject.toml), so
importing kiln changes no global state. Dynamo hands over an FX graph per captured
region; kiln compiles it for the example shapes. A region kiln cannot compile runs
as the FX graph itself, with a warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

Tensor = torch.Tensor


def _real(t: Any) -> Any:
    """Dynamo may pass fake tensors; kiln compiles (and verifies) on real ones."""
    if isinstance(t, Tensor):
        return (
            torch.randn(t.shape, dtype=t.dtype, device=t.device)
            if t.is_floating_point()
            else torch.zeros(t.shape, dtype=t.dtype, device=t.device)
        )
    return t


def kiln_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    from kiln.compiler.api import compile as kiln_compile

    if not all(isinstance(t, Tensor) for t in example_inputs):
        warnings.warn("kiln backend: non-tensor inputs; running the graph as is", stacklevel=2)
        return gm.forward
    inputs = tuple(_real(t) for t in example_inputs)
    try:
        compiled = kiln_compile(gm, inputs)
    except Exception as e:  # noqa: BLE001 - never break the user's model: run it unfused
        warnings.warn(
            f"kiln backend: could not compile this graph ({e}); running it as is", stacklevel=2
        )
        return gm.forward
    shapes = [tuple(t.shape) for t in inputs]

    def run(*args: Tensor) -> Any:
        if [tuple(a.shape) for a in args] != shapes:
            return gm.forward(*args)  # a new shape: dynamo would normally recompile first
        return compiled(*args)

    return run
