"""FastDecoder against the eager kiln Transformer on small random models.

Each case prefills a prompt, then decodes 16 greedy steps two ways on separate caches:
the eager model (the reference) and FastDecoder.step (one C++ call per step). Logits must
match within 1e-4 of their largest magnitude (fp32; the C++ step sums in another order
than torch) and the greedy tokens must be equal. Quantized models are compared against the
same quantized model run eagerly (its own kiln weight-only kernels).
"""

from __future__ import annotations

import copy
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
from kiln.models.kv_cache import KVCache
from kiln.models.transformer import Transformer
from tests.support.compare import assert_close_to_reference
from tests.support.models import DECODE_CONFIGS, DECODE_LLAMA, tiny_transformer

TOL = 1e-4  # relative to the largest |logit|: fp32 with a different summation order
# 16-bit models: as TOL, plus a cached key or value that lands on the other side of a
# rounding boundary (1 ulp of bf16: 2^-8) when the two sides' fp32 values differ slightly.
TOL_16BIT = 1e-3
STEPS = 16

pytestmark = pytest.mark.usefixtures("one_torch_thread")


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
        got = dec.prefill(prompt)  # every position, or (eager) the last one
        assert_close_to_reference(got, expected[:, -got.shape[1] :])
        tok = expected[:, -1].argmax(-1)
        for pos in range(prompt_len, max_len):
            ref = model(tok[:, None], pos, ref_cache)[:, 0]  # (B, V)
            got = dec.step(tok, pos)
            assert_close_to_reference(got, ref, rtol_to_max=tol)
            assert torch.equal(got.argmax(-1), ref.argmax(-1)), f"greedy token differs at {pos}"
            tok = ref.argmax(-1)
    assert_close_to_reference(dec.cache.keys[0], ref_cache.keys[0], rtol_to_max=tol)


@pytest.mark.parametrize("name", sorted(DECODE_CONFIGS))
@pytest.mark.parametrize("batch", [1, 3])
def test_fp32_matches_eager(name: str, batch: int) -> None:
    check_decode(tiny_transformer(DECODE_CONFIGS[name], init="varied"), batch)


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


@pytest.mark.parametrize("name", sorted(DECODE_CONFIGS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16bit_matches_upcast_eager(name: str, dtype: torch.dtype) -> None:
    check_decode_16bit(tiny_transformer(DECODE_CONFIGS[name], init="varied").to(dtype), batch=2)


@pytest.mark.parametrize(
    "config", [Int8WeightOnly(), Int4WeightOnly(group_size=32)], ids=["int8", "int4-g32"]
)
def test_quantized_layers_in_a_bf16_model(config: Int8WeightOnly | Int4WeightOnly) -> None:
    model = tiny_transformer(replace(DECODE_LLAMA, intermediate_size=128), init="varied").to(
        torch.bfloat16
    )
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
    model = tiny_transformer(DECODE_LLAMA, init="varied").to(torch.bfloat16)
    prompt = torch.randint(0, DECODE_LLAMA.vocab_size, (1, 6))
    dec = FastDecoder(model, 1, 12)
    ref_cache = model.new_cache(1, 12)
    with torch.no_grad():
        prefill = dec.prefill(prompt)  # eager: its linears in fp32 (kiln.llm.upcast)
        native = model(prompt, 0, ref_cache)
        last = native[:, -prefill.shape[1] :]  # an eager prefill returns the last position
        assert_close_to_reference(prefill.float(), last.float(), rtol_to_max=0.05)
        tok = prefill[:, -1].argmax(-1)
        for pos in range(6, 12):
            got, ref = dec.step(tok, pos), model(tok[:, None], pos, ref_cache)[:, 0].float()
            assert_close_to_reference(got, ref, rtol_to_max=0.05)
            tok = ref.argmax(-1)


def test_batch_8_and_window_wraps_prompt() -> None:
    cfg = replace(DECODE_LLAMA, sliding_windows=(4, 7))
    check_decode(tiny_transformer(cfg, init="varied"), batch=8, prompt_len=9)


@pytest.mark.parametrize(
    "config", [Int8WeightOnly(), Int4WeightOnly(group_size=32)], ids=["int8", "int4-g32"]
)
@pytest.mark.parametrize("name", ["llama_gqa", "gpt2_layernorm"])
def test_quantized_matches_eager(config: Int8WeightOnly | Int4WeightOnly, name: str) -> None:
    cfg = replace(DECODE_CONFIGS[name], intermediate_size=128)  # INT4 needs K % 32 == 0
    model = tiny_transformer(cfg, init="varied")
    assert quantize_(model, config)
    check_decode(model, batch=2)


def test_quantized_untied_head() -> None:
    model = tiny_transformer(DECODE_LLAMA, init="varied")
    quantize_(model, Int4WeightOnly(group_size=32))
    quantize_head_(model, Int8WeightOnly())
    assert isinstance(model.lm_head, Int8Linear)  # untied: the embedding stays fp32
    check_decode(model, batch=1)


@pytest.mark.parametrize("quantized", [False, True])
def test_threads_give_identical_steps(quantized: bool) -> None:
    """Every output is computed whole by one thread (a helper's, or thread 0 taking an item
    back): 2 and 3 threads give the 1-thread step bit for bit."""
    model = tiny_transformer(
        replace(DECODE_LLAMA, intermediate_size=128, n_layers=3), init="varied"
    )
    if quantized:
        quantize_(model, Int4WeightOnly(group_size=32))
    prompt = torch.randint(0, DECODE_LLAMA.vocab_size, (3, 4))
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
    model = tiny_transformer(DECODE_LLAMA, init="varied")
    dec = FastDecoder(model, 1, 12)
    ref_cache = model.new_cache(1, 12)
    tokens = torch.randint(0, DECODE_LLAMA.vocab_size, (1, 10))
    with torch.no_grad():
        expected = model(tokens, 0, ref_cache)
        dec.prefill(tokens[:, :4])
        for pos in range(4, 8):
            dec.step(tokens[:, pos], pos)
        got = dec.prefill(tokens[:, 8:], start=8)  # eager, on the cache the steps filled
    assert got.shape[1] == 1  # the last position only
    assert_close_to_reference(got, expected[:, -1:], rtol_to_max=TOL)


@pytest.mark.parametrize("kind", ["2:4", "lowrank", "float64"])
def test_unsupported_models_raise(kind: str) -> None:
    model = tiny_transformer(DECODE_LLAMA, init="varied")
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
    dec = FastDecoder(tiny_transformer(DECODE_LLAMA, init="varied"), 2, 8)
    with pytest.raises(ValueError, match="outside the cache"):
        dec.step(torch.tensor([1, 2]), 8)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        dec.step(torch.tensor([1, DECODE_LLAMA.vocab_size]), 0)
    with pytest.raises(ValueError, match=r"\(2,\)"):
        dec.step(torch.tensor([1]), 0)
