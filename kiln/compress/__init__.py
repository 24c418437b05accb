"""Compression with accuracy control (quantize, sparsify, low rank, a per-layer plan); may import kiln.core, kernels and quality.

Verbs (in place, over a model's linear layers)::

    from kiln.compress import quantize_, Int4WeightOnly
    quantize_(model, Int4WeightOnly(group_size=64))

Accuracy-controlled plan: ``workflow.compress_to_budget(task, 0.01)`` calibrates, predicts
every (layer, option)'s loss increase, allocates with an exact grouped knapsack, measures
the result on the search text and tightens until it is within budget with a confidence
margin, then confirms the plan on a text the search never saw (its reported accuracy).
Checkpoints: ``save_compressed`` / ``load_compressed`` (safetensors + a JSON manifest).
"""

from kiln.compress.checkpoint import load_compressed, load_into, save_compressed
from kiln.compress.configs import Int4WeightOnly, Int8WeightOnly, LowRank, SemiStructured24
from kiln.compress.gguf_linear import GgufLinear  # registers the "gguf" layer kind
from kiln.compress.modules import (
    CompressedLinear,
    Int4Linear,
    Int8Linear,
    LowRankLinear,
    Sparse24Linear,
)
from kiln.compress.verbs import lowrank_, quantize_, sparsify_

__all__ = [
    "CompressedLinear",
    "GgufLinear",
    "Int4Linear",
    "Int4WeightOnly",
    "Int8Linear",
    "Int8WeightOnly",
    "LowRank",
    "LowRankLinear",
    "SemiStructured24",
    "Sparse24Linear",
    "load_compressed",
    "load_into",
    "lowrank_",
    "quantize_",
    "save_compressed",
    "sparsify_",
]
