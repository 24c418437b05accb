"""Transformer building blocks written out in plain ops (no nn.MultiheadAttention,
no scaled_dot_product_attention), shared by the BERT, ViT and Conformer models."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class SelfAttention(nn.Module):
    """Multi-head self-attention: fused QKV projection, softmax(QK^T/sqrt(d))V, output projection."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        assert hidden % heads == 0
        self.heads = heads
        self.head_dim = hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape  # (B, T, C)
        qkv = self.qkv(x).view(b, t, 3, self.heads, self.head_dim)  # (B, T, 3, H, D)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, T, D)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)  # (B, H, T, T)
        attn = torch.softmax(scores, dim=-1)
        out = torch.matmul(attn, v)  # (B, H, T, D)
        return self.proj(out.transpose(1, 2).reshape(b, t, c))  # (B, T, C)


class FeedForward(nn.Module):
    """Linear -> GELU (erf) -> Linear."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, inner)
        self.fc2 = nn.Linear(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # (B, T, C)


class EncoderLayer(nn.Module):
    """A transformer encoder layer; ``pre_norm`` picks ViT-style (LN before each
    sub-block) or BERT-style (LN after each residual add)."""

    def __init__(self, hidden: int, heads: int, inner: int, pre_norm: bool, eps: float) -> None:
        super().__init__()
        self.pre_norm = pre_norm
        self.attn = SelfAttention(hidden, heads)
        self.ffn = FeedForward(hidden, inner)
        self.ln1 = nn.LayerNorm(hidden, eps=eps)
        self.ln2 = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x (B, T, C)
        if self.pre_norm:
            x = x + self.attn(self.ln1(x))
            return x + self.ffn(self.ln2(x))
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.ffn(x))
