"""``python -m kiln.bench.cost_accuracy``: families, summaries and the report, on made-up
kernels (the measurement itself compiles and times suite models: not a unit test)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kiln.bench import cost_accuracy


def row(family: str, pred: float, meas: float) -> dict[str, Any]:
    return {
        "index": 0, "template": family, "family": family, "executor": "native",
        "primitives": "mm add", "predicted_us": pred, "measured_us": meas,
        "error": abs(pred - meas) / meas,
    }  # fmt: skip


def test_families() -> None:
    assert cost_accuracy.kernel_family("gemm", "native", 1) == "gemv"
    assert cost_accuracy.kernel_family("gemm", "native", 4) == "gemv"
    assert cost_accuracy.kernel_family("gemm", "native", 64) == "gemm"
    assert cost_accuracy.kernel_family("conv", "extern", None) == "extern"
    assert cost_accuracy.kernel_family("pointwise", "native", None) == "pointwise"


def test_summary_medians_and_families() -> None:
    rows = [row("gemm", 12.0, 10.0), row("gemm", 5.0, 10.0), row("pointwise", 1.0, 1.0)]
    s = cost_accuracy.summarize(rows)
    assert s["kernels"] == 3 and s["median_error"] == pytest.approx(0.2)
    assert s["families"]["gemm"]["median_error"] == pytest.approx(0.35)
    assert s["families"]["gemm"]["median_ratio"] == pytest.approx(0.85)
    assert s["families"]["pointwise"]["median_error"] == 0.0
    assert s["predicted_us"] == pytest.approx(18.0) and s["measured_us"] == pytest.approx(21.0)


def fake_result(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "kind": "cost-accuracy", "date": "2026-01-01",
        "device": {"name": "Test CPU", "slug": "test-cpu-avx2"}, "isa": "avx2", "threads": 2,
        "profile": {"name": "Test CPU (2t)", "source": "fitted kernel rates"},
        "overall": cost_accuracy.summarize(rows),
        "models": {
            "tiny": {"summary": cost_accuracy.summarize(rows), "kernels": rows},
            "broken": {"error": "CaptureError: data-dependent control flow"},
        },
    }  # fmt: skip


def test_markdown_report() -> None:
    text = cost_accuracy.markdown(fake_result([row("gemm", 12.0, 10.0), row("gemv", 3.0, 4.0)]))
    assert "Median |error| over all 2 kernels: 22%" in text
    assert "| gemv | 1 | 25% |" in text
    assert "| tiny | 2 | 22% |" in text and "gemm 1 (20%), gemv 1 (25%)" in text
    assert "| broken |" in text and "failed: CaptureError" in text
    assert "avx2, 2 threads" in text


def test_main_writes_json_and_markdown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [row("gemm", 12.0, 10.0)]
    monkeypatch.setattr(cost_accuracy, "run", lambda names, iters, rounds: fake_result(rows))
    assert (
        cost_accuracy.main(["--models", "swiglu_tower", "--out", str(tmp_path), "--tag", "x"]) == 0
    )
    [path] = tmp_path.glob("cost-accuracy-test-cpu-avx2-*-x.json")
    assert json.loads(path.read_text())["overall"]["kernels"] == 1
    assert path.with_suffix(".md").read_text().startswith("# Cost model accuracy")
    with pytest.raises(SystemExit):
        cost_accuracy.main(["--models", "no_such_model"])


def test_cost_ab_lists_changed_kernels() -> None:
    from kiln.bench import cost_ab

    old = ["reduction: max sub exp sum div", "gemm: mm add", "gemm: mm add"]
    new = ["reduction: max", "reduction: sub exp sum", "pointwise: div", "gemm: mm add"]
    assert cost_ab.only_in(old, new) == ["reduction: max sub exp sum div", "gemm: mm add"]
    assert cost_ab.only_in(new, old) == new[:3]
    result = {
        "date": "2026-01-01", "device": {"name": "Test CPU"}, "threads": 2, "fitted": True,
        "models": {"m": {"old_us": 10.0, "new_us": 8.0, "speedup": 1.25,
                         "kernels": {"old": 3, "new": 4}, "only_old": old[:1], "only_new": new[:3]}},
    }  # fmt: skip
    text = cost_ab.markdown(result)
    assert "| m | 10.0 | 8.0 | 1.25 | 3 / 4 |" in text and "- reduction: sub exp sum" in text
