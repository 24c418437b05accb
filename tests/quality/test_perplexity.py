"""Sliding-window perplexity against a naive one-window-at-a-time reference."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln.quality.perplexity import perplexity, sliding_windows, window_losses

VOCAB = 37


class TinyCausalLM(nn.Module):
    """Embedding -> causal running mean -> linear: its logits depend on the whole prefix."""

    def __init__(self, vocab: int = VOCAB, dim: int = 16, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)
        self.double()  # float64: batched and one-by-one runs then agree to ~1e-15

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, V)
        h = self.embed(ids)  # (B, T, D)
        steps = torch.arange(1, ids.shape[1] + 1, dtype=h.dtype)[None, :, None]  # (1, T, 1)
        return self.head(torch.tanh(h.cumsum(dim=1) / steps))


def naive_perplexity(
    model: nn.Module, ids: torch.Tensor, context: int, stride: int
) -> tuple[float, int]:
    """The textbook loop: one window at a time, earlier-scored targets masked with -100."""
    nll_sum, count, prev_end = 0.0, 0, 0
    for begin in range(0, ids.numel(), stride):
        end = min(begin + context, ids.numel())
        window = ids[begin:end].clone()
        labels = window.clone()
        new = end - prev_end  # tokens this window is first to see
        labels[: window.numel() - new] = -100
        logits = model(window[None])[0]  # (T, V)
        nll_sum += F.cross_entropy(
            logits[:-1], labels[1:], ignore_index=-100, reduction="sum"
        ).item()
        count += int((labels[1:] != -100).sum())
        prev_end = end
        if end == ids.numel():
            break
    return math.exp(nll_sum / count), count


@pytest.mark.parametrize(
    "n_tokens,context,stride,batch_size",
    [
        (200, 32, 16, 4),  # last window shorter than the others
        (193, 32, 16, 3),  # batches of unequal size
        (200, 32, 32, 1),  # no overlap
        (200, 32, 7, 5),  # stride not dividing the context
        (20, 32, 16, 4),  # a single window shorter than the context
        (32, 32, 16, 2),  # exactly one full window
        (2, 8, 4, 4),  # the smallest stream: one scored token
    ],
)
def test_matches_naive_reference(n_tokens: int, context: int, stride: int, batch_size: int) -> None:
    model = TinyCausalLM()
    ids = torch.randint(0, VOCAB, (n_tokens,), generator=torch.Generator().manual_seed(n_tokens))
    got = perplexity(model, ids, context=context, stride=stride, batch_size=batch_size)
    want_ppl, want_count = naive_perplexity(model, ids, context, stride)
    assert got.n_scored == want_count
    if stride < context:  # windows overlap: every token but the very first is scored
        assert got.n_scored == n_tokens - 1
    assert got.ppl == pytest.approx(want_ppl, rel=1e-12)
    assert got.nll_mean == pytest.approx(math.log(want_ppl), rel=1e-12)


def test_every_token_but_the_first_is_scored_once() -> None:
    for n, context, stride in [(1000, 512, 256), (513, 512, 256), (20000, 512, 256), (77, 10, 3)]:
        windows = sliding_windows(n, context, stride)
        scored = [t for w in windows for t in range(w.score_from, w.end)]
        assert scored == list(range(1, n))
        assert all(w.length <= context and w.score_from > w.begin for w in windows)


def test_uniform_model_has_perplexity_vocab_size() -> None:
    def uniform(ids: torch.Tensor) -> SimpleNamespace:  # Hugging Face style output
        return SimpleNamespace(logits=torch.zeros(*ids.shape, VOCAB))

    result = perplexity(uniform, torch.randint(0, VOCAB, (300,)), context=64, stride=32)
    assert result.ppl == pytest.approx(VOCAB, rel=1e-6)  # float32 log-softmax of zeros


def test_progress_and_argument_checks() -> None:
    calls: list[tuple[int, int]] = []
    ids = torch.randint(0, VOCAB, (100,))
    perplexity(
        TinyCausalLM(),
        ids,
        context=16,
        stride=8,
        batch_size=4,
        progress=lambda d, t: calls.append((d, t)),
    )
    total = len(sliding_windows(100, 16, 8))
    assert calls[-1] == (total, total) and [d for d, _ in calls] == sorted(d for d, _ in calls)
    with pytest.raises(ValueError):
        perplexity(TinyCausalLM(), ids[None], context=16, stride=8)
    with pytest.raises(ValueError):
        perplexity(TinyCausalLM(), ids, context=16, stride=17)
    with pytest.raises(TypeError):
        perplexity(lambda x: x, ids, context=16, stride=8)


def naive_windows(
    model: nn.Module, ids: torch.Tensor, context: int, stride: int
) -> list[tuple[float, int]]:
    """The textbook loop, window by window: (summed NLL, scored tokens) of each window."""
    out, prev_end = [], 0
    for begin in range(0, ids.numel(), stride):
        end = min(begin + context, ids.numel())
        window = ids[begin:end]
        labels = window.clone()
        labels[: window.numel() - (end - prev_end)] = -100  # scored by an earlier window
        logits = model(window[None])[0]  # (T, V)
        nll = F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="sum")
        out.append((nll.item(), int((labels[1:] != -100).sum())))
        prev_end = end
        if end == ids.numel():
            break
    return out


@pytest.mark.parametrize("n_tokens,context,stride", [(200, 32, 16), (200, 32, 32), (77, 10, 3)])
def test_window_losses_match_a_window_by_window_reference(
    n_tokens: int, context: int, stride: int
) -> None:
    """Each window's summed NLL and count equal the textbook loop's for that window, and
    their total is ``perplexity``."""
    model = TinyCausalLM()
    ids = torch.randint(0, VOCAB, (n_tokens,), generator=torch.Generator().manual_seed(3))
    got = window_losses(model, ids, context=context, stride=stride, batch_size=3)
    want = naive_windows(model, ids, context, stride)
    assert got.counts.tolist() == [c for _, c in want]
    assert got.nll.tolist() == pytest.approx([n for n, _ in want], rel=1e-12)
    assert got.mean_nll.tolist() == pytest.approx([n / c for n, c in want], rel=1e-12)
    assert got.total() == perplexity(model, ids, context=context, stride=stride)
