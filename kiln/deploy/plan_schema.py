"""The plan as a versioned JSON document, and its validation.

``plan_to_dict`` writes what ``kiln plan --json`` prints and ``--out`` saves; ``check_plan``
refuses a malformed, truncated or wrong-version document, naming the field. Schema
``kiln.plan/1`` (sizes in bytes, times in milliseconds, ppl_increase a fraction)::

    {"schema": "kiln.plan/1", "model": str, "hardware": str, "feasible": bool,
     "request": {"batch", "prompt_len", "gen_len", "max_ppl_increase", "max_ms_per_token",
                 "max_ttft_ms", "objective"},
     "layout": {"devices", "device_type", "tp", "pp", "stage_layers": [int], "batch",
                "offload"},
     "compression": {"format", "label", "weight_bytes", "bits_per_weight",
                     "layer_counts": {fmt: n}},
     "placement": {"device_bytes", "host_bytes", "disk_bytes"},
     "predicted": {"ms_per_token", "ttft_ms", "tokens_per_s", "peak_device_bytes",
                   "peak_host_bytes", "ppl_increase", "ppl_increase_source"},
     "cost_per_1m_tokens_usd": float,
     "violations": [{"constraint", "needed", "limit"}],
     "relaxations": [{"change", "plan": str}],
     "runners_up": [{"plan": str, "why_lost": str}],
     "frontier": [{"plan", "ms_per_token", "cost_per_1m_tokens_usd", "ppl_increase",
                   "feasible"}]}

``compression.format``: a planner format name, or a per-layer mix (``deploy.mixed``:
``mixed:`` and one letter per block linear); ``layer_counts`` then counts block linears
per format, otherwise blocks. ``label``: the format's short name for tables.

``frontier``: the layouts that fit in memory and that no other beats on both ms/token and
cost per token (the latency / cost Pareto frontier), fastest first.
"""

from __future__ import annotations

from typing import Any

from kiln.deploy.estimate import FORMATS
from kiln.deploy.mixed import is_mixed, parse_spec
from kiln.deploy.planner import Plan

SCHEMA = "kiln.plan/1"


class PlanError(ValueError):
    """A plan document kiln cannot use; the message names the field."""


def plan_to_dict(plan: Plan, model: str) -> dict[str, Any]:
    """The JSON document of ``plan`` for ``model`` (see the module docstring)."""
    best, req = plan.best, plan.request
    est, lay = best.estimate, best.estimate.layout
    offloaded = est.offloaded_bytes * lay.devices
    return {
        "schema": SCHEMA,
        "model": model,
        "hardware": best.hardware.spec,
        "feasible": plan.feasible,
        "request": {
            "batch": req.batch,
            "prompt_len": req.prompt_len,
            "gen_len": req.gen_len,
            "max_ppl_increase": req.max_ppl_increase,
            "max_ms_per_token": req.max_ms_per_token,
            "max_ttft_ms": req.max_ttft_ms,
            "objective": req.objective,
        },  # fmt: skip
        "layout": {
            "devices": lay.devices,
            "device_type": best.hardware.device.name,
            "tp": lay.tp,
            "pp": lay.pp,
            "stage_layers": list(est.stages),
            "batch": lay.batch,
            "offload": lay.offload,
        },
        "compression": {
            "format": lay.fmt.name,
            "label": lay.fmt.label,
            "weight_bytes": est.weight_bytes,
            "bits_per_weight": est.weight_bytes * 8 / plan.arch.total_params,
            "layer_counts": _layer_counts(lay.fmt.name, plan.arch.n_layers),
        },
        "placement": {
            "device_bytes": est.weight_bytes - offloaded,
            "host_bytes": offloaded if lay.offload == "host" else 0,
            "disk_bytes": offloaded if lay.offload == "disk" else 0,
        },
        "predicted": {
            "ms_per_token": est.ms_per_token,
            "ttft_ms": est.ttft_ms,
            "tokens_per_s": est.tokens_per_s,
            "peak_device_bytes": est.peak_device_bytes,
            "peak_host_bytes": est.peak_host_bytes,
            "ppl_increase": best.ppl_increase,
            "ppl_increase_source": best.ppl_source,
        },
        "cost_per_1m_tokens_usd": best.cost_per_1m_tokens,
        "violations": [
            {"constraint": v.constraint, "needed": v.needed, "limit": v.limit}
            for v in best.violations
        ],
        "relaxations": [{"change": what, "plan": c.describe()} for what, c in plan.relaxations],
        "runners_up": [{"plan": c.describe(), "why_lost": why} for c, why in plan.runners_up],
        "frontier": [
            {
                "plan": c.describe(),
                "ms_per_token": c.estimate.ms_per_token,
                "cost_per_1m_tokens_usd": c.cost_per_1m_tokens,
                "ppl_increase": c.ppl_increase,
                "feasible": c.feasible,
            }
            for c in plan.frontier
        ],  # fmt: skip
    }


