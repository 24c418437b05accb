"""FastDecoder.extend: T positions per sequence in one C++ call, against the eager model.

extend is how a speculative verifier scores a draft: every row (sequence, position) writes
its key and value, then attends causally to the cache and to the rows before it. Each case
prefills a prompt, then feeds the rest of a random continuation in chunks of varied length
(1 to max_chunk) through extend, and the same chunks through the eager model on its own
cache: logits within TOL of their largest magnitude, greedy tokens and caches equal.
"""

from __future__ import annotations

import pytest
import torch

from kiln.compress import Int4WeightOnly, quantize_
from kiln.llm.fast_decoder import STEP_PREFILL_MAX, FastDecoder
from kiln.models.transformer import Transformer
from tests.llm.test_decode import TOL
from tests.support.compare import assert_close_to_reference
from tests.support.models import DECODE_CONFIGS, DECODE_LLAMA, tiny_transformer

CHUNKS = (3, 1, 4, 2, 5)  # 15 positions after a 4-token prompt


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def check_extend(
    model: Transformer, batch: int, threads: int | None = None, chunks: tuple[int, ...] = CHUNKS
) -> None:
    prompt_len = 4
    max_len = prompt_len + sum(chunks)
    torch.manual_seed(2)
    tokens = torch.randint(0, model.cfg.vocab_size, (batch, max_len))  # (B, S)
    dec = FastDecoder(model, batch, max_len, threads=threads, max_chunk=max(chunks))
    ref_cache = model.new_cache(batch, max_len)
    with torch.no_grad():
        model(tokens[:, :prompt_len], 0, ref_cache)
        dec.prefill(tokens[:, :prompt_len])
        pos = prompt_len
        for t in chunks:
            chunk = tokens[:, pos : pos + t]  # (B, t)
            ref = model(chunk, pos, ref_cache)  # (B, t, V)
            got = dec.extend(chunk, pos)
            assert got.shape == ref.shape
            assert_close_to_reference(got, ref, rtol_to_max=TOL)
            assert torch.equal(got.argmax(-1), ref.argmax(-1)), f"greedy differs at {pos}"
            pos += t
    for i in range(model.cfg.n_layers):
        assert_close_to_reference(dec.cache.keys[i], ref_cache.keys[i], rtol_to_max=TOL)
        assert_close_to_reference(dec.cache.values[i], ref_cache.values[i], rtol_to_max=TOL)


@pytest.mark.parametrize("name", sorted(DECODE_CONFIGS))
@pytest.mark.parametrize("batch", [1, 2])
def test_extend_matches_eager(name: str, batch: int) -> None:
    """Every config family: rotary / learned positions, sliding windows shorter than a
    chunk (gemma2-style: windows 5 and 3), soft-caps, biases, GQA."""
    check_extend(tiny_transformer(DECODE_CONFIGS[name], init="varied"), batch)


def test_extend_int4_two_threads() -> None:
    model = tiny_transformer(DECODE_LLAMA, init="varied")
    quantize_(model, Int4WeightOnly(group_size=32))
    check_extend(model, 1, threads=2)


def test_extend_many_rows_two_threads() -> None:
    """4 sequences x 8 positions x 4 heads = 128 attention pairs: more than one task
    takes as items, so an item runs several pairs (and a helper commits them at once)."""
    check_extend(tiny_transformer(DECODE_LLAMA, init="varied"), 4, threads=2, chunks=(8, 8))


def test_extend_of_one_is_a_step() -> None:
    """step(tok, pos) is extend(tok[:, None], pos): the same call, bit for bit."""
    model = tiny_transformer(DECODE_LLAMA, init="varied")
    a, b = FastDecoder(model, 2, 8), FastDecoder(model, 2, 8)
    tok = torch.tensor([3, 7])
    assert torch.equal(a.step(tok, 0), b.extend(tok[:, None], 0)[:, 0])


def test_extend_bad_inputs_raise() -> None:
    dec = FastDecoder(tiny_transformer(DECODE_LLAMA, init="varied"), 1, 8, max_chunk=4)
    with pytest.raises(ValueError, match="1..4"):
        dec.extend(torch.zeros(1, 5, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="outside the cache"):
        dec.extend(torch.zeros(1, 3, dtype=torch.long), 6)
    with pytest.raises(ValueError, match=r"\(1, T\)"):
        dec.extend(torch.zeros(2, 3, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="max_chunk"):
        FastDecoder(tiny_transformer(DECODE_LLAMA, init="varied"), 1, 8, max_chunk=0)


@pytest.mark.parametrize("n", [STEP_PREFILL_MAX // 2, STEP_PREFILL_MAX // 2 + 1])
def test_prefill_by_steps_up_to_the_limit(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts of up to STEP_PREFILL_MAX rows (here 2 sequences x n tokens) prefill by
    extend, max_chunk rows (4 positions) a call; longer ones by the eager model; both give
    the eager model's logits."""
    model = tiny_transformer(DECODE_LLAMA, init="varied")
    tokens = torch.randint(0, DECODE_LLAMA.vocab_size, (2, n))
    dec = FastDecoder(model, 2, n + 1)
    calls: list[int] = []
    extend = dec.extend

    def counted(t: torch.Tensor, pos: int) -> torch.Tensor:
        calls.append(t.shape[1])
        return extend(t, pos)

    monkeypatch.setattr(dec, "extend", counted)
    with torch.no_grad():
        got = dec.prefill(tokens)
        ref = model(tokens, 0, model.new_cache(2, n + 1))
    assert got.shape[1] == (n if 2 * n <= STEP_PREFILL_MAX else 1)  # eager: the last only
    assert_close_to_reference(got, ref[:, -got.shape[1] :], rtol_to_max=TOL)
    expected = [4] * (n // 4) + ([n % 4] if n % 4 else [])
    assert calls == (expected if 2 * n <= STEP_PREFILL_MAX else [])
