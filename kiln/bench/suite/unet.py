"""A small U-Net (Ronneberger et al. 2015): an encoder of 3x3 conv pairs and max pools, a
decoder of 2x2 transposed convs whose outputs are concatenated with the encoder's
features at the same scale, and a 1x1 conv to per-pixel class scores."""

from __future__ import annotations

import torch
from torch import nn

from kiln.bench.suite._base import BenchModel, randomize_norm_stats


def _double_conv(c_in: int, c_out: int) -> nn.Sequential:
    """(3x3 conv -> BatchNorm -> ReLU) twice, spatial size kept."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(),
        nn.Conv2d(c_out, c_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(),
    )


class SmallUNet(nn.Module):
    """3 -> 16 -> 32 -> 64 (bottleneck) -> 32 -> 16 -> 4 classes, two 2x downsamplings."""

    def __init__(
        self, c_in: int = 3, widths: tuple[int, int, int] = (16, 32, 64), classes: int = 4
    ):
        super().__init__()
        w0, w1, w2 = widths
        self.enc0 = _double_conv(c_in, w0)
        self.enc1 = _double_conv(w0, w1)
        self.mid = _double_conv(w1, w2)
        self.pool = nn.MaxPool2d(2)
        self.up1 = nn.ConvTranspose2d(w2, w1, 2, stride=2)
        self.dec1 = _double_conv(2 * w1, w1)
        self.up0 = nn.ConvTranspose2d(w1, w0, 2, stride=2)
        self.dec0 = _double_conv(2 * w0, w0)
        self.head = nn.Conv2d(w0, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x (B, 3, H, W) -> (B, 4, H, W)
        e0 = self.enc0(x)  # (B, 16, H, W)
        e1 = self.enc1(self.pool(e0))  # (B, 32, H/2, W/2)
        m = self.mid(self.pool(e1))  # (B, 64, H/4, W/4)
        d1 = self.dec1(torch.cat([self.up1(m), e1], dim=1))  # (B, 32, H/2, W/2)
        d0 = self.dec0(torch.cat([self.up0(d1), e0], dim=1))  # (B, 16, H, W)
        return self.head(d0)


def _build_unet(batch: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    model = SmallUNet()
    randomize_norm_stats(model)
    return model, (torch.randn(batch, 3, 64, 64),)


MODELS = [
    BenchModel(
        name="unet",
        kind="cnn",
        builder=_build_unet,
        cpu_batch=1,
        gpu_batch=16,
        config="U-Net: 16-32-64 channels, 3x3 conv pairs with BatchNorm, max pool, 2x2 "
        "transposed convs, skip concatenation, 1x1 to 4 classes; image 64x64, batch 1",
    ),
]