def _layer_counts(fmt: str, n_layers: int) -> dict[str, int]:
    if not is_mixed(fmt):
        return {fmt: n_layers}
    formats = parse_spec(fmt)
    return {f: formats.count(f) for f in dict.fromkeys(formats)}


_REQUIRED: dict[str, dict[str, type | tuple[type, ...]]] = {
    "layout": {
        "devices": int,
        "device_type": str,
        "tp": int,
        "pp": int,
        "stage_layers": list,
        "batch": int,
        "offload": str,
    },  # fmt: skip
    "compression": {
        "format": str,
        "weight_bytes": int,
        "bits_per_weight": (int, float),
        "layer_counts": dict,
    },  # fmt: skip
    "placement": {"device_bytes": int, "host_bytes": int, "disk_bytes": int},
    "predicted": {
        "ms_per_token": (int, float),
        "ttft_ms": (int, float),
        "tokens_per_s": (int, float),
        "peak_device_bytes": int,
        "peak_host_bytes": int,
        "ppl_increase": (int, float),
    },  # fmt: skip
}


def check_plan(doc: Any) -> dict[str, Any]:
    """``doc`` if it is a valid ``kiln.plan/1`` document, else PlanError naming the field."""
    if not isinstance(doc, dict):
        raise PlanError(f"a plan is a JSON object, got {type(doc).__name__}")
    if doc.get("schema") != SCHEMA:
        raise PlanError(f"field 'schema': expected {SCHEMA!r}, got {doc.get('schema')!r}")
    for key, top in (("model", str), ("hardware", str), ("feasible", bool)):
        if not isinstance(doc.get(key), top):
            raise PlanError(f"field {key!r}: expected {top.__name__}, got {doc.get(key)!r}")
    for section, fields in _REQUIRED.items():
        part = doc.get(section)
        if not isinstance(part, dict):
            raise PlanError(f"field {section!r}: missing or not an object")
        for name, kind in fields.items():
            value = part.get(name)
            if isinstance(value, bool) or not isinstance(value, kind):
                raise PlanError(f"field '{section}.{name}': missing or wrong type ({value!r})")
    lay = doc["layout"]
    if lay["tp"] < 1 or lay["pp"] < 1 or lay["tp"] * lay["pp"] != lay["devices"]:
        raise PlanError("field 'layout': tp x pp must equal devices (each >= 1)")
    if len(lay["stage_layers"]) != lay["pp"]:
        raise PlanError("field 'layout.stage_layers': one entry per pipeline stage expected")
    if lay["offload"] not in ("none", "host", "disk"):
        raise PlanError(f"field 'layout.offload': none | host | disk, got {lay['offload']!r}")
    fmt = doc["compression"]["format"]
    if is_mixed(fmt):
        try:
            parse_spec(fmt)
        except ValueError as err:
            raise PlanError(f"field 'compression.format': {err}") from None
    elif fmt not in FORMATS:
        raise PlanError(f"field 'compression.format': {fmt!r} is not one of {sorted(FORMATS)} "
                        "nor a mixed format")  # fmt: skip
    return doc


def load_plan(path: str) -> dict[str, Any]:
    """Read and check a plan file; PlanError for unreadable, truncated or invalid ones."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as err:
        raise PlanError(f"{path}: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise PlanError(f"{path}: not valid JSON (truncated?): {err}") from None
    return check_plan(doc)
