"""Sequence models built from 1-D convolutions and a GRU: the families where
convolution and recurrence, not attention, carry the time.

* ``tcn``: a temporal convolutional network (Bai et al. 2018): residual blocks of two
  dilated causal convolutions (dilation 1, 2, 4, 8), ReLU, 1x1 skip where widths change.
* ``wavenet``: a WaveNet-style stack (van den Oord et al. 2016): gated dilated causal
  convolutions (tanh x sigmoid), 1x1 residual and skip projections, two 1x1 output layers.
* ``gru``: a 2-layer GRU over filter-bank frames with a linear head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.bench.suite._base import BenchModel


class CausalConv1d(nn.Conv1d):
    """A 1-D convolution that sees only the past: left padding of dilation x (k - 1)."""

    def __init__(self, c_in: int, c_out: int, kernel: int, dilation: int) -> None:
        super().__init__(c_in, c_out, kernel, dilation=dilation)
        self.left = dilation * (kernel - 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x (B, C_in, T) -> (B, C_out, T)
        return super().forward(F.pad(x, (self.left, 0)))


class TemporalBlock(nn.Module):
    """conv(d) -> ReLU -> conv(d) -> ReLU, plus the input (1x1-projected if widths differ)."""

    def __init__(self, c_in: int, c_out: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.conv1 = CausalConv1d(c_in, c_out, kernel, dilation)
        self.conv2 = CausalConv1d(c_out, c_out, kernel, dilation)
        self.skip = nn.Conv1d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x (B, C_in, T)
        y = F.relu(self.conv1(x))
        y = F.relu(self.conv2(y))
        return F.relu(y + self.skip(x))  # (B, C_out, T)


class TCN(nn.Module):
    """40 features -> 4 temporal blocks (64 channels, kernel 3, dilations 1-8) -> 10 classes
    per frame."""

    def __init__(self, d_in: int = 40, width: int = 64, kernel: int = 3, d_out: int = 10) -> None:
        super().__init__()
        widths = [d_in, width, width, width, width]
        self.blocks = nn.Sequential(
            *(TemporalBlock(widths[i], widths[i + 1], kernel, 2**i) for i in range(4))
        )
        self.head = nn.Conv1d(width, d_out, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x (B, 40, T) -> (B, 10, T)
        return self.head(self.blocks(x))


class GatedResidual(nn.Module):
    """WaveNet layer: tanh(conv_f) * sigmoid(conv_g) -> 1x1 residual and 1x1 skip outputs."""

    def __init__(self, channels: int, skip: int, dilation: int) -> None:
        super().__init__()
        self.filt = CausalConv1d(channels, channels, 2, dilation)
        self.gate = CausalConv1d(channels, channels, 2, dilation)
        self.res = nn.Conv1d(channels, channels, 1)
        self.skip = nn.Conv1d(channels, skip, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x (B, C, T)
        z = torch.tanh(self.filt(x)) * torch.sigmoid(self.gate(x))  # (B, C, T)
        return x + self.res(z), self.skip(z)  # (B, C, T), (B, S, T)


class WaveNetish(nn.Module):
    """1x1 input conv (1 -> 32) -> 10 gated layers (dilations 1..512) -> sum of skips ->
    ReLU -> 1x1 (64) -> ReLU -> 1x1 to 256 logits per sample."""

    def __init__(self, channels: int = 32, skip: int = 64, layers: int = 10, classes: int = 256):
        super().__init__()
        self.inp = nn.Conv1d(1, channels, 1)
        self.layers = nn.ModuleList(GatedResidual(channels, skip, 2**i) for i in range(layers))
        self.out1 = nn.Conv1d(skip, skip, 1)
        self.out2 = nn.Conv1d(skip, classes, 1)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        # audio (B, 1, T) -> logits (B, 256, T)
        x = self.inp(audio)
        total = torch.zeros((), dtype=audio.dtype)
        for layer in self.layers:
            x, s = layer(x)
            total = total + s
        return self.out2(F.relu(self.out1(F.relu(total))))


class GRUStack(nn.Module):
    """80 filter-bank features -> 2-layer GRU (hidden 256) -> linear to 32 tokens."""

    def __init__(self, d_in: int = 80, hidden: int = 256, layers: int = 2, d_out: int = 32) -> None:
        super().__init__()
        self.gru = nn.GRU(d_in, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, d_out)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        # feats (B, T, 80)
        out, _ = self.gru(feats)  # (B, T, 256)
        return self.head(out)  # (B, T, 32)


def _build_tcn(batch: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return TCN(), (torch.randn(batch, 40, 128),)


def _build_wavenet(batch: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return WaveNetish(), (torch.randn(batch, 1, 256),)


def _build_gru(batch: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return GRUStack(), (torch.randn(batch, 16, 80),)


MODELS = [
    BenchModel(
        name="tcn",
        kind="speech",
        builder=_build_tcn,
        cpu_batch=1,
        gpu_batch=64,
        config="TCN: 40 features -> 4 residual blocks of dilated causal convs (64 channels, "
        "kernel 3, dilation 1-8) -> 1x1 to 10; 128 frames, batch 1",
    ),
    BenchModel(
        name="wavenet",
        kind="speech",
        builder=_build_wavenet,
        cpu_batch=1,
        gpu_batch=32,
        config="WaveNet-style: 10 gated dilated causal conv layers (32 channels, dilation "
        "1-512), 1x1 residual/skip (64), two 1x1 output layers to 256; 256 samples, batch 1",
    ),
    BenchModel(
        name="gru",
        kind="speech",
        builder=_build_gru,
        cpu_batch=1,
        gpu_batch=64,
        config="GRU stack: 80 features -> 2 layers, hidden 256 -> linear 32; seq 16, batch 1",
    ),
]
