"""The margin of a mean paired difference, against hand-computed standard errors."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from kiln.quality.perplexity import perplexity, window_losses
from kiln.quality.spread import Z_ONE_SIDED_95, paired_difference
from tests.quality.test_perplexity import VOCAB, TinyCausalLM, naive_perplexity

# Synthetic per-window mean NLLs (nats per token) of an original and a compressed model.
ORIGINAL = [2.91, 3.12, 3.05, 2.88, 3.31, 2.97, 3.08]
COMPRESSED = [2.95, 3.13, 3.11, 2.90, 3.36, 2.96, 3.12]


def test_equal_weights_give_the_textbook_standard_error() -> None:
    diffs = [c - o for c, o in zip(COMPRESSED, ORIGINAL)]
    got = paired_difference(torch.tensor(diffs, dtype=torch.float64), z=1.2816)
    # s / sqrt(n), s the sample standard deviation (n - 1 in the denominator)
    want_se = statistics.stdev(diffs) / math.sqrt(len(diffs))
    assert got.mean == pytest.approx(statistics.fmean(diffs), rel=1e-12)
    assert got.margin == pytest.approx(1.2816 * want_se, rel=1e-12)
    assert got.n == len(diffs)
    default = paired_difference(torch.tensor(diffs, dtype=torch.float64))
    assert default.margin == pytest.approx(Z_ONE_SIDED_95 * want_se, rel=1e-12)
    assert abs(Z_ONE_SIDED_95 - statistics.NormalDist().inv_cdf(0.95)) < 1e-4


def test_weighted_mean_and_standard_error_by_hand() -> None:
    diffs = [0.04, 0.01, 0.06, 0.02, 0.05]
    counts = [511, 256, 256, 256, 100]  # tokens scored per window: the first and last differ
    total = sum(counts)
    mean = sum(c * d for c, d in zip(counts, diffs)) / total
    n = len(diffs)
    var = n / (n - 1) * sum((c / total) ** 2 * (d - mean) ** 2 for c, d in zip(counts, diffs))
    got = paired_difference(torch.tensor(diffs, dtype=torch.float64), torch.tensor(counts), z=2.0)
    assert got.mean == pytest.approx(mean, rel=1e-12)
    assert got.margin == pytest.approx(2.0 * math.sqrt(var), rel=1e-12)


def test_one_unit_has_no_margin_and_bad_input_is_refused() -> None:
    assert paired_difference(torch.tensor([0.3])).margin == 0.0
    identical = paired_difference(torch.full((5,), 0.02))
    assert identical.mean == pytest.approx(0.02) and identical.margin == pytest.approx(0.0)
    with pytest.raises(ValueError, match="non-empty"):
        paired_difference(torch.tensor([]))
    with pytest.raises(ValueError, match="weights"):
        paired_difference(torch.tensor([0.1, 0.2]), torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="finite"):
        paired_difference(torch.tensor([0.1, math.inf]))
    with pytest.raises(ValueError, match="z"):
        paired_difference(torch.tensor([0.1, 0.2]), z=-1.0)


def test_token_weighted_window_difference_is_the_log_perplexity_ratio() -> None:
    """Weighted by scored tokens, the per-window paired difference of mean NLL is exactly
    log(ppl_b / ppl_a) of the whole stream (naive reference perplexities)."""
    a, b = TinyCausalLM(seed=0), TinyCausalLM(seed=1)
    ids = torch.randint(0, VOCAB, (300,), generator=torch.Generator().manual_seed(7))
    wa = window_losses(a, ids, context=64, stride=32)
    wb = window_losses(b, ids, context=64, stride=32)
    got = paired_difference(wb.mean_nll - wa.mean_nll, wa.counts)
    ppl_a, _ = naive_perplexity(a, ids, 64, 32)
    ppl_b, _ = naive_perplexity(b, ids, 64, 32)
    assert got.mean == pytest.approx(math.log(ppl_b / ppl_a), rel=1e-10)
    assert wa.total().ppl == pytest.approx(perplexity(a, ids, context=64, stride=32).ppl, rel=1e-15)
