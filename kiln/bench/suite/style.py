"""Fast style-transfer TransformerNet (Johnson et al. 2016) with instance norm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.bench.suite._base import BenchModel, randomize_norm_stats


class ConvIN(nn.Module):
    """Reflection-padded conv, optional nearest 2x upsample before it, then
    InstanceNorm (affine) and an optional ReLU."""

    def __init__(
        self, c_in: int, c_out: int, k: int, stride: int = 1, up: bool = False, norm: bool = True,
        relu: bool = True,
    ) -> None:  # fmt: skip
        super().__init__()
        self.up, self.relu, self.pad = up, relu, k // 2
        self.conv = nn.Conv2d(c_in, c_out, k, stride)
        self.norm: nn.Module = nn.InstanceNorm2d(c_out, affine=True) if norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.up:
            x = F.interpolate(x, scale_factor=2.0, mode="nearest")
        x = self.norm(self.conv(F.pad(x, [self.pad] * 4, mode="reflect")))
        return torch.relu(x) if self.relu else x


class Residual(nn.Module):
    """Two 3x3 ConvIN layers (the second without ReLU) plus the identity."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.a = ConvIN(c, c, 3)
        self.b = ConvIN(c, c, 3, relu=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(self.a(x))


class TransformerNet(nn.Module):
    """9x9 conv 3->32, two stride-2 3x3 convs to 64 and 128, five residual
    blocks, two upsample+conv stages back to 32, 9x9 conv to 3 channels."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            ConvIN(3, 32, 9),
            ConvIN(32, 64, 3, stride=2),
            ConvIN(64, 128, 3, stride=2),
            *[Residual(128) for _ in range(5)],
            ConvIN(128, 64, 3, up=True),
            ConvIN(64, 32, 3, up=True),
            ConvIN(32, 3, 9, norm=False, relu=False),
        )

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        return self.net(img)  # (B, 3, 64, 64) -> (B, 3, 64, 64)


def _build(batch: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    model = TransformerNet()
    randomize_norm_stats(model)
    return model, (torch.rand(batch, 3, 64, 64) * 255.0,)


MODELS = [
    BenchModel(
        name="style_transfer",
        kind="cnn",
        builder=_build,
        cpu_batch=1,
        gpu_batch=16,
        config="TransformerNet: 32-64-128 channels, 5 residual blocks, instance norm, "
        "reflection pad, nearest upsampling; image 64x64, batch 1",
    )
]
