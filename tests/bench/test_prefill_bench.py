"""kiln.bench.prefill's bookkeeping (no processes): prompt ids, ratios, the table."""

from __future__ import annotations

from typing import Any

from kiln.bench import prefill


def _round(ttft_s: float, token: int = 7) -> dict[str, Any]:
    return {"ttft_s": ttft_s, "token": token}


def test_prompt_ids_are_fixed_and_in_range() -> None:
    ids = prefill.prompt_ids(300, vocab=1000)
    assert ids == prefill.prompt_ids(300, vocab=1000) and len(ids) == 300
    assert all(100 <= i < 1000 for i in ids)


def test_summarize_ratios_and_markdown() -> None:
    rounds = {
        ("kiln-before", 512): [_round(3.0), _round(2.0)],
        ("kiln-after", 512): [_round(1.0), _round(0.5)],
        ("llamacpp", 512): [_round(0.25, token=9)],
        ("kiln-after", 128): [{"error": "boom"}],
    }
    entries = {(e["contender"], e["length"]): e for e in prefill.summarize(rounds)}
    after = entries[("kiln-after", 512)]
    assert after["ttft_ms"] == 500 and after["median_ms"] == 750
    assert after["speedup_vs_before"] == 4.0 and after["same_token"]
    assert after["vs_llamacpp"] == 0.5  # llama.cpp's TTFT / kiln's
    assert entries[("kiln-after", 128)]["error"] == "boom"
    result = {
        "device": {"name": "CPU", "isa": "avx2"}, "threads": 2, "date": "2026-01-01T00:00",
        "prompt": "ids", "repeats": 2, "results": list(entries.values()),
        "contenders": {"llama-bench": {"error": "not run: llama-bench is not on PATH"}},
        "breakdown": {"kiln-after": {"512": {"total": 1.0, "linear_all": 0.5, "norm": 0.1}}},
    }  # fmt: skip
    text = prefill.render_markdown(result)
    assert "| kiln-after | 512 | 500 | 750 | 1024 | 4.00 | 0.50 | yes | – |" in text
    assert "not on PATH" in text and "| 512 | 1000 | 500 (50%)" in text
