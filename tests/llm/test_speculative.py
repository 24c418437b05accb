"""SpeculativeDecoder: the target's greedy text (or its sampling distribution), whatever
the draft guesses.

The reference is plain greedy decoding of the same target (``generate`` over FastDecoder
steps, itself tested against the eager model in test_decode.py), and the eager model for
one case. Drafts: the INT8 copy (mostly right), the target itself (always right: every
round emits k + 1 tokens) and an unrelated random model (mostly wrong: the target's own
token every round). The models are untied: a tiny random model with a tied head mostly
repeats its last token, which every draft guesses right.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kiln.llm.fast_decoder import FastDecoder
from kiln.llm.generate import EagerDecoder, Sampling, SpeculativeStats, generate
from kiln.llm.speculative import SpeculativeDecoder, accept_or_resample, quantized_draft
from kiln.models.transformer import Transformer
from tests.support.compare import assert_close_to_reference
from tests.support.models import DECODE_CONFIGS, tiny_transformer

N_NEW = 20
PROMPT_LEN = 5
TARGETS = {n: replace(DECODE_CONFIGS[n], tie_embeddings=False) for n in DECODE_CONFIGS}
LLAMA = TARGETS["llama_gqa"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def prompt_of(model: Transformer) -> torch.Tensor:
    torch.manual_seed(3)
    return torch.randint(0, model.cfg.vocab_size, (1, PROMPT_LEN))


def plain_greedy(model: Transformer, prompt: torch.Tensor, n: int, stops: tuple[int, ...] = ()
                 ) -> torch.Tensor:  # fmt: skip
    return generate(FastDecoder(model, 1, PROMPT_LEN + n), prompt, n, stop_ids=stops).tokens


def speculate(model: Transformer, draft: Transformer, k: int, n: int = N_NEW,
              stops: tuple[int, ...] = ()) -> tuple[torch.Tensor, SpeculativeStats]:  # fmt: skip
    max_len = PROMPT_LEN + n
    spec = SpeculativeDecoder(
        FastDecoder(model, 1, max_len, max_chunk=k + 1), FastDecoder(draft, 1, max_len), k
    )
    gen = generate(spec, prompt_of(model), n, stop_ids=stops)
    assert gen.speculation is not None
    return gen.tokens, gen.speculation


@pytest.mark.parametrize(
    "name", ["llama_gqa", "sliding_softcap_gelu", "gpt2_layernorm", "opt_relu"]
)
@pytest.mark.parametrize("k", [1, 3, 5])
def test_int8_draft_gives_the_targets_greedy_text(name: str, k: int) -> None:
    model = tiny_transformer(TARGETS[name], init="varied")
    got, st = speculate(model, quantized_draft(model), k)
    ref = plain_greedy(model, prompt_of(model), N_NEW)
    assert len(set(ref[0].tolist())) > N_NEW // 2  # a varied text, not one token repeated
    assert torch.equal(got, ref)
    assert st.accepted + st.rounds == N_NEW - 1  # every token after the first, once
    assert st.drafted <= k * st.rounds


def test_matches_the_eager_model() -> None:
    model = tiny_transformer(LLAMA, init="varied")
    got, _ = speculate(model, quantized_draft(model), 3)
    ref = generate(EagerDecoder(model, 1, PROMPT_LEN + N_NEW), prompt_of(model), N_NEW).tokens
    assert torch.equal(got, ref)


def test_a_perfect_draft_is_always_accepted() -> None:
    model = tiny_transformer(LLAMA, init="varied")
    k = 4
    got, st = speculate(model, model, k)
    assert torch.equal(got, plain_greedy(model, prompt_of(model), N_NEW))
    assert st.acceptance == 1.0
    assert st.rounds == -(-(N_NEW - 1) // (k + 1))  # k + 1 tokens a round


def test_any_decoder_can_draft() -> None:
    """An eager draft (no extend: a kept round's last guess is fed by a step of its own)."""
    model = tiny_transformer(LLAMA, init="varied")
    max_len = PROMPT_LEN + N_NEW
    spec = SpeculativeDecoder(
        FastDecoder(model, 1, max_len, max_chunk=4), EagerDecoder(model, 1, max_len), 3
    )
    gen = generate(spec, prompt_of(model), N_NEW)
    assert torch.equal(gen.tokens, plain_greedy(model, prompt_of(model), N_NEW))
    assert gen.speculation is not None and gen.speculation.acceptance == 1.0


def test_a_wrong_draft_changes_nothing_but_speed() -> None:
    model, other = (
        tiny_transformer(LLAMA, init="varied"),
        tiny_transformer(LLAMA, seed=7, init="varied"),
    )
    got, st = speculate(model, other, 3)
    assert torch.equal(got, plain_greedy(model, prompt_of(model), N_NEW))
    assert st.acceptance < 0.5


@pytest.mark.parametrize("n", [1, 2, 7])
def test_short_generations(n: int) -> None:
    model = tiny_transformer(LLAMA, init="varied")
    got, _ = speculate(model, model, 4, n=n)
    assert got.shape == (1, n)
    assert torch.equal(got, plain_greedy(model, prompt_of(model), n))


def test_stops_after_a_stop_token() -> None:
    model = tiny_transformer(LLAMA, init="varied")
    full = plain_greedy(model, prompt_of(model), N_NEW)[0].tolist()
    stop = full[6]  # a token the text reaches mid-round
    got, _ = speculate(model, model, 4, stops=(stop,))
    assert got[0].tolist() == full[: full.index(stop) + 1]


def test_bad_setups_raise() -> None:
    model = tiny_transformer(LLAMA, init="varied")
    one = FastDecoder(model, 1, 16, max_chunk=4)
    with pytest.raises(ValueError, match="one sequence"):
        SpeculativeDecoder(FastDecoder(model, 2, 16), one, 2)
    with pytest.raises(ValueError, match="max_chunk is 4"):
        SpeculativeDecoder(one, one, 4)
    with pytest.raises(ValueError, match=">= 1"):
        SpeculativeDecoder(one, one, 0)
    spec = SpeculativeDecoder(one, FastDecoder(model, 1, 16), 3)
    with pytest.raises(ValueError, match="exceed the target's cache"):
        generate(spec, torch.zeros(1, 10, dtype=torch.long), 8)
    with pytest.raises(ValueError, match=r"\(1, tokens\)"):
        generate(spec, torch.zeros(2, 3, dtype=torch.long), 4)


def total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def test_accept_or_resample_keeps_the_target_distribution() -> None:
    """Speculative sampling's guarantee on fixed distributions (V = 6, k = 2): the first
    emitted token follows p[0], the second (after a kept guess) p[1], whatever q is."""
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(2 * torch.randn(3, 6, generator=gen), -1)  # (k + 1, V)
    q = torch.softmax(2 * torch.randn(2, 6, generator=gen), -1)  # (k, V)
    n = 20_000
    first, second = torch.zeros(6), torch.zeros(6)
    for _ in range(n):
        guesses = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
        new, kept = accept_or_resample(p, q, guesses, gen)
        assert len(new) == kept + 1 and new[:kept] == guesses[:kept]
        first[new[0]] += 1
        if kept >= 1:
            second[new[1]] += 1
    assert total_variation(q[0], p[0]) > 0.2  # the draft alone would fail the check below
    assert total_variation(first / n, p[0]) < 0.02
    assert total_variation(second / second.sum(), p[1]) < 0.03


def test_sampled_text_follows_the_target_distribution() -> None:
    """End to end on a 12-token vocabulary with an unrelated draft (k = 1): the second new
    token's frequencies over 3000 seeded runs match its exact probability under the target,
    sum over t1 of p(t1 | prompt) p(t2 | prompt, t1), computed by the eager model."""
    cfg = replace(LLAMA, vocab_size=12)
    model, other = (
        tiny_transformer(cfg, init="varied"),
        tiny_transformer(cfg, seed=5, init="varied"),
    )
    sampling = Sampling(temperature=1.0)
    prompt = torch.tensor([[3, 7, 1]])
    with torch.no_grad():
        p1 = model(prompt, 0, model.new_cache(1, 4))[0, -1].softmax(-1)  # (V,)
        both = torch.cat([prompt.repeat(12, 1), torch.arange(12)[:, None]], 1)  # (V, 4)
        p2 = model(both, 0, model.new_cache(12, 4))[:, -1].softmax(-1)  # (V, V)
    exact = p1 @ p2  # (V,)
    spec = SpeculativeDecoder(FastDecoder(model, 1, 6, max_chunk=2), FastDecoder(other, 1, 6), 1)
    counts = torch.zeros(12)
    n = 3000
    for seed in range(n):  # 3 new tokens: the first round (k = 1) emits the second
        gen = generate(spec, prompt, 3, replace(sampling, seed=seed))
        counts[gen.tokens[0, 1]] += 1
    assert gen.speculation is not None and gen.speculation.drafted == 1
    assert total_variation(counts / n, exact) < 0.05


def test_sampling_is_seeded_and_a_perfect_draft_is_kept() -> None:
    model = tiny_transformer(LLAMA, init="varied")
    spec = SpeculativeDecoder(
        FastDecoder(model, 1, PROMPT_LEN + N_NEW, max_chunk=5),
        FastDecoder(model, 1, PROMPT_LEN + N_NEW), 4,
    )  # fmt: skip
    sampling = Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=11)
    a = generate(spec, prompt_of(model), N_NEW, sampling)
    assert a.speculation is not None and a.speculation.acceptance > 0.9  # p == q up to rounding
    b = generate(spec, prompt_of(model), N_NEW, sampling)
    assert torch.equal(a.tokens, b.tokens) and a.tokens.shape == (1, N_NEW)


def test_the_generation_keeps_the_targets_logits() -> None:
    """Each emitted token's logits are the target's at its position (checked k + 1 rows at a
    time, so equal to one-row steps up to fp32 summation order)."""
    model = tiny_transformer(LLAMA, init="varied")
    max_len = PROMPT_LEN + N_NEW
    spec = SpeculativeDecoder(
        FastDecoder(model, 1, max_len, max_chunk=4),
        FastDecoder(quantized_draft(model), 1, max_len),
        3,
    )
    gen = generate(spec, prompt_of(model), N_NEW, keep_logits=True)
    ref = generate(FastDecoder(model, 1, max_len), prompt_of(model), N_NEW, keep_logits=True)
    assert torch.equal(gen.tokens, ref.tokens) and gen.logits is not None
    assert ref.logits is not None and gen.logits.shape == ref.logits.shape == (
        1,
        N_NEW,
        LLAMA.vocab_size,
    )
    assert_close_to_reference(gen.logits, ref.logits, 1e-4)
