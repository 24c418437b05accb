"""Generation loop and sampling, against recomputing the whole sequence without a cache."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kiln.llm.generate import (
    EagerDecoder,
    MultiTokenDecoder,
    Sampler,
    Sampling,
    SpeculativeStats,
    choose,
    generate,
)
from kiln.models.transformer import Transformer
from tests.support.compare import assert_close_to_reference
from tests.support.models import TINY_LLAMA, tiny_transformer

CFG = replace(TINY_LLAMA, sliding_windows=(None, 5))


def tiny_model(seed: int = 0) -> Transformer:
    """Every parameter N(0, 0.3): large enough that the argmax is decided by the weights."""
    return tiny_transformer(CFG, seed, init="normal")


@torch.inference_mode()
def full_logits(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """Logits of the whole sequence in one pass through a fresh cache (no decode steps)."""
    return model(tokens, 0, model.new_cache(tokens.shape[0], tokens.shape[1]))


def test_greedy_matches_recomputing_the_sequence() -> None:
    model = tiny_model()
    prompt = torch.randint(0, 97, (2, 6))
    gen = generate(EagerDecoder(model, 2, 32), prompt, max_new_tokens=12)
    seq = prompt
    for _ in range(12):  # the reference: recompute everything, take the argmax
        seq = torch.cat([seq, full_logits(model, seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(gen.tokens, seq[:, 6:])
    assert gen.new_tokens == 12 and len(gen.step_s) == 11 and gen.ttft_s > 0


def test_cached_steps_match_full_pass_logits() -> None:
    model = tiny_model(1)
    tokens = torch.randint(0, 97, (1, 14))  # longer than the sliding window of layer 1
    decoder = EagerDecoder(model, 1, 14)
    steps = [decoder.prefill(tokens[:, :4])]  # the last position's logits (1, 1, V)
    steps += [decoder.step(tokens[:, i], i)[:, None] for i in range(4, 14)]
    assert_close_to_reference(torch.cat(steps, dim=1), full_logits(model, tokens)[:, 3:], 1e-5)


def test_stop_token_ends_generation_and_pads_finished_rows() -> None:
    model = tiny_model(2)
    prompt = torch.randint(0, 97, (1, 5))
    free = generate(EagerDecoder(model, 1, 32), prompt, max_new_tokens=10)
    stop = int(free.tokens[0, 3])
    first = int((free.tokens[0] == stop).nonzero()[0])
    gen = generate(EagerDecoder(model, 1, 32), prompt, max_new_tokens=10, stop_ids=(stop,))
    assert torch.equal(gen.tokens[0], free.tokens[0, : first + 1])


def test_sampling_limits_and_seed() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0, 2.8]]).repeat(400, 1)
    g = torch.Generator().manual_seed(0)
    top2 = choose(logits, Sampling(temperature=1.0, top_k=2), g)
    assert set(top2.tolist()) == {1, 2}  # only the two best, and both of them occur
    nucleus = choose(logits, Sampling(temperature=1.0, top_p=0.5), g)
    assert set(nucleus.tolist()) <= {1, 2}  # token 1 alone holds < 50% of the mass
    assert torch.equal(choose(logits, Sampling(temperature=1.0, top_k=1), g), logits.argmax(-1))
    model, prompt = tiny_model(3), torch.randint(0, 97, (1, 4))
    runs = [
        generate(EagerDecoder(model, 1, 32), prompt, 8, Sampling(temperature=0.8, seed=7)).tokens
        for _ in range(2)
    ]
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -1.0}, {"top_k": 0}, {"top_p": 0.0}, {"top_p": 1.5}]
)
def test_sampling_rejects_bad_settings(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Sampling(**kwargs)  # type: ignore[arg-type]


def test_cache_overflow_is_refused() -> None:
    model = tiny_model()
    decoder = EagerDecoder(model, 1, 4)
    with pytest.raises(ValueError, match="do not fit the cache"):
        decoder.prefill(torch.zeros(1, 5, dtype=torch.long))


class Chunky:
    """A ``MultiTokenDecoder`` that emits up to 3 greedy tokens a call by stepping the eager
    model itself: the loop must give the one-token-a-step text."""

    def __init__(self, model: Transformer, max_len: int) -> None:
        self.inner, self.stats = EagerDecoder(model, 1, max_len), SpeculativeStats()

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        self.stats = SpeculativeStats()
        return self.inner.prefill(tokens)

    def advance(
        self, token: torch.Tensor, pos: int, limit: int, sampler: Sampler
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, logits = [], []
        for i in range(min(3, limit)):
            logits.append(self.inner.step(token, pos + i))
            token = sampler.choose(logits[-1])
            tokens.append(token)
        self.stats.rounds += 1
        return torch.stack(tokens, 1), torch.stack(logits, 1)


def test_multi_token_decoders_run_in_the_same_loop() -> None:
    model, prompt = tiny_model(4), torch.randint(0, 97, (1, 5))
    plain = generate(EagerDecoder(model, 1, 32), prompt, 10, keep_logits=True)
    chunky = Chunky(model, 32)
    assert isinstance(chunky, MultiTokenDecoder)
    gen = generate(chunky, prompt, 10, keep_logits=True)
    assert torch.equal(gen.tokens, plain.tokens) and len(gen.step_s) == 9
    assert gen.logits is not None and plain.logits is not None
    assert_close_to_reference(gen.logits, plain.logits, 1e-5)
    assert gen.speculation is not None and gen.speculation.rounds == 3  # 9 tokens, 3 a call
    assert plain.speculation is None
    stop = int(plain.tokens[0, 5])  # mid-call: the rest of that call is dropped
    first = int((plain.tokens[0] == stop).nonzero()[0])
    seen: list[int] = []
    stopped = generate(chunky, prompt, 10, stop_ids=(stop,), on_token=lambda t: seen.append(int(t)))
    assert stopped.tokens[0].tolist() == seen == plain.tokens[0, : first + 1].tolist()
