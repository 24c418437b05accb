"""ResNet-18 (He et al. 2016), written out, at a 112x112 image."""

from __future__ import annotations

import torch
from torch import nn

from kiln.bench.suite._base import BenchModel, randomize_norm_stats


def _conv_bn(c_in: int, c_out: int, k: int, stride: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, k, stride=stride, padding=k // 2, bias=False), nn.BatchNorm2d(c_out)
    )


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with a ReLU between, identity or 1x1-conv shortcut."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.a = _conv_bn(c_in, c_out, 3, stride)
        self.b = _conv_bn(c_out, c_out, 3, 1)
        self.short: nn.Module = (
            _conv_bn(c_in, c_out, 1, stride) if stride != 1 or c_in != c_out else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.b(torch.relu(self.a(x))) + self.short(x))


class ResNet18(nn.Module):
    """Stem (7x7/2 conv, BN, ReLU, 3x3/2 max-pool), 4 stages of 2 basic blocks
    (64, 128, 256, 512 channels), global average pool, 1000-way linear head."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(_conv_bn(3, 64, 7, 2), nn.ReLU(), nn.MaxPool2d(3, 2, padding=1))
        blocks: list[nn.Module] = []
        c_in = 64
        for i, c in enumerate([64, 128, 256, 512]):
            stride = 1 if i == 0 else 2
            blocks += [BasicBlock(c_in, c, stride), BasicBlock(c, c, 1)]
            c_in = c
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(512, classes)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        # img (B, 3, 112, 112)
        x = self.blocks(self.stem(img))  # (B, 512, 4, 4)
        return self.fc(x.mean(dim=(2, 3)))  # (B, 1000)


def _build(batch: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    model = ResNet18()
    randomize_norm_stats(model)
    return model, (torch.randn(batch, 3, 112, 112),)


MODELS = [
    BenchModel(
        name="resnet18",
        kind="cnn",
        builder=_build,
        cpu_batch=1,
        gpu_batch=64,
        config="ResNet-18 (BasicBlock x [2,2,2,2], 64-512 channels), image 112x112; batch 1",
    )
]
