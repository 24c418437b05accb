"""kiln.bench.plan_accuracy's bookkeeping: plans executed in rounds, the fastest run kept,
errors against it, the spread shown (execution itself is stubbed: the planner's own tests
and tests/deploy execute plans)."""

from __future__ import annotations

from typing import Any

import pytest

from kiln.bench import plan_accuracy as bench
from kiln.deploy.estimate import NOTHING_MEASURED
from kiln.deploy.execute import Measured


def test_rounds_keep_the_fastest_run_and_report_the_spread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    times = iter([(50.0, 400.0, 3e9), (40.0, 500.0, 3.2e9), (45.0, 300.0, 3.1e9)])
    calls: list[tuple[str, str]] = []

    def fake_measure(path: str, layout: dict[str, Any], fmt: str, *_: int) -> Measured:
        calls.append((path, fmt))
        ms, ttft, peak = next(times)
        return Measured(ms, ttft, 1e3 / ms, int(peak), "fast C++ decode step")

    monkeypatch.setattr(bench, "checkpoint_of", lambda model: model)  # a shipped config
    monkeypatch.setattr(bench, "measurements", lambda *_, **__: NOTHING_MEASURED)
    monkeypatch.setattr(bench, "measure", fake_measure)
    result = bench.run([bench.PlanSpec("qwen2-0.5b", "int8", 1)], 64, 8, rounds=3)
    assert calls == [("qwen2-0.5b", "int8")] * 3
    (row,) = result["rows"]
    assert row["measured"] == {"ms_per_token": 40.0, "ttft_ms": 300.0, "peak_bytes": 3.2e9}
    assert row["decode_spread"] == pytest.approx(50 / 40 - 1)
    assert row["error"]["ms_per_token"] == pytest.approx(row["predicted"]["ms_per_token"] / 40 - 1)
    assert len(row["runs"]) == 3
    base = row["calibration_only"]["ms_per_token"]  # the A/B: priced without the probes
    assert base["error"] == pytest.approx(base["predicted"] / 40 - 1)
    assert "calibration_only" in result["summary"]
    text = bench.markdown(result)
    assert "executed 3 times" in text and "| 25% |" in text  # the spread column


def test_a_mixed_plan_is_the_one_kiln_plan_chooses_for_its_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[Any] = []

    class Chosen:
        document = {"compression": {"format": "mixed:8a"}}

    def fake_plan(model: str, hardware: str, request: Any, **_: Any) -> Chosen:
        asked.append((model, hardware, request))
        return Chosen()

    monkeypatch.setattr(bench, "checkpoint_of", lambda model: f"/ckpt/{model}")
    monkeypatch.setattr(bench, "plan_deployment", fake_plan)
    assert bench.plan_format(bench.PlanSpec("smollm2", "int8", 1), 64, 8) == "int8"
    assert asked == []
    assert bench.plan_format(bench.PlanSpec("smollm2", "mixed@5%", 4), 64, 8) == "mixed:8a"
    ((model, hardware, request),) = asked
    assert (model, hardware) == ("/ckpt/smollm2", "cpu")
    assert request.max_ppl_increase == pytest.approx(0.05) and "mixed" in request.formats
    assert request.batch == 4 and request.prompt_len == 64
