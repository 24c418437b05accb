"""The SwiGLU tower from docs/benchmarks.md: x (8, 320), 4 blocks 320 -> 864 -> 320."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.bench.suite._base import BenchModel


class SwiGLUBlock(nn.Module):
    """y = x + W_down(silu(W_gate x) * (W_up x)), no biases (LLaMA-style)."""

    def __init__(self, d: int, inner: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d, inner, bias=False)
        self.up = nn.Linear(d, inner, bias=False)
        self.down = nn.Linear(inner, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x (M, 320)
        return x + self.down(F.silu(self.gate(x)) * self.up(x))  # (M, 320)


class SwiGLUTower(nn.Module):
    """``blocks`` residual SwiGLU blocks in sequence."""

    def __init__(self, d: int = 320, inner: int = 864, blocks: int = 4) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[SwiGLUBlock(d, inner) for _ in range(blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)  # (M, 320)


def _build(batch: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return SwiGLUTower(), (torch.randn(batch, 320),)


MODELS = [
    BenchModel(
        name="swiglu_tower",
        kind="mlp",
        builder=_build,
        cpu_batch=8,
        gpu_batch=512,
        config="SwiGLU tower: x (8, 320), 4 residual blocks 320 -> 864 -> 320, no bias",
    )
]
