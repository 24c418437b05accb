"""Coordinate MLPs: the NeRF MLP and a tiny-cuda-nn-style fully-fused MLP."""

from __future__ import annotations

import torch
from torch import nn

from kiln.bench.suite._base import BenchModel


class NeRFMLP(nn.Module):
    """The original NeRF network (Mildenhall et al. 2020).

    Positional encodings of the point (63 = 3 + 3*2*10) and view direction
    (27 = 3 + 3*2*4) go in; 8 ReLU layers of width 256 with the point encoding
    concatenated back in after layer 4; sigma from the trunk, rgb from a
    256+27 -> 128 -> 3 head. Output (B, 4): rgb (sigmoid) then sigma (relu).
    """

    def __init__(self, d_pts: int = 63, d_dir: int = 27, width: int = 256, skip: int = 4) -> None:
        super().__init__()
        self.skip = skip
        layers = []
        for i in range(8):
            d_in = d_pts if i == 0 else width + (d_pts if i == skip else 0)
            layers.append(nn.Linear(d_in, width))
        self.trunk = nn.ModuleList(layers)
        self.sigma = nn.Linear(width, 1)
        self.feature = nn.Linear(width, width)
        self.view = nn.Linear(width + d_dir, width // 2)
        self.rgb = nn.Linear(width // 2, 3)

    def forward(self, pts: torch.Tensor, dirs: torch.Tensor) -> torch.Tensor:
        # pts (B, 63), dirs (B, 27)
        h = pts
        for i, layer in enumerate(self.trunk):
            if i == self.skip:
                h = torch.cat([h, pts], dim=-1)  # (B, 256 + 63)
            h = torch.relu(layer(h))  # (B, 256)
        sigma = torch.relu(self.sigma(h))  # (B, 1)
        feat = self.feature(h)  # (B, 256)
        v = torch.relu(self.view(torch.cat([feat, dirs], dim=-1)))  # (B, 128)
        rgb = torch.sigmoid(self.rgb(v))  # (B, 3)
        return torch.cat([rgb, sigma], dim=-1)  # (B, 4)


class TinyMLP(nn.Module):
    """A tiny-cuda-nn "FullyFusedMLP": 64 wide, 3 hidden ReLU layers, no biases.

    32 encoded input features (e.g. a hash-grid encoding) -> 16 outputs.
    """

    def __init__(self, d_in: int = 32, width: int = 64, depth: int = 3, d_out: int = 16) -> None:
        super().__init__()
        dims = [d_in] + [width] * depth
        self.hidden = nn.ModuleList(
            nn.Linear(a, b, bias=False) for a, b in zip(dims[:-1], dims[1:], strict=True)
        )
        self.out = nn.Linear(width, d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x (B, 32)
        for layer in self.hidden:
            x = torch.relu(layer(x))  # (B, 64)
        return self.out(x)  # (B, 16)


def _build_nerf(batch: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return NeRFMLP(), (torch.randn(batch, 63), torch.randn(batch, 27))


def _build_tiny(batch: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return TinyMLP(), (torch.randn(batch, 32),)


MODELS = [
    BenchModel(
        name="nerf_mlp",
        kind="mlp",
        builder=_build_nerf,
        cpu_batch=64,
        gpu_batch=65536,
        config="NeRF MLP 8x256, skip at layer 4, inputs 63+27 -> rgb+sigma; 64 samples",
    ),
    BenchModel(
        name="tcnn_mlp",
        kind="mlp",
        builder=_build_tiny,
        cpu_batch=64,
        gpu_batch=262144,
        config="tiny-cuda-nn-style MLP 32 -> 3x64 (ReLU, no bias) -> 16; 64 samples",
    ),
]
