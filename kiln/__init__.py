"""kiln: make trained PyTorch models cheaper and faster to serve.

Small models: ``kiln.compile(model, example_inputs)`` captures the whole graph, splits
operators into primitives, chooses kernel boundaries with a binary linear program and
runs the result as one generated native program. kiln is also a ``torch.compile``
backend: ``torch.compile(model, backend="kiln")``.

The public names load lazily, so ``import kiln.compiler.ir.graph`` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kiln.compiler.api import CompileOptions, VerificationError, compile
    from kiln.compiler.exec.compiled import CompiledModule
    from kiln.compiler.exec.executors import ShapeMismatch

__all__ = ["CompileOptions", "CompiledModule", "ShapeMismatch", "VerificationError", "compile"]
__version__ = "0.1.0"

_LAZY = {
    "compile": "kiln.compiler.api",
    "CompileOptions": "kiln.compiler.api",
    "VerificationError": "kiln.compiler.api",
    "CompiledModule": "kiln.compiler.exec.compiled",
    "ShapeMismatch": "kiln.compiler.exec.executors",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")
