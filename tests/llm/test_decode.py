"""FastDecoder against the eager kiln Transformer on small random models.

Each case prefills a prompt, then decodes 16 greedy steps two ways on separate caches:
the eager model (the reference) and FastDecoder.step (one C++ call per step). Logits must
match within 1e-4 of their largest magnitude (fp32; the C++ step sums in another order
than torch) and the greedy tokens must be equal. Quantized models are compared against the
same quantized model run eagerly (its own kiln weight-only kernels).
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch
from torch import Tensor

from kiln.compress import (
    Int4WeightOnly,
    Int8Linear,
    Int8WeightOnly,
    LowRank,
    lowrank_,
    quantize_,
    sparsify_,
)
from kiln.compress.configs import SemiStructured24
from kiln.llm import fast_decoder as decode_runtime
from kiln.llm.fast_decoder import DecodeUnsupported, FastDecoder, quantize_head_
from kiln.models.config import ModelConfig
from kiln.models.kv_cache import KVCache
from kiln.models.transformer import Transformer
from tests.helpers import assert_close_to_reference

TOL = 1e-4  # relative to the largest |logit|: fp32 with a different summation order
# 16-bit models: as TOL, plus a cached key or value that lands on the other side of a
# rounding boundary (1 ulp of bf16: 2^-8) when the two sides' fp32 values differ slightly.
TOL_16BIT = 1e-3
STEPS = 16

LLAMA = ModelConfig(
    family="llama", vocab_size=101, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2,
    head_dim=16, intermediate_size=96, max_positions=256, rope_theta=10000.0,
)  # fmt: skip
CONFIGS = {
    "llama_gqa": LLAMA,
    # odd sizes: K tails of the fp32 kernel, more heads than kv heads x 3
    "odd_qkv_bias": replace(
        LLAMA,
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
        LLAMA,
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
        LLAMA,
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
        LLAMA,
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


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """Random weights with non-trivial norms and biases (default init leaves them 1 / 0)."""
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 - cfg.norm_weight_offset + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "embed" in name:
                p.copy_(torch.randn_like(p) / math.sqrt(cfg.hidden_size) * 4)
    return model


def decode_case(
    model: Transformer, ref: Transformer, batch: int, prompt_len: int
) -> tuple[Tensor, FastDecoder, KVCache, int]:
    """A seeded prompt (B, T), a FastDecoder of ``model`` and an empty cache of ``ref``
    for T + STEPS positions."""
    torch.manual_seed(1)
    max_len = prompt_len + STEPS
    prompt = torch.randint(0, model.cfg.vocab_size, (batch, prompt_len))
    return prompt, FastDecoder(model, batch, max_len), ref.new_cache(batch, max_len), max_len


def check_decode(model: Transformer, batch: int, prompt_len: int = 5, tol: float = TOL) -> None:
    """Prefill + STEPS greedy steps: FastDecoder vs the eager model on its own cache."""
    prompt, dec, ref_cache, max_len = decode_case(model, model, batch, prompt_len)
    with torch.no_grad():
        expected = model(prompt, 0, ref_cache)
        assert_close_to_reference(dec.prefill(prompt), expected)
        tok = expected[:, -1].argmax(-1)
        for pos in range(prompt_len, max_len):
            ref = model(tok[:, None], pos, ref_cache)[:, 0]  # (B, V)
            got = dec.step(tok, pos)
            assert_close_to_reference(got, ref, rtol_to_max=tol)
            assert torch.equal(got.argmax(-1), ref.argmax(-1)), f"greedy token differs at {pos}"
            tok = ref.argmax(-1)
    assert_close_to_reference(dec.cache.keys[0], ref_cache.keys[0], rtol_to_max=tol)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("batch", [1, 3])
def test_fp32_matches_eager(name: str, batch: int) -> None:
    check_decode(make_model(CONFIGS[name]), batch)


def round_cache_(cache: KVCache, dtype: torch.dtype) -> None:
    """Round an fp32 cache's contents to ``dtype``'s values, in place."""
    for t in [*cache.keys.values(), *cache.values.values()]:
        t.copy_(t.to(dtype).float())


def check_decode_16bit(model: Transformer, batch: int, prompt_len: int = 5) -> None:
    """A bf16 / fp16 model's fast steps (fp32 math on the 16-bit weights, a 16-bit cache)
    against the eager model upcast to fp32 whose cache is rounded to the 16-bit dtype after
    every step: the same numbers computed independently. Both start from the reference's
    prefill (the 16-bit eager prefill rounds every activation: not the same numbers)."""
    dtype = next(model.parameters()).dtype
    ref = copy.deepcopy(model)
    for p in ref.parameters():  # parameters only: compressed layers' buffers keep their dtypes
        p.data = p.data.float()
    prompt, dec, ref_cache, max_len = decode_case(model, ref, batch, prompt_len)
    with torch.no_grad():
        tok = ref(prompt, 0, ref_cache)[:, -1].argmax(-1)
        round_cache_(ref_cache, dtype)
        for i in ref_cache.keys:
            dec.cache.keys[i].copy_(ref_cache.keys[i])
            dec.cache.values[i].copy_(ref_cache.values[i])
        for pos in range(prompt_len, max_len):
            expected = ref(tok[:, None], pos, ref_cache)[:, 0]  # (B, V)
            round_cache_(ref_cache, dtype)
            got = dec.step(tok, pos)
            assert_close_to_reference(got, expected, rtol_to_max=TOL_16BIT)
            assert torch.equal(got.argmax(-1), expected.argmax(-1)), f"greedy token at {pos}"
            tok = expected.argmax(-1)
    # The cache the steps wrote: mostly the same 16-bit values; where the fp32 inputs of a
    # rounding differ slightly (1e-6 in layer 0, ~1e-4 relative after a cached value one
    # ulp apart), a value rounds the other way: at most one ulp of the cache's largest entry.
    eps = torch.finfo(dtype).eps
    for got_c, ref_c in [(dec.cache.keys, ref_cache.keys), (dec.cache.values, ref_cache.values)]:
        for i in ref_c:
            assert got_c[i].dtype == dtype
            assert_close_to_reference(got_c[i].float(), ref_c[i], rtol_to_max=eps)
            assert (got_c[i].float() == ref_c[i]).float().mean().item() > 0.9


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16bit_matches_upcast_eager(name: str, dtype: torch.dtype) -> None:
    check_decode_16bit(make_model(CONFIGS[name]).to(dtype), batch=2)


@pytest.mark.parametrize(
    "config", [Int8WeightOnly(), Int4WeightOnly(group_size=32)], ids=["int8", "int4-g32"]
)
def test_quantized_layers_in_a_bf16_model(config: Int8WeightOnly | Int4WeightOnly) -> None:
    model = make_model(replace(LLAMA, intermediate_size=128)).to(torch.bfloat16)
    assert quantize_(model, config)
    check_decode_16bit(model, batch=2)


@pytest.mark.parametrize("eager_prefill", [True, False])
def test_bf16_fast_steps_follow_bf16_prefill(
    eager_prefill: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end on the bf16 model alone (its prefill, eager or by C++ steps, then fast
    steps): the 16-bit cache written by eager torch is read back by the C++ step; the logits
    stay within bf16 arithmetic of the eager bf16 steps."""
    if eager_prefill:
        monkeypatch.setattr(decode_runtime, "STEP_PREFILL_MAX", 0)
    model = make_model(LLAMA).to(torch.bfloat16)
    prompt = torch.randint(0, LLAMA.vocab_size, (1, 6))
    dec = FastDecoder(model, 1, 12)
    ref_cache = model.new_cache(1, 12)
    with torch.no_grad():
        prefill = dec.prefill(prompt)  # eager: its linears in fp32 (kiln.llm.upcast)
        native = model(prompt, 0, ref_cache)
        assert_close_to_reference(prefill.float(), native.float(), rtol_to_max=0.05)
        tok = prefill[:, -1].argmax(-1)
        for pos in range(6, 12):
            got, ref = dec.step(tok, pos), model(tok[:, None], pos, ref_cache)[:, 0].float()
            assert_close_to_reference(got, ref, rtol_to_max=0.05)
            tok = ref.argmax(-1)


