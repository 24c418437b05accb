"""The built-in tasks' measurements on small stand-in novels: the increase and its margin
against hand-computed references, on the search and the confirmation text."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln.compress.tasks import EncoderTask, LanguageModelTask
from kiln.quality import corpus
from tests.quality.test_perplexity import TinyCausalLM, naive_windows

VOCAB = 128  # code points of the stand-in text


class CharTokenizer:
    """One token per character (its code point); pads with 0 for batches of sentences."""

    def __call__(self, text: Any, **kwargs: Any) -> Any:
        if isinstance(text, str):
            return {"input_ids": [ord(c) for c in text]}
        longest = max(len(t) for t in text)
        ids = torch.zeros(len(text), longest, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for i, t in enumerate(text):
            ids[i, : len(t)] = torch.tensor([ord(c) for c in t])
            mask[i, : len(t)] = 1
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}


@pytest.fixture
def novels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Six stand-in novels, each its own words, in paragraphs of eight-word-plus sentences."""
    monkeypatch.setenv("KILN_DATA_DIR", str(tmp_path))
    texts = {}
    for k, name in enumerate(corpus.NOVELS):
        title = corpus.TITLES[name]  # no underscores: sentences() drops them as italics
        paragraphs = [
            f"In {title} the reader meets person {i} who walks {k + i} miles today. "
            f"Then person {i} of {title} rests a while by the fire."
            for i in range(40)
        ]
        texts[name] = "\n\n".join(paragraphs)
        (tmp_path / f"{name}.txt").write_text(texts[name], encoding="utf-8")
    return texts


def _window_mean_nll(model: nn.Module, ids: torch.Tensor) -> tuple[list[float], list[int]]:
    per_window = naive_windows(model, ids, context=64, stride=32)
    return [n / c for n, c in per_window], [c for _, c in per_window]


def test_language_model_margin_is_z_standard_errors_of_window_differences(
    novels: dict[str, str],
) -> None:
    original, compressed = TinyCausalLM(VOCAB, seed=0), TinyCausalLM(VOCAB, seed=1)
    task = LanguageModelTask(
        original, CharTokenizer(), eval_tokens=400, confirm_tokens=300, context=64, stride=32,
        z=1.645,
    )  # fmt: skip
    task.baseline()
    for measure, novel, n in (
        (task.measure_search, corpus.SEARCH_NOVEL, 400),
        (task.measure_confirmation, corpus.CONFIRMATION_NOVEL, 300),
    ):
        ids = torch.tensor([ord(c) for c in novels[novel][:n]])
        base, counts = _window_mean_nll(original, ids)
        comp, _ = _window_mean_nll(compressed, ids)
        diffs = [c - b for c, b in zip(comp, base)]
        mean = sum(d * c for d, c in zip(diffs, counts)) / sum(counts)
        w = [c / sum(counts) for c in counts]
        k = len(diffs)
        se = math.sqrt(k / (k - 1) * sum(wi**2 * (d - mean) ** 2 for wi, d in zip(w, diffs)))
        got = measure(compressed)
        assert got.n == k
        assert got.mean == pytest.approx(mean, rel=1e-9)
        assert got.margin == pytest.approx(1.645 * se, rel=1e-9)
    # the search figure alone is log(ppl / ppl_original) on the search text
    assert task.measure(compressed) == pytest.approx(
        math.log(task.ppl(compressed) / task.baseline()), rel=1e-12
    )
    assert task.search_text == "Pride and Prejudice (first 400 tokens)"
    assert task.confirm_text == "Sense and Sensibility (first 300 tokens)"
    assert task.measure_confirmation(original).mean == 0.0  # the original against itself


def test_measuring_before_the_baseline_is_refused(novels: dict[str, str]) -> None:
    task = LanguageModelTask(TinyCausalLM(VOCAB), CharTokenizer(), eval_tokens=100)
    with pytest.raises(RuntimeError, match="baseline"):
        task.measure_confirmation(task.model)


class BagEncoder(nn.Module):
    """Embedding -> linear per token: hidden states that a BERT-style caller can pool."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed, self.mix = nn.Embedding(VOCAB, 12), nn.Linear(12, 12)

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> SimpleNamespace:
        return SimpleNamespace(last_hidden_state=self.mix(self.embed(input_ids)))  # (B, T, 12)


def _sentence_embedding(model: BagEncoder, sentence: str) -> torch.Tensor:
    with torch.no_grad():
        ids = torch.tensor([[ord(c) for c in sentence]])  # no padding: a plain mean
        hidden = model(ids).last_hidden_state[0]  # (T, 12)
    return F.normalize(hidden.mean(dim=0), dim=0)


def test_encoder_margin_is_z_standard_errors_of_per_sentence_loss(
    novels: dict[str, str],
) -> None:
    original, compressed = BagEncoder(seed=0), BagEncoder(seed=0)
    with torch.no_grad():
        compressed.mix.weight.add_(0.2 * torch.randn(12, 12))
    task = EncoderTask(
        original, CharTokenizer(), eval_sentences=20, confirm_sentences=15, batch_size=4, z=2.0
    )
    task.baseline()
    search, confirm = task.sentences(), task.confirmation_sentences()
    assert all(corpus.TITLES[corpus.SEARCH_NOVEL] in s for s in search)
    assert all(corpus.TITLES[corpus.CONFIRMATION_NOVEL] in s for s in confirm)
    for measure, text in ((task.measure_search, search), (task.measure_confirmation, confirm)):
        loss = [
            1.0 - float(_sentence_embedding(compressed, s) @ _sentence_embedding(original, s))
            for s in text
        ]
        got = measure(compressed)
        assert got.n == len(text)
        assert got.mean == pytest.approx(statistics.fmean(loss), rel=1e-4)
        assert got.margin == pytest.approx(
            2.0 * statistics.stdev(loss) / math.sqrt(len(loss)), rel=1e-3
        )
    assert task.cosine(compressed) == pytest.approx(1.0 - task.measure(compressed))
