"""Small random-weight kiln Transformers, picklable factories for ranks, and the
single-process greedy reference every parallel run is compared with."""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from kiln.compress import Int4WeightOnly, Int8WeightOnly
from kiln.models.config import ModelConfig
from kiln.models.transformer import Transformer
from tests.support.models import tiny_transformer

# Llama-like: 4 layers, hidden 64, 4 query / 2 kv heads.
LLAMA = ModelConfig(
    family="llama", vocab_size=256, hidden_size=64, n_layers=4, n_heads=4, n_kv_heads=2,
    head_dim=16, intermediate_size=128, max_positions=64,
)  # fmt: skip
# SmolLM2's head layout (9 query / 3 kv heads: uneven over 2 ranks), with every bias on so
# the row-parallel bias is checked to be added exactly once.
UNEVEN = ModelConfig(
    family="qwen2", vocab_size=256, hidden_size=64, n_layers=3, n_heads=9, n_kv_heads=3,
    head_dim=16, intermediate_size=96, max_positions=64, qkv_bias=True, o_bias=True,
    mlp_bias=True, tie_embeddings=False,
)  # fmt: skip
# One kv head for 4 query heads: fewer kv heads than ranks, so it is replicated.
MQA = ModelConfig(
    family="llama", vocab_size=256, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=1,
    head_dim=16, intermediate_size=128, max_positions=64,
)  # fmt: skip

Compression = Int8WeightOnly | Int4WeightOnly | None


def build(cfg: ModelConfig, seed: int, compression: Compression = None) -> Transformer:
    """The same random model on every call (and every rank) for the same arguments: the
    "decisive" init (the blocks, not the input token, decide the next token, and greedy
    decoding does not just repeat)."""
    return tiny_transformer(cfg, seed, init="decisive", compression=compression)


def factory(
    cfg: ModelConfig, seed: int = 0, compression: Compression = None
) -> partial[Transformer]:
    return partial(build, cfg, seed, compression)


def prompts(batch: int, length: int, vocab: int, seed: int = 1) -> Tensor:
    """(B, T) random token ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g)


@torch.no_grad()
def greedy_reference(model: Transformer, prompt: Tensor, new: int) -> tuple[Tensor, Tensor]:
    """One process, the unsharded model: tokens (B, T + new) and logits (B, new, V)."""
    b, t = prompt.shape
    cache = model.new_cache(b, t + new)
    tokens, steps = prompt, []
    logits = model(prompt, 0, cache)[:, -1]  # (B, V)
    for i in range(new):
        steps.append(logits)
        nxt = logits.argmax(-1, keepdim=True)  # (B, 1)
        tokens = torch.cat((tokens, nxt), dim=1)
        if i < new - 1:
            logits = model(nxt, t + i, cache)[:, -1]
    return tokens, torch.stack(steps, dim=1)