def test_batch_8_and_window_wraps_prompt() -> None:
    cfg = replace(LLAMA, sliding_windows=(4, 7))
    check_decode(make_model(cfg), batch=8, prompt_len=9)


@pytest.mark.parametrize(
    "config", [Int8WeightOnly(), Int4WeightOnly(group_size=32)], ids=["int8", "int4-g32"]
)
@pytest.mark.parametrize("name", ["llama_gqa", "gpt2_layernorm"])
def test_quantized_matches_eager(config: Int8WeightOnly | Int4WeightOnly, name: str) -> None:
    cfg = replace(CONFIGS[name], intermediate_size=128)  # INT4 needs K % 32 == 0
    model = make_model(cfg)
    assert quantize_(model, config)
    check_decode(model, batch=2)


def test_quantized_untied_head() -> None:
    model = make_model(LLAMA)
    quantize_(model, Int4WeightOnly(group_size=32))
    quantize_head_(model, Int8WeightOnly())
    assert isinstance(model.lm_head, Int8Linear)  # untied: the embedding stays fp32
    check_decode(model, batch=1)


@pytest.mark.parametrize("quantized", [False, True])
def test_threads_give_identical_steps(quantized: bool) -> None:
    """Every output is computed whole by one thread (a helper's, or thread 0 taking an item
    back): 2 and 3 threads give the 1-thread step bit for bit."""
    model = make_model(replace(LLAMA, intermediate_size=128, n_layers=3))
    if quantized:
        quantize_(model, Int4WeightOnly(group_size=32))
    prompt = torch.randint(0, LLAMA.vocab_size, (3, 4))
    runs = []
    for threads in (1, 2, 3):
        dec = FastDecoder(model, 3, 24, threads=threads)
        dec.prefill(prompt)
        tok, out = prompt[:, -1], []
        for pos in range(4, 24):
            out.append(dec.step(tok, pos))
            tok = out[-1].argmax(-1)
        runs.append(torch.stack(out))
    assert torch.equal(runs[1], runs[0]) and torch.equal(runs[2], runs[0])


