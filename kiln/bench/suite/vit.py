"""ViT-tiny (192 hidden, 12 layers, 3 heads) at a small 64x64 image."""

from __future__ import annotations

import torch
from torch import nn

from kiln.bench.suite._base import BenchModel, randomize_norm_stats
from kiln.bench.suite._blocks import EncoderLayer


class ViTTiny(nn.Module):
    """Patch-embedding conv (16x16, stride 16), class token, learned position
    embeddings, 12 pre-LN encoder layers (192 hidden, 3 heads, MLP 768), final
    LayerNorm and a 1000-way head on the class token.

    The image is 64x64 (16 patches + class token = 17 tokens) instead of 224x224
    (197 tokens), which keeps the model overhead-bound on 2 cores.
    """

    def __init__(
        self, image: int = 64, patch: int = 16, hidden: int = 192, layers: int = 12, heads: int = 3
    ) -> None:
        super().__init__()
        n_patches = (image // patch) ** 2
        self.patch = nn.Conv2d(3, hidden, kernel_size=patch, stride=patch)
        self.cls = nn.Parameter(0.02 * torch.randn(1, 1, hidden))
        self.pos = nn.Parameter(0.02 * torch.randn(1, n_patches + 1, hidden))
        self.layers = nn.ModuleList(
            EncoderLayer(hidden, heads, 4 * hidden, pre_norm=True, eps=1e-6) for _ in range(layers)
        )
        self.ln = nn.LayerNorm(hidden, eps=1e-6)
        self.head = nn.Linear(hidden, 1000)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        # img (B, 3, 64, 64)
        x = self.patch(img).flatten(2).transpose(1, 2)  # (B, 16, C)
        cls = self.cls.expand(x.shape[0], -1, -1)  # (B, 1, C)
        x = torch.cat([cls, x], dim=1) + self.pos  # (B, 17, C)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln(x[:, 0]))  # (B, 1000)


def _build(batch: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    model = ViTTiny()
    randomize_norm_stats(model)
    return model, (torch.randn(batch, 3, 64, 64),)


MODELS = [
    BenchModel(
        name="vit_tiny",
        kind="transformer",
        builder=_build,
        cpu_batch=1,
        gpu_batch=64,
        config="ViT-tiny: 192 hidden, 12 layers, 3 heads, MLP 768, patch 16, image 64x64 "
        "(17 tokens, not 224x224); batch 1",
    )
]
