"""The per-architecture fit check: its arithmetic against hand-computed timings, and a
tiny model timed for real."""

from __future__ import annotations

import math

import pytest

from kiln.bench import arch_fit
from kiln.models.config import ModelConfig


def test_fit_error_of_an_exactly_linear_model_is_zero() -> None:
    # 1 ms per block of 10 MB, 3 ms for a head of 50 MB: t = 3 + blocks ms
    layers, amounts = (1, 9, 30), (60e6, 140e6, 350e6)
    seconds = (4e-3, 12e-3, 33e-3)
    fit = arch_fit.fit_error(layers, amounts, seconds)
    assert fit["predicted_s"] == pytest.approx(33e-3)
    assert fit["error"] == pytest.approx(0.0, abs=1e-12)


def test_fit_error_reports_a_whole_model_slower_than_its_probes_say() -> None:
    fit = arch_fit.fit_error((1, 9, 30), (60e6, 140e6, 350e6), (4e-3, 12e-3, 44e-3))
    assert fit["error"] == pytest.approx(33 / 44 - 1)
    noise = arch_fit.fit_error((1, 9, 30), (60e6, 140e6, 350e6), (12e-3, 4e-3, 44e-3))
    assert math.isnan(noise["error"])  # the probes did not grow with the blocks


def test_measure_times_probes_and_model_on_a_tiny_config() -> None:
    cfg = ModelConfig(family="llama", vocab_size=256, hidden_size=64, n_layers=4, n_heads=4,
                      n_kv_heads=2, head_dim=16, intermediate_size=128, max_positions=320)  # fmt: skip
    rows = arch_fit.measure(cfg, "fp32", rounds=1)
    assert [r["engine"] for r in rows] == ["decode, 1 row", "prefill, 64 rows", "prefill, 256 rows"]
    for r in rows:
        assert r["layers"][0] == 1 and r["layers"][-1] == 4 and r["measured_s"] > 0
    result = {"model": "tiny", "date": "d", "cpu": {"name": "cpu", "avx512f": True},
              "threads": 1, "rounds": 1, "rows": rows}  # fmt: skip
    assert "| fp32 | decode, 1 row |" in arch_fit.markdown(result)
