"""A GPT-2-small-style decoder, one decode step with the KV cache passed in."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kiln.bench.suite._base import BenchModel, randomize_norm_stats

LAYERS, HIDDEN, HEADS, VOCAB, PAST = 4, 256, 4, 8192, 127


class DecoderLayer(nn.Module):
    """Pre-LN GPT-2 block for a single new token attending to its cache."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.ln1 = nn.LayerNorm(hidden)
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.c_proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.proj = nn.Linear(4 * hidden, hidden)

    def forward(
        self, x: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # x (B, 1, C); past_k, past_v (B, H, P, D)
        b = x.shape[0]
        qkv = self.c_attn(self.ln1(x)).view(b, 1, 3, self.heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, 1, D)
        keys = torch.cat([past_k, k], dim=2)  # (B, H, P+1, D)
        values = torch.cat([past_v, v], dim=2)  # (B, H, P+1, D)
        scores = torch.matmul(q, keys.transpose(-1, -2)) / math.sqrt(self.head_dim)  # (B,H,1,P+1)
        out = torch.matmul(torch.softmax(scores, dim=-1), values)  # (B, H, 1, D)
        x = x + self.c_proj(out.transpose(1, 2).reshape(b, 1, -1))  # (B, 1, C)
        x = x + self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))
        return x, k, v


class GPT2Decode(nn.Module):
    """Token + position embedding of one new token, ``layers`` decoder blocks,
    final LayerNorm, logits through the tied embedding.

    Inputs: ids (B, 1) int64, past_k and past_v (L, B, H, P, D) for P earlier
    positions. Outputs: logits (B, V) and the new token's keys and values
    (L, B, H, 1, D), which the caller appends to its cache.
    """

    def __init__(self, vocab: int = VOCAB, hidden: int = HIDDEN, layers: int = LAYERS) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(1024, hidden)
        self.blocks = nn.ModuleList(DecoderLayer(hidden, HEADS) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)

    def forward(
        self, ids: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # ids (B, 1); past_k, past_v (L, B, H, P, D)
        pos = past_k.shape[3]  # the new token's position (static)
        x = self.wte(ids) + self.wpe.weight[pos]  # (B, 1, C)
        new_k, new_v = [], []
        for i, block in enumerate(self.blocks):
            x, k, v = block(x, past_k[i], past_v[i])
            new_k.append(k)
            new_v.append(v)
        logits = torch.matmul(self.ln_f(x[:, 0]), self.wte.weight.t())  # (B, V)
        return logits, torch.stack(new_k), torch.stack(new_v)  # (B,V), 2 x (L,B,H,1,D)


def _build(batch: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    model = GPT2Decode()
    nn.init.normal_(model.wte.weight, std=0.02)  # GPT-2's init keeps the tied logits O(1)
    nn.init.normal_(model.wpe.weight, std=0.01)
    randomize_norm_stats(model)
    cache = (LAYERS, batch, HEADS, PAST, HIDDEN // HEADS)
    ids = torch.randint(0, VOCAB, (batch, 1), dtype=torch.int64)
    return model, (ids, torch.randn(cache), torch.randn(cache))


MODELS = [
    BenchModel(
        name="gpt2_decode",
        kind="transformer",
        builder=_build,
        cpu_batch=1,
        gpu_batch=32,
        config=f"GPT-2-style decode step: {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads, "
        f"vocab {VOCAB} (tied head), KV cache of {PAST} positions as inputs; batch 1",
    )
]
