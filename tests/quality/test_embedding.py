"""Sentence embeddings: pooling against a loop reference, real MiniLM sanity checks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kiln.quality.embedding import embed, mean_cosine, mean_pool
from tests.quality.conftest import requires_minilm
from tests.support.compare import assert_close_to_reference


def test_mean_pool_matches_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 7, 5, generator=gen)  # (B, T, D)
    lengths = [7, 1, 4]
    mask = torch.zeros(3, 7, dtype=torch.int64)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    want = torch.stack([hidden[b, :n].mean(dim=0) for b, n in enumerate(lengths)])
    assert_close_to_reference(mean_pool(hidden, mask), want, rtol_to_max=1e-5)


def test_mean_cosine() -> None:
    a = torch.randn(10, 8)
    assert mean_cosine(a, a * 3.0) == pytest.approx(1.0)
    assert mean_cosine(a, -a) == pytest.approx(-1.0)
    b = torch.randn(10, 8)
    want = sum(float(F.cosine_similarity(a[i], b[i], dim=0)) for i in range(10)) / 10
    assert mean_cosine(a, b) == pytest.approx(want, rel=1e-5)
    with pytest.raises(ValueError):
        mean_cosine(a, b[:5])


SENTENCES = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife.",
    "A man is eating food.",
    "The quarterly report shows a sharp drop in semiconductor exports.",
    "Emma Woodhouse, handsome, clever, and rich, had lived nearly twenty-one years in the world.",
]


@requires_minilm
def test_minilm_batched_matches_one_by_one(minilm: tuple[Any, Any]) -> None:
    model, tokenizer = minilm
    got = embed(model, tokenizer, SENTENCES, batch_size=3)  # padded batches
    assert got.shape == (len(SENTENCES), 384) and got.dtype == torch.float32
    with torch.inference_mode():
        for i, sentence in enumerate(SENTENCES):  # reference: no padding, plain mean
            enc = tokenizer(sentence, return_tensors="pt")
            pooled = model(**enc).last_hidden_state[0].mean(dim=0)
            want = pooled / pooled.norm()
            # padding changes the attention kernel's summation order: float32 noise only
            # (the old atol=1e-5, on unit vectors whose largest entry is ~0.19: 5e-5 of it)
            assert_close_to_reference(got[i], want, rtol_to_max=5e-5)


@requires_minilm
def test_minilm_similarities(minilm: tuple[Any, Any]) -> None:
    model, tokenizer = minilm
    a = embed(model, tokenizer, SENTENCES)
    b = embed(model, tokenizer, list(reversed(SENTENCES)), batch_size=1).flip(0)
    assert_close_to_reference(a.norm(dim=-1), torch.ones(len(SENTENCES)), rtol_to_max=1e-5)
    assert mean_cosine(a, b) == pytest.approx(1.0, abs=1e-5)  # a sentence with itself
    unrelated = float(a[1] @ a[2])
    assert unrelated < 0.9
    bread = embed(model, tokenizer, ["A man is eating a piece of bread."])[0]
    assert float(a[1] @ bread) > unrelated + 0.2  # paraphrase far closer than an unrelated one
