"""Speech models: an LSTM stack, a Conformer block and a small speech encoder (conv
subsampling + Conformer), written in code (no torchaudio)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.bench.suite._base import BenchModel, randomize_norm_stats
from kiln.bench.suite._blocks import SelfAttention


class LSTMStack(nn.Module):
    """80 filter-bank features -> 2-layer LSTM (hidden 256) -> linear to 32 tokens."""

    def __init__(self, d_in: int = 80, hidden: int = 256, layers: int = 2, d_out: int = 32) -> None:
        super().__init__()
        self.lstm = nn.LSTM(d_in, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, d_out)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        # feats (B, T, 80)
        out, _ = self.lstm(feats)  # (B, T, 256)
        return self.head(out)  # (B, T, 32)


class HalfFFN(nn.Module):
    """Conformer feed-forward module, added with weight 1/2 (macaron half-step)."""

    def __init__(self, d: int, inner: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, inner)
        self.fc2 = nn.Linear(inner, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.5 * self.fc2(F.silu(self.fc1(self.ln(x))))  # (B, T, d)


class ConvModule(nn.Module):
    """LN -> pointwise conv (d -> 2d) -> GLU -> depthwise conv (k) -> BatchNorm ->
    swish -> pointwise conv (d -> d), with a residual add."""

    def __init__(self, d: int, kernel: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.pw1 = nn.Conv1d(d, 2 * d, 1)
        self.dw = nn.Conv1d(d, d, kernel, padding=kernel // 2, groups=d)
        self.bn = nn.BatchNorm1d(d)
        self.pw2 = nn.Conv1d(d, d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x (B, T, d)
        y = self.ln(x).transpose(1, 2)  # (B, d, T)
        y = F.glu(self.pw1(y), dim=1)  # (B, d, T)
        y = F.silu(self.bn(self.dw(y)))  # (B, d, T)
        return x + self.pw2(y).transpose(1, 2)  # (B, T, d)


class ConformerBlock(nn.Module):
    """Conformer block (Gulati et al. 2020): FFN/2, MHSA, conv module, FFN/2, LN.

    Attention uses plain absolute-position MHSA (no relative positional
    encoding), which keeps the block a pure function of its input.
    """

    def __init__(self, d: int = 144, heads: int = 4, ffn: int = 576, kernel: int = 31) -> None:
        super().__init__()
        self.ffn1 = HalfFFN(d, ffn)
        self.ln_attn = nn.LayerNorm(d)
        self.attn = SelfAttention(d, heads)
        self.conv = ConvModule(d, kernel)
        self.ffn2 = HalfFFN(d, ffn)
        self.ln_out = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x (B, T, d)
        x = self.ffn1(x)
        x = x + self.attn(self.ln_attn(x))
        x = self.conv(x)
        return self.ln_out(self.ffn2(x))  # (B, T, d)


class ConvSubsampling(nn.Module):
    """The Conformer/ESPnet front-end: two 3x3 stride-2 convs with ReLU over
    (time, frequency), then a linear from channels x frequency/4 to the model width:
    4x fewer frames."""

    def __init__(self, d_in: int = 80, channels: int = 64, d: int = 144) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, 3, stride=2)
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=2)
        freq = ((d_in - 1) // 2 - 1) // 2
        self.proj = nn.Linear(channels * freq, d)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        # feats (B, T, 80)
        x = F.relu(self.conv1(feats.unsqueeze(1)))  # (B, C, T/2, 39)
        x = F.relu(self.conv2(x))  # (B, C, T/4, 19)
        b, c, t, f = x.shape
        return self.proj(x.transpose(1, 2).reshape(b, t, c * f))  # (B, T/4, d)


class SpeechEncoder(nn.Module):
    """Filter-bank frames -> conv subsampling -> 2 Conformer blocks -> linear to 32 tokens."""

    def __init__(self, d: int = 144, blocks: int = 2, d_out: int = 32) -> None:
        super().__init__()
        self.front = ConvSubsampling(d=d)
        self.blocks = nn.Sequential(*(ConformerBlock(d) for _ in range(blocks)))
        self.head = nn.Linear(d, d_out)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        # feats (B, T, 80) -> (B, T/4, 32)
        return self.head(self.blocks(self.front(feats)))


def _build_lstm(batch: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return LSTMStack(), (torch.randn(batch, 16, 80),)


def _build_conformer(batch: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    model = ConformerBlock()
    randomize_norm_stats(model)
    return model, (torch.randn(batch, 64, 144),)


def _build_encoder(batch: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    model = SpeechEncoder()
    randomize_norm_stats(model)
    return model, (torch.randn(batch, 128, 80),)


MODELS = [
    BenchModel(
        name="lstm",
        kind="speech",
        builder=_build_lstm,
        cpu_batch=1,
        gpu_batch=64,
        config="LSTM stack: 80 features -> 2 layers, hidden 256 -> linear 32; seq 16, batch 1",
    ),
    BenchModel(
        name="conformer",
        kind="speech",
        builder=_build_conformer,
        cpu_batch=1,
        gpu_batch=32,
        config="Conformer block (Conformer-S sizes): d 144, 4 heads, FFN 576, conv kernel 31, "
        "BatchNorm; seq 64, batch 1",
    ),
    BenchModel(
        name="speech_encoder",
        kind="speech",
        builder=_build_encoder,
        cpu_batch=1,
        gpu_batch=16,
        config="Speech encoder: conv subsampling (two 3x3 stride-2 convs, 64 channels) -> "
        "2 Conformer blocks (d 144, 4 heads, FFN 576, conv kernel 31) -> linear 32; "
        "128 frames of 80 features, batch 1",
    ),
]
