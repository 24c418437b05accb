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


def test_a_failed_plan_is_reported_and_the_others_scored(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_measure(path: str, layout: dict[str, Any], fmt: str, *_: int) -> Measured:
        if fmt == "int4-g128":
            raise RuntimeError("executing the plan failed:\nCUDA out of memory")
        return Measured(40.0, 300.0, 25.0, int(3e9), "decode step as one CUDA graph")

    monkeypatch.setattr(bench, "checkpoint_of", lambda model: model)
    monkeypatch.setattr(bench, "measurements", lambda *_, **__: NOTHING_MEASURED)
    monkeypatch.setattr(bench, "measure", fake_measure)
    plans = [bench.PlanSpec("qwen2-0.5b", "int4-g128", 1), bench.PlanSpec("qwen2-0.5b", "bf16", 1)]
    result = bench.run(plans, 64, 8, rounds=2)
    failed, ok = result["rows"]
    assert "out of memory" in failed["failed"] and "measured" not in failed
    assert len(ok["runs"]) == 2 and "error" in ok
    assert list(result["summary"]["failed"]) == [failed["plan"]]
    assert result["summary"]["ms_per_token"]["median_abs_error"] == pytest.approx(
        abs(ok["predicted"]["ms_per_token"] / 40 - 1))  # fmt: skip
    assert "failed: RuntimeError" in bench.markdown(result)


def test_past_its_budget_no_execution_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "checkpoint_of", lambda model: model)
    monkeypatch.setattr(bench, "measurements", lambda *_, **__: NOTHING_MEASURED)
    monkeypatch.setattr(bench, "measure", lambda *_: pytest.fail("executed past the budget"))
    result = bench.run([bench.PlanSpec("qwen2-0.5b", "bf16", 1)], 64, 8, rounds=1, budget_s=-1)
    assert result["rows"][0]["failed"] == "not run: the time budget was spent"
