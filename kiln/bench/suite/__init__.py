"""The model registry: ``MODELS`` maps a name to its ``BenchModel``.

All models are built in code with random weights from a fixed seed (no
downloads, no torchvision/torchaudio); ``MODELS[name].build()`` returns
``(module.eval(), example_inputs)`` at the CPU shape.
"""

from __future__ import annotations

from kiln.bench.suite import (
    bert,
    dlrm,
    gpt2,
    mlp,
    mobilenet,
    resnet,
    speech,
    style,
    swiglu,
    temporal,
    unet,
    vit,
)
from kiln.bench.suite._base import SEED, BenchModel

MODELS: dict[str, BenchModel] = {
    m.name: m
    for family in (
        mlp,
        swiglu,
        dlrm,
        bert,
        vit,
        gpt2,
        speech,
        temporal,
        resnet,
        mobilenet,
        unet,
        style,
    )
    for m in family.MODELS
}

# The model the demo and quick checks use: the SwiGLU tower of docs/benchmarks.md.
DEFAULT_MODEL = "swiglu_tower"


def get(name: str) -> BenchModel:
    """Look a model up by name, with the list of known names in the error."""
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None


__all__ = ["DEFAULT_MODEL", "MODELS", "SEED", "BenchModel", "get"]
