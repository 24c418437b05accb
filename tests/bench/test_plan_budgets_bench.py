"""kiln.bench.plan_budgets' bookkeeping: one row per budget (planning and scoring stubbed:
tests/deploy plan and score real models), the INT8 reference executed beside the chosen
plans in turn, and a table whose every row has the header's cells."""

from __future__ import annotations

from typing import Any

import pytest

from kiln.bench import plan_budgets as bench
from kiln.deploy.execute import Measured
from kiln.deploy.plan_quality import AccuracyCheck


class _Planned:
    def __init__(self, budget: float) -> None:
        fmt = "int8" if budget < 0.01 else "mixed:8a8a"
        self.document = {
            "feasible": budget > 0.001,
            "compression": {"format": fmt, "label": fmt.replace("mixed:8a8a", "mixed-1234"),
                            "weight_bytes": 2_000_000, "layer_counts": {fmt: 2}},
            "predicted": {"ms_per_token": 9.0, "ppl_increase": budget / 2,
                          "ppl_increase_source": "measured: test"},
            "layout": {"tp": 1, "pp": 1, "batch": 1, "offload": "none", "stage_layers": [2]},
        }  # fmt: skip
        self.plan = type("P", (), {"request": type("R", (), {"max_ppl_increase": budget})})()


def test_rows_carry_each_budgets_plan_and_the_int8_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    executed: list[str] = []
    speeds = {"int8": iter([10.0, 9.0]), "mixed:8a8a": iter([8.5, 8.0])}

    def fake_measure(model: str, layout: dict[str, Any], fmt: str, *_: int) -> Measured:
        executed.append(fmt)
        return Measured(next(speeds[fmt]), 50.0, 100.0, 10**9, "fast C++ decode step")

    def fake_verify(result: Any, model: str, tokens: int, note: Any = None) -> AccuracyCheck:
        doc = result.document
        budget = result.plan.request.max_ppl_increase
        return AccuracyCheck(
            doc["compression"]["format"],
            budget / 2,
            budget,
            budget / 4,
            budget / 3,
            "sense_and_sensibility",
            tokens,
            "confirmed",
            20.0,
            20.1,
        )

    monkeypatch.setattr(bench, "plan_deployment", lambda *a, **k: _Planned(a[2].max_ppl_increase))
    monkeypatch.setattr(bench, "verify_accuracy", fake_verify)
    monkeypatch.setattr(bench, "format_accuracy", lambda *a, **k: None)
    monkeypatch.setattr("kiln.deploy.execute.measure", fake_measure)
    result = bench.run("smollm2", [0.001, 0.005, 0.05], 256, priors=False, mixed=True,
                       speed_rounds=2)  # fmt: skip
    assert "mixed" in result["formats"]
    infeasible, int8, mix = result["rows"]
    assert infeasible == {"budget": 0.001, "feasible": False}
    # each feasible plan, then INT8 (already one of them here), in turn, twice: fastest kept
    assert executed == ["int8", "mixed:8a8a"] * 2
    assert int8["ms_per_token"] == int8["int8_ms_per_token"] == 9.0
    assert mix["ms_per_token"] == 8.0 and mix["int8_ms_per_token"] == 9.0
    assert mix["label"] == "mixed-1234" and mix["weight_bytes"] == 2_000_000
    table = [line for line in bench.markdown(result).splitlines() if line.startswith("|")]
    cells = {line.count("|") for line in table}
    assert len(cells) == 1, table  # every row has the header's columns
    assert any("mixed-1234" in line and "8.00" in line for line in table)