def test_fast_and_eager_steps_mix(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decoder's cache is the model's KVCache: an eager step can follow fast ones."""
    monkeypatch.setattr(decode_runtime, "STEP_PREFILL_MAX", 0)  # every prefill eager
    model = make_model(LLAMA)
    dec = FastDecoder(model, 1, 12)
    ref_cache = model.new_cache(1, 12)
    tokens = torch.randint(0, LLAMA.vocab_size, (1, 10))
    with torch.no_grad():
        expected = model(tokens, 0, ref_cache)
        dec.prefill(tokens[:, :4])
        for pos in range(4, 8):
            dec.step(tokens[:, pos], pos)
        got = dec.prefill(tokens[:, 8:], start=8)  # eager, on the cache the steps filled
    assert_close_to_reference(got, expected[:, 8:], rtol_to_max=TOL)


@pytest.mark.parametrize("kind", ["2:4", "lowrank", "float64"])
def test_unsupported_models_raise(kind: str) -> None:
    model = make_model(LLAMA)
    if kind == "2:4":
        sparsify_(model, SemiStructured24())
        match = "Sparse24Linear"
    elif kind == "lowrank":
        lowrank_(model, LowRank(rank=2))
        match = "LowRankLinear"
    else:
        model = model.to(torch.float64)
        match = "float64"
    with pytest.raises(DecodeUnsupported, match=match):
        FastDecoder(model, 1, 8)


def test_bad_inputs_raise() -> None:
    dec = FastDecoder(make_model(LLAMA), 2, 8)
    with pytest.raises(ValueError, match="outside the cache"):
        dec.step(torch.tensor([1, 2]), 8)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        dec.step(torch.tensor([1, LLAMA.vocab_size]), 0)
    with pytest.raises(ValueError, match=r"\(2,\)"):
        dec.step(torch.tensor([1]), 0)
