"""The one factory for the tiny random-weight kiln ``Transformer``s the tests build, and
the small configs several test files share.

``tiny_transformer(cfg, seed, init, compression)`` seeds torch's global generator, builds
the model, redraws its weights by ``init``, optionally compresses it and returns it in eval
mode. The same arguments give the same weights on every call (and in every rank process),
and the global generator is left where the build leaves it, so a test drawing its inputs
with ``torch.randint`` after the build gets the same inputs as before.

Init styles (the weight distributions the tests rely on):

``"default"``
    The modules' own init (uniform linear weights, N(0, 1) embeddings, norms 1, biases
    0). For tests whose outcome does not depend on the values: bitwise identity after
    moving or offloading the weights, harness plumbing against a greedy reference.
``"varied"``
    Non-trivial norm weights (effective scale 1 + N(0, 0.3), whatever the config's
    ``norm_weight_offset``) and biases (N(0, 0.1)), since the default init leaves them 1
    and 0 and a kernel that drops or misapplies one would still match; embeddings
    N(0, (4 / sqrt(hidden))^2) so the activations are of order 1. For kernel-vs-eager
    comparisons (FastDecoder, speculative decoding).
``"normal"``
    Every parameter N(0, 0.3): logits spread widely, so the argmax is decided by the
    weights, with no near-ties that a reordered sum could flip. For generation-loop and
    sampling tests.
``"decisive"``
    Embeddings x0.05 and the blocks' matrices x3 of their default init, non-trivial
    block norms and biases: the blocks, not the input token, decide the argmax, and
    greedy decoding does not just repeat the last token. For the tensor-parallel runs,
    whose tokens must follow the single-process reference for many steps.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Literal

import torch

from kiln.compress import (
    Int4WeightOnly,
    Int8WeightOnly,
    LowRank,
    SemiStructured24,
    lowrank_,
    quantize_,
    sparsify_,
)
from kiln.compress.configs import CompressionConfig
from kiln.models.config import ModelConfig
from kiln.models.transformer import Transformer

Init = Literal["default", "varied", "normal", "decisive"]

# A tiny llama with grouped-query attention: 2 layers, hidden 32, 4 query / 2 kv heads.
TINY_LLAMA = ModelConfig(
    family="llama", vocab_size=97, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2,
    head_dim=8, intermediate_size=48, max_positions=64,
)  # fmt: skip

# The decode runtime's llama (GQA, hidden 64) and its variants over the features the C++
# step implements; shared by the FastDecoder, extend and speculative-decoding tests.
DECODE_LLAMA = ModelConfig(
    family="llama", vocab_size=101, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2,
    head_dim=16, intermediate_size=96, max_positions=256, rope_theta=10000.0,
)  # fmt: skip
DECODE_CONFIGS = {
    "llama_gqa": DECODE_LLAMA,
    # odd sizes: K tails of the fp32 kernel, more heads than kv heads x 3
    "odd_qkv_bias": replace(
        DECODE_LLAMA,
        hidden_size=44,
        head_dim=10,
        n_heads=6,
        n_kv_heads=2,
        intermediate_size=70,
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        tie_embeddings=False,
    ),  # fmt: skip
    "sliding_softcap_gelu": replace(
        DECODE_LLAMA,
        family="gemma2",
        n_layers=3,
        sliding_windows=(5, None, 3),
        attn_softcap=20.0,
        final_softcap=15.0,
        activation="gelu_tanh",
        sandwich_norms=True,
        norm_weight_offset=1.0,
        embed_scale=8.0,
        attn_scale=0.2,
        rope_local_theta=500.0,
        rope_scale=2.0,
        qk_norm=True,
    ),
    "gpt2_layernorm": replace(
        DECODE_LLAMA,
        family="gpt2",
        norm="layer",
        norm_bias=True,
        positions="learned",
        gated_mlp=False,
        activation="gelu",
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        n_kv_heads=4,
    ),
    "opt_relu": replace(
        DECODE_LLAMA,
        family="opt",
        norm="layer",
        norm_bias=True,
        positions="learned",
        learned_offset=2,
        gated_mlp=False,
        activation="relu",
        tie_embeddings=False,
    ),
}


def tiny_transformer(
    cfg: ModelConfig = TINY_LLAMA,
    seed: int = 0,
    init: Init = "default",
    compression: CompressionConfig | None = None,
    blocks_only: bool = False,
) -> Transformer:
    """A random-weight ``Transformer(cfg)`` drawn from ``seed`` with the ``init`` style
    (see the module docstring), compressed with ``compression`` (every supported linear,
    or only the blocks' with ``blocks_only``), in eval mode."""
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        _INITS[init](model, cfg)
    if compression is not None:
        _compress(model, compression, blocks_only)
    return model.eval()


def _default(model: Transformer, cfg: ModelConfig) -> None:
    pass


def _varied(model: Transformer, cfg: ModelConfig) -> None:
    for name, p in model.named_parameters():
        if "norm" in name and name.endswith("weight"):
            p.copy_(1.0 - cfg.norm_weight_offset + 0.3 * torch.randn_like(p))
        elif name.endswith("bias"):
            p.copy_(0.1 * torch.randn_like(p))
        elif "embed" in name:
            p.copy_(torch.randn_like(p) / math.sqrt(cfg.hidden_size) * 4)


def _normal(model: Transformer, cfg: ModelConfig) -> None:
    for p in model.parameters():
        p.normal_(0, 0.3)


def _decisive(model: Transformer, cfg: ModelConfig) -> None:
    model.embed.weight.mul_(0.05)
    for name, p in model.layers.named_parameters():
        if p.dim() == 2:
            p.mul_(3.0)
        elif name.endswith("norm.weight"):
            p.copy_(1.0 + 0.3 * torch.randn_like(p))
        elif name.endswith("bias"):
            p.copy_(0.1 * torch.randn_like(p))


_INITS = {"default": _default, "varied": _varied, "normal": _normal, "decisive": _decisive}


def _compress(model: Transformer, config: CompressionConfig, blocks_only: bool) -> None:
    def in_blocks(module: torch.nn.Module, name: str) -> bool:
        return name.startswith("layers.")

    filter_fn = in_blocks if blocks_only else None
    if isinstance(config, (Int8WeightOnly, Int4WeightOnly)):
        quantize_(model, config, filter_fn=filter_fn)
    elif isinstance(config, SemiStructured24):
        sparsify_(model, config, filter_fn=filter_fn)
    elif isinstance(config, LowRank):
        lowrank_(model, config, filter_fn=filter_fn)
    else:
        raise TypeError(f"no compression verb for {config!r}")
