"""Small modules exercising the capture lowerings (random weights)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class MLP(nn.Module):
    """Linear -> GELU (exact) -> Linear -> GELU (tanh) -> Linear -> SiLU."""

    def __init__(self, d_in: int = 12, d_hidden: int = 32, d_out: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.fc3 = nn.Linear(d_hidden, d_out)

    def forward(self, x: Tensor) -> Tensor:  # (B, d_in) -> (B, d_out)
        h = F.gelu(self.fc1(x))
        h = F.gelu(self.fc2(h), approximate="tanh")
        return F.silu(self.fc3(h))


class RMSNorm(nn.Module):
    """RMSNorm written out with pow/mean/rsqrt."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:  # (B, T, D)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w


class Attention(nn.Module):
    """Multi-head self-attention with explicit head views and 4-D matmuls."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, D)
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.norm(x)).split(d, dim=-1)  # 3 x (B, T, D)
        q = q.view(b, t, h, d // h).transpose(1, 2)  # (B, H, T, Dh)
        k = k.view(b, t, h, d // h).transpose(1, 2)
        v = v.view(b, t, h, d // h).transpose(1, 2)
        att = torch.softmax(q @ k.transpose(-2, -1) * (d // h) ** -0.5, dim=-1)  # (B, H, T, T)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return x + self.proj(y)


class ConvBNReLU(nn.Module):
    """Conv2d -> BatchNorm2d (eval) -> ReLU -> depthwise Conv2d -> BN -> ReLU6."""

    def __init__(self, c_in: int = 3, c: int = 8) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.dw = nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.bn2 = nn.BatchNorm2d(c)
        for bn in (self.bn, self.bn2):  # non-trivial running statistics
            assert bn.running_mean is not None and bn.running_var is not None
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
            nn.init.uniform_(bn.weight, 0.5, 1.5)
            nn.init.uniform_(bn.bias, -0.5, 0.5)

    def forward(self, x: Tensor) -> Tensor:  # (N, C_in, H, W) -> (N, C, H, W)
        x = F.relu(self.bn(self.conv(x)))
        return F.relu6(self.bn2(self.dw(x)))


class Norms(nn.Module):
    """InstanceNorm2d (affine) and GroupNorm after a 1x1 conv."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 1)
        self.inorm = nn.InstanceNorm2d(c, affine=True)
        self.gnorm = nn.GroupNorm(2, c)
        nn.init.uniform_(self.inorm.weight, 0.5, 1.5)
        nn.init.uniform_(self.inorm.bias, -0.5, 0.5)

    def forward(self, x: Tensor) -> Tensor:  # (N, C, H, W)
        return self.gnorm(self.inorm(self.conv(x)))


class LSTMModel(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16, num_layers=layers, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, 8) -> (B, T, 4)
        y, _ = self.lstm(x)
        return self.head(y)


class EmbedMean(nn.Module):
    """Embedding lookup (opaque) + mean pooling + log_softmax head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.head = nn.Linear(16, 5)

    def forward(self, idx: Tensor) -> Tensor:  # (B, T) int64 -> (B, 5)
        return F.log_softmax(self.head(self.emb(idx).mean(1)), dim=-1)


class Structured(nn.Module):
    """Returns a nested dict/tuple of outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: Tensor, y: Tensor) -> dict[str, object]:
        h = self.fc(x)
        return {"sum": h + y, "pair": (h.relu(), torch.sigmoid(y)), "max": h.amax(-1)}


class CNNHead(nn.Module):
    """Pooling: non-overlapping max pool, overlapping max pool, avg pool (``pool2d``
    each), adaptive avg pool to (1, 1), constant padding (a cat)."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3)
        self.fc = nn.Linear(c, 3)

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:  # (N, C, 10, 10)
        a = F.max_pool2d(x, 2)  # (N, C, 5, 5)
        b = F.max_pool2d(x, 3, stride=1)  # overlapping windows
        c = F.avg_pool2d(x, 2)
        d = F.pad(x, (1, 1, 1, 1))
        e = F.adaptive_avg_pool2d(self.conv(x), (1, 1)).flatten(1)  # (N, C)
        return a, b, c, d, self.fc(e)


class Pointwise(nn.Module):
    """A grab bag of elementwise ops, comparisons, masks and activations."""

    def forward(self, x: Tensor, y: Tensor) -> tuple[Tensor, ...]:  # (4, 6) each
        a = x.clamp(-0.5, 0.5) + F.hardtanh(y) + x.clamp_min(0.1) + y.clamp(max=0.2)
        b = torch.where(x > y, x.abs().sqrt(), torch.exp(y)) - 2.0 * x.pow(3)
        c = (x.abs() + 1).log() / (y.abs() + 1).rsqrt() + torch.reciprocal(y.abs() + 0.5)
        d = torch.maximum(x, y) * torch.minimum(x, y) + x.pow(0.5 + 0 * 1).nan_to_num(0.0)
        m = (x > 0) & (y <= 0) | (x == y) | ~(y != 0.25)
        e = x.masked_fill(m, -1.0) + torch.erf(y) + torch.tanh(x) * torch.sin(y) - torch.cos(x)
        f = F.leaky_relu(x, 0.1) + F.elu(y) + F.hardswish(x) + F.softplus(y) + torch.sigmoid(-x)
        g = x.pow(y.abs()) + 2.0**y + (x - y * 3).floor() + torch.div(x, 0.3, rounding_mode="floor")
        return a, b, c, d, e, f, g, m


class Layouts(nn.Module):
    """Views, permutes, slices, select, cat, split/chunk/unbind, expand, repeat."""

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:  # (2, 6, 8)
        a = x.view(2, 48).view(12, 8).view(2, 6, 8) * 2  # collapses to nothing
        b = x[:, 1:5:2, 0] + x[:, -1, ::3].sum(-1, keepdim=True)
        p, q = x.chunk(2, dim=-1)
        c = torch.cat([q, p, x.transpose(1, 2).contiguous().view(2, 6, 8)], dim=-1)
        d = sum(x.unbind(1)) + x.unsqueeze(1).squeeze(1).mean(1)
        e = (
            x[:, :1].expand(2, 6, 8)
            + x.repeat(1, 1, 2)[..., 4:12]
            + x.permute(0, 2, 1).permute(0, 2, 1)
        )
        return a, b, c, d, e
