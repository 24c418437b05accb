"""The CPU decode-rate table the planner reads: lookup by rows, caching, the step timer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.deploy import kernel_rates
from kiln.deploy.kernel_rates import load_rates, rate_at, step_seconds
from kiln.llm.generate import EagerDecoder
from tests.support.models import tiny_transformer

TABLE = {"int8": {1: 20.0, 4: 12.0}, "eager-int8": {1: 7.0}}


def test_rate_at_takes_the_nearest_measured_rows_below() -> None:
    assert rate_at(TABLE, "int8", 1) == 20.0
    assert rate_at(TABLE, "int8", 3) == 20.0
    assert rate_at(TABLE, "int8", 8) == 12.0
    assert rate_at(TABLE, "eager-int8", 4) == 7.0
    assert rate_at(TABLE, "fp32", 1) is None


def test_rates_are_cached_per_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    calls = []

    def fake(threads: int = 2) -> dict[str, dict[int, float]]:
        calls.append(threads)
        return {"fp32": {1: 25.0, 4: 19.0}}

    monkeypatch.setattr(kernel_rates, "measure_rates", fake)
    assert load_rates(2) == {"fp32": {1: 25.0, 4: 19.0}} and calls == [2]
    assert load_rates(2) == {"fp32": {1: 25.0, 4: 19.0}} and calls == [2]  # from the file
    path = Path(kernel_rates.rates_path(2))
    assert json.loads(path.read_text())["fp32"]["4"] == 19.0
    path.write_text("{broken")
    load_rates(2)
    assert calls == [2, 2]  # a corrupt entry is measured again


def test_step_seconds_times_real_steps() -> None:
    dec = EagerDecoder(tiny_transformer(), 2, 32)
    assert 0 < step_seconds(dec, 2, 4, 1) < 1.0
