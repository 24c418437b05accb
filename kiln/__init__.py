"""kiln: make trained PyTorch models cheaper and faster to serve.

The public verbs (each loads its part of kiln on first use, so ``import kiln`` stays light):

- ``kiln.compile(model, example_inputs)``: the small-model compiler (also a ``torch.compile``
  backend: ``torch.compile(model, backend="kiln")``);
- ``kiln.quantize_`` / ``kiln.sparsify_`` / ``kiln.lowrank_``: compress a model's linear
  layers in place (configs such as ``kiln.compress.Int4WeightOnly``);
- ``kiln.load_model(checkpoint)``: a Hugging Face folder, a GGUF file or what ``kiln
  compress`` wrote, as kiln's ``Transformer`` and its tokenizer;
- ``kiln.generate(decoder, prompt_ids, n_new, sampling)``: the one generation loop.

The parts of the system are the sub-packages; docs/architecture.md describes them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kiln.compiler.api import CompileOptions, VerificationError, compile
    from kiln.compiler.exec.compiled import CompiledModule
    from kiln.compiler.exec.executors import ShapeMismatch
    from kiln.compress.verbs import lowrank_, quantize_, sparsify_
    from kiln.llm.generate import generate
    from kiln.models.load import load_model

__all__ = [
    "CompileOptions",
    "CompiledModule",
    "ShapeMismatch",
    "VerificationError",
    "compile",
    "generate",
    "load_model",
    "lowrank_",
    "quantize_",
    "sparsify_",
]
__version__ = "0.1.0"

_LAZY = {
    "compile": "kiln.compiler.api",
    "CompileOptions": "kiln.compiler.api",
    "VerificationError": "kiln.compiler.api",
    "CompiledModule": "kiln.compiler.exec.compiled",
    "ShapeMismatch": "kiln.compiler.exec.executors",
    "quantize_": "kiln.compress.verbs",
    "sparsify_": "kiln.compress.verbs",
    "lowrank_": "kiln.compress.verbs",
    "load_model": "kiln.models.load",
    "generate": "kiln.llm.generate",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")
