"""``kiln plan``: read a model's shape and a hardware spec, plan, and return the document."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.deploy.architecture import read_architecture
from kiln.deploy.hardware import parse_hardware
from kiln.deploy.plan_schema import check_plan, plan_to_dict
from kiln.deploy.planner import Plan, Request, plan


@dataclass
class PlanResult:
    """The plan, its JSON document, and where the document was written (if asked)."""

    plan: Plan
    document: dict[str, Any]
    written: Path | None


def plan_deployment(
    model: str, hardware: str, request: Request, out: str | None = None
) -> PlanResult:
    """Plan ``model`` (a checkpoint or a config file) on ``hardware`` (a spec string or
    file) for ``request``; with ``out``, write the plan document there."""
    arch = read_architecture(model)
    hw = parse_hardware(hardware)
    result = plan(arch, hw, request)
    doc = check_plan(plan_to_dict(result, model))
    path = None
    if out:
        path = Path(out)
        path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return PlanResult(result, doc, path)
