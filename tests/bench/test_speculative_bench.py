"""kiln.bench.speculative_rounds's pieces that need no real model: prompt windows and the table."""

from __future__ import annotations

import pytest
import torch

from kiln.bench.speculative_rounds import prompt_windows, render_markdown


def test_prompt_windows_are_evenly_spaced_slices() -> None:
    ids = torch.arange(100)
    wins = prompt_windows(ids, 4, 10)
    assert [w.shape for w in wins] == [(1, 10)] * 4
    assert [int(w[0, 0]) for w in wins] == [0, 30, 60, 90]
    assert torch.equal(wins[1][0], torch.arange(30, 40))
    assert torch.equal(prompt_windows(ids, 1, 100)[0][0], ids)
    with pytest.raises(ValueError, match="cannot cut"):
        prompt_windows(ids, 2, 101)


def test_markdown_lists_every_prompt_and_guess_count() -> None:
    spec = {"tokens_per_s": 50.0, "speedup": 1.5, "acceptance": 0.9, "tokens_per_round": 3.2,
            "same_tokens": True}  # fmt: skip
    result = {
        "device": {"name": "cpu"}, "threads": 2, "date": "2026-11-23T00:00:00+00:00",
        "model": "m", "prompts": 2, "prompt_len": 8, "text": "t", "n_new": 16, "repeats": 1,
        "rows": [{"prompt": i, "plain_tokens_per_s": 33.3, "spec": {"2": spec, "4": spec}}
                 for i in range(2)],
        "summary": {k: {"median_speedup": 1.5, "min_speedup": 1.4, "median_acceptance": 0.9,
                        "all_same_tokens": True} for k in ("2", "4")},
    }  # fmt: skip
    md = render_markdown(result)
    assert "| 1 | 33.3 | 50.0 (1.50x, 90%) | 50.0 (1.50x, 90%) |" in md
    assert "- k=4: median speed-up 1.50x (least 1.40x)" in md
