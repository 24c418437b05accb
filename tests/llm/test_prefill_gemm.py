"""Long prompts through the packed prefill GEMM and causal SDPA give the old eager prefill's
logits: a random small model (INT4, INT8 and GGUF Q8_0 layers), prefilled by ``FastDecoder``
(eager: more than STEP_PREFILL_MAX rows) on this tree's path and on the old one
(``kiln.bench.prefill.force_old_path``: decode kernel / dequantize + F.linear, masked SDPA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln.bench.prefill import force_old_path
from kiln.compress import Int4WeightOnly, Int8WeightOnly
from kiln.compress.gguf_linear import GgufLinear
from kiln.compress.modules import CompressedLinear
from kiln.core.compare import compare
from kiln.kernels.cpu.gguf_blocks import TYPE_IDS
from kiln.llm.fast_decoder import STEP_PREFILL_MAX, FastDecoder
from kiln.models.transformer import Attention, Transformer, attention_mask
from tests.support.gguf_quants import quantize
from tests.support.models import DECODE_LLAMA, tiny_transformer


def _gguf_blocks_(model: Transformer) -> None:
    """Every block linear -> a GgufLinear of its weight quantized to Q8_0 (bias kept), exact
    (fp32 activations: the old path's arithmetic)."""
    for block in model.layers:
        for parent in (block.attn, block.mlp):
            for name, mod in list(parent.named_children()):
                if type(mod) is nn.Linear:
                    w = mod.weight.detach().numpy().astype(np.float32)
                    blocks = torch.from_numpy(quantize(w, TYPE_IDS["Q8_0"]))
                    setattr(
                        parent,
                        name,
                        GgufLinear(blocks, TYPE_IDS["Q8_0"], w.shape[1], mod.bias, "fp32"),
                    )


def _model(kind: str) -> Transformer:
    if kind == "gguf":
        model = tiny_transformer(DECODE_LLAMA, seed=5, init="varied")
        _gguf_blocks_(model)
        return model
    config = Int4WeightOnly(group_size=32, symmetric=False) if kind == "int4" else Int8WeightOnly()
    return tiny_transformer(DECODE_LLAMA, seed=5, init="varied", compression=config)


@pytest.mark.parametrize("kind", ["int4", "int8", "gguf"])
def test_prefill_matches_the_old_eager_path(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(kind)
    batch, t = 2, 24  # 48 rows > STEP_PREFILL_MAX: the eager model prefills
    assert batch * t > STEP_PREFILL_MAX
    tokens = torch.randint(
        0, DECODE_LLAMA.vocab_size, (batch, t), generator=torch.Generator().manual_seed(1)
    )
    new = FastDecoder(model, batch, 64, huge_pages=False).prefill(tokens)  # (B, 1, V)
    up = model.layers[0].mlp.up
    assert isinstance(up, CompressedLinear) and up._kernel is not None
    assert up._kernel.backend(batch * t) == "gemm"  # type: ignore[attr-defined]
    force_old_path(monkeypatch.setattr)
    for mod in model.modules():
        if isinstance(mod, CompressedLinear):
            mod._kernel = None  # rebuilt on the old path
    old = FastDecoder(model, batch, 64, huge_pages=False).prefill(tokens)
    assert up._kernel is not None and up._kernel.backend(batch * t) != "gemm"  # type: ignore[attr-defined]
    verdict = compare(new, old, 1e-5)
    assert verdict.ok, verdict.detail
    assert torch.equal(new.argmax(-1), old.argmax(-1))


def test_causal_attention_matches_the_mask() -> None:
    """From position 0 within the window: is_causal gives the explicit mask's values."""
    cfg = DECODE_LLAMA
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 9, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    positions = torch.arange(9)
    for window in (None, 9, 4):  # the last: the window cuts in, the mask serves
        attn = Attention(cfg, 0)
        attn.window = window
        mask = attention_mask(positions, 9, window)
        masked = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scale,
                                                enable_gqa=True)  # fmt: skip
        verdict = compare(attn._attend(q, k, v, positions), masked, 1e-6)
        assert verdict.ok, f"window {window}: {verdict.detail}"
