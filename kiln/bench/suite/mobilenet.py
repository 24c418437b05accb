"""A MobileNetV2-style depthwise-separable network (Sandler et al. 2018)."""

from __future__ import annotations

import torch
from torch import nn

from kiln.bench.suite._base import BenchModel, randomize_norm_stats

# (expansion t, channels c, repeats n, first stride s), as in the MobileNetV2 paper.
SETTINGS = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1)]


def _cbr(c_in: int, c_out: int, k: int, stride: int, groups: int = 1) -> list[nn.Module]:
    return [
        nn.Conv2d(c_in, c_out, k, stride, k // 2, groups=groups, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU6(),
    ]


class InvertedResidual(nn.Module):
    """1x1 expand (ReLU6) -> 3x3 depthwise (ReLU6) -> 1x1 linear project, with a
    residual add when stride is 1 and the channel count is kept."""

    def __init__(self, c_in: int, c_out: int, stride: int, expand: int) -> None:
        super().__init__()
        mid = c_in * expand
        layers = _cbr(c_in, mid, 1, 1) if expand != 1 else []
        layers += _cbr(mid, mid, 3, stride, groups=mid)
        layers += [nn.Conv2d(mid, c_out, 1, bias=False), nn.BatchNorm2d(c_out)]
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        return x + y if self.residual else y


class MobileNetV2ish(nn.Module):
    """MobileNetV2 (width 1.0) truncated after the 96-channel stage: stem 3x3/2
    conv to 32, 13 inverted-residual blocks, a 1x1 conv to 640, global average
    pool, 1000-way head."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        layers: list[nn.Module] = _cbr(3, 32, 3, 2)
        c_in = 32
        for t, c, n, s in SETTINGS:
            for i in range(n):
                layers.append(InvertedResidual(c_in, c, s if i == 0 else 1, t))
                c_in = c
        layers += _cbr(c_in, 640, 1, 1)
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(640, classes)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        # img (B, 3, 112, 112)
        x = self.features(img)  # (B, 640, 7, 7)
        return self.head(x.mean(dim=(2, 3)))  # (B, 1000)


def _build(batch: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    model = MobileNetV2ish()
    randomize_norm_stats(model)
    return model, (torch.randn(batch, 3, 112, 112),)


MODELS = [
    BenchModel(
        name="mobilenet_v2",
        kind="cnn",
        builder=_build,
        cpu_batch=1,
        gpu_batch=64,
        config="MobileNetV2-style: stem + 13 inverted residuals (t=6, 16-96 channels), "
        "1x1 to 640, image 112x112; batch 1",
    )
]
