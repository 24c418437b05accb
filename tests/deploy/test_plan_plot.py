"""The plan's latency / cost frontier (document and picture)."""

from __future__ import annotations

from pathlib import Path

from kiln.deploy.architecture import read_architecture
from kiln.deploy.hardware import parse_hardware
from kiln.deploy.plan_plot import plot_plan
from kiln.deploy.plan_schema import check_plan, plan_to_dict
from kiln.deploy.planner import Request, plan

LLAMA70 = read_architecture("llama-2-70b")


def test_the_frontier_is_every_memory_fitting_layout_no_other_beats_on_both_axes() -> None:
    got = plan(LLAMA70, parse_hardware("8xA100-80GB"), Request(max_ms_per_token=100.0))
    doc = check_plan(plan_to_dict(got, "llama-2-70b"))
    front = doc["frontier"]
    assert len(front) >= 2
    fits = [c for c in got.candidates if not any("memory" in v.constraint for v in c.violations)]
    for f in front:  # nothing that fits is both faster and cheaper than a frontier point
        assert not any(
            c.estimate.ms_per_token < f["ms_per_token"]
            and c.cost_per_1m_tokens < f["cost_per_1m_tokens_usd"]
            and c.feasible
            for c in fits
        )
    ms = [f["ms_per_token"] for f in front]
    cost = [f["cost_per_1m_tokens_usd"] for f in front]
    assert ms == sorted(ms) and cost == sorted(cost, reverse=True)  # a real trade-off curve


def test_the_picture_is_a_png(tmp_path: Path) -> None:
    got = plan(LLAMA70, parse_hardware("8xA100-80GB"), Request(max_ms_per_token=100.0))
    path = plot_plan(got, tmp_path / "plan.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    infeasible = plan(LLAMA70, parse_hardware("T4"), Request(allow_offload=False))
    assert not infeasible.feasible
    assert plot_plan(infeasible, tmp_path / "closest.png").stat().st_size > 10_000
