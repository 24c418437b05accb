"""The deployment planner on paper: published feasibility, explanations, the plan document.

Every figure here is kiln's prediction (no GPU is involved). The published facts checked
come from the models' own releases: GLM-130B's repository lists INT4 on 4 x RTX 3090 without
offload, INT4 on 8 x RTX 2080 Ti only with offload, INT8 on 8 x RTX 3090, FP16 on 8 x
A100-40GB, and its users saw about 88 GB in use for INT4 (one A100-80GB cannot hold it);
Llama-2-70B in FP16 (138 GB of weights) needs at least two 80 GB devices.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.deploy import architecture
from kiln.deploy.architecture import read_architecture
from kiln.deploy.estimate import Measurements
from kiln.deploy.hardware import parse_hardware
from kiln.deploy.plan_quality import MeasuredAccuracy
from kiln.deploy.plan_schema import PlanError, check_plan, load_plan, plan_to_dict
from kiln.deploy.planner import PRIOR_NOTE, PRIORS, Request, accuracy_of, evaluate, layouts, plan

CONFIGS = architecture.CONFIGS
GLM = read_architecture(str(CONFIGS / "glm-130b.json"))
LLAMA70 = read_architecture(str(CONFIGS / "llama-2-70b.json"))
# GLM-130B's published figures are for serving its full 2048-token sequence.
GLM_FULL = {"prompt_len": 1920, "gen_len": 128}


def _fits(spec: str, fmt: str, offload: bool) -> tuple[bool, int]:
    """Whether GLM-130B in ``fmt`` fits ``spec`` (all its devices), and the devices used."""
    p = plan(GLM, parse_hardware(spec), Request(formats=(fmt,), allow_offload=offload, **GLM_FULL))
    return p.feasible, p.best.estimate.layout.devices


@pytest.mark.parametrize(
    ("spec", "fmt", "offload", "fits"),
    [
        ("4xRTX3090", "int4-g128", False, True),
        ("8xRTX2080Ti", "int4-g128", False, False),
        ("8xRTX2080Ti", "int4-g128", True, True),
        ("4xRTX3090", "int8", False, False),
        ("8xRTX3090", "int8", False, True),
        ("8xRTX3090", "fp16", False, False),
        ("8xA100-40GB", "fp16", False, True),
        ("A100-80GB", "int4-g128", False, False),
        ("A100-80GB", "int4-g128", True, True),
    ],
)
def test_glm130b_published_feasibility(spec: str, fmt: str, offload: bool, fits: bool) -> None:
    assert _fits(spec, fmt, offload)[0] is fits


def test_llama70b_fp16_needs_two_a100_80gb() -> None:
    one = plan(
        LLAMA70, parse_hardware("A100-80GB"), Request(formats=("fp16",), allow_offload=False)
    )
    two = plan(
        LLAMA70, parse_hardware("2xA100-80GB"), Request(formats=("fp16",), allow_offload=False)
    )
    assert not one.feasible and two.feasible
    assert [v.constraint for v in one.best.violations] == ["device memory (bytes)"]
    assert any("2 devices" in what for what, _ in one.relaxations)


def test_infeasible_request_names_misses_and_relaxations() -> None:
    request = Request(max_ppl_increase=0.01, max_ms_per_token=300, **GLM_FULL)
    p = plan(GLM, parse_hardware("4xRTX3090"), request)
    assert not p.feasible
    assert p.best.violations  # each with needed > limit
    assert all(v.needed > v.limit for v in p.best.violations)
    changes = [what for what, _ in p.relaxations]
    assert any("devices" in c for c in changes) and any("accuracy budget" in c for c in changes)
    for _, cand in p.relaxations:  # every relaxation really is feasible
        assert cand.feasible


def test_memory_is_bounded_below_by_what_is_stored() -> None:
    hw = parse_hardware("8xA100-80GB")
    request = Request(batch=4, prompt_len=1024, gen_len=256)
    for lay in layouts(LLAMA70, hw, request):
        est = evaluate(LLAMA70, hw, lay, request).estimate
        resident = est.device_weight_bytes - est.offloaded_bytes
        assert est.peak_device_bytes >= resident + est.kv_bytes + est.activation_bytes
        stored = est.weight_bytes / lay.devices
        assert est.device_weight_bytes >= stored * 0.99  # the busiest device holds its share


def test_more_devices_never_need_more_memory_each() -> None:
    request = Request(formats=("fp16",), allow_offload=False)
    peaks = []
    for n in (1, 2, 4, 8):
        hw = parse_hardware(f"{n}xA100-80GB")
        lay = [x for x in layouts(LLAMA70, hw, request) if x.devices == n and x.tp == n][0]
        peaks.append(evaluate(LLAMA70, hw, lay, request).estimate.peak_device_bytes)
    assert peaks == sorted(peaks, reverse=True)


def test_beats_the_obvious_choices_for_70b_on_a100s() -> None:
    hw = parse_hardware("8xA100-80GB")
    request = Request(max_ms_per_token=100)
    best = plan(LLAMA70, hw, request)
    assert best.feasible
    obvious_fp16 = plan(
        LLAMA70, hw, Request(max_ms_per_token=100, formats=("fp16",), allow_offload=False)
    )
    one_gpu_int4 = plan(LLAMA70, parse_hardware("A100-80GB"), Request(formats=("int4-g128",)))
    assert best.best.cost_per_1m_tokens <= obvious_fp16.best.cost_per_1m_tokens
    assert best.best.cost_per_1m_tokens <= one_gpu_int4.best.cost_per_1m_tokens


def test_an_80_layer_model_plans_fast() -> None:
    t0 = time.perf_counter()
    plan(
        LLAMA70, parse_hardware("8xA100-80GB"), Request(max_ms_per_token=50, max_ppl_increase=0.005)
    )
    assert time.perf_counter() - t0 < 10.0


def test_plan_document_round_trip_and_refusals(tmp_path: Path) -> None:
    doc = plan_to_dict(plan(LLAMA70, parse_hardware("2xA100-80GB"), Request()), "llama-2-70b")
    assert check_plan(json.loads(json.dumps(doc))) == json.loads(json.dumps(doc))
    assert doc["predicted"]["ppl_increase_source"].startswith("prior")
    for field, value, named in [
        ("schema", "kiln.plan/0", "schema"),
        ("layout", {**doc["layout"], "tp": 3}, "layout"),
        (
            "predicted",
            {k: v for k, v in doc["predicted"].items() if k != "ttft_ms"},
            "predicted.ttft_ms",
        ),
    ]:
        with pytest.raises(PlanError, match=named.replace(".", r"\.")):
            check_plan({**doc, field: value})
    truncated = tmp_path / "plan.json"
    truncated.write_text(json.dumps(doc)[:200])
    with pytest.raises(PlanError, match="not valid JSON"):
        load_plan(str(truncated))


def test_cli_plan_prints_json() -> None:
    cmd = [sys.executable, "-m", "kiln.cli", "plan", str(CONFIGS / "glm-130b.json"),
           "--hardware", "4xRTX3090", "--formats", "int4-g128", "--json"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    doc = check_plan(json.loads(out.stdout))
    assert (
        doc["feasible"]
        and doc["layout"]["devices"] == 4
        and doc["layout"]["tp"] * doc["layout"]["pp"] == 4
    )
    for key in ("compression", "placement", "predicted", "violations", "relaxations"):
        assert key in doc


def test_a_batch_search_finds_cheaper_tokens_within_the_latency_target() -> None:
    base = Request(batch=1, prompt_len=2048, gen_len=256, max_ms_per_token=60.0)
    one = plan(LLAMA70, parse_hardware("8xA100-40GB"), base)
    many = plan(
        LLAMA70, parse_hardware("8xA100-40GB"), Request(**{**base.__dict__, "max_batch": 64})
    )
    assert one.feasible and many.feasible
    assert many.best.estimate.layout.batch > 1
    assert many.best.cost_per_1m_tokens < one.best.cost_per_1m_tokens
    assert many.best.estimate.ms_per_token <= 60.0
    assert Request(batch=3, max_batch=20).batches == [3, 4, 8, 16, 20]
    with pytest.raises(ValueError, match="below batch"):
        Request(batch=8, max_batch=4)


def _measured(upper: dict[str, float]) -> Measurements:
    return Measurements(accuracy=MeasuredAccuracy(upper, "measured: 95% upper bound on test"))


def test_measured_accuracy_replaces_the_prior_where_it_exists() -> None:
    known = _measured({"int8": 0.004, "int4-g128": 0.25})
    assert accuracy_of("int8", known) == (0.004, "measured: 95% upper bound on test")
    assert accuracy_of("int4-g64", known) == (PRIORS["int4-g64"], f"prior: {PRIOR_NOTE}")
    assert accuracy_of("int4-g128")[0] == PRIORS["int4-g128"]  # nothing measured


def test_a_format_measured_over_budget_is_not_chosen() -> None:
    """On priors INT4 (2%) meets a 5% budget and is the cheapest; measured at +25% (a small
    model, SmolLM2's figure) the plan falls back to INT8, labelled measured."""
    qwen, hw = read_architecture("qwen2-0.5b"), parse_hardware("L4")
    req = Request(max_ppl_increase=0.05, formats=("fp16", "int8", "int4-g128"),
                  allow_offload=False)  # fmt: skip
    assert plan(qwen, hw, req).best.estimate.layout.fmt.name == "int4-g128"
    got = plan(qwen, hw, req, known=_measured({"int8": 0.004, "int4-g128": 0.25}))
    assert got.feasible and got.best.estimate.layout.fmt.name == "int8"
    doc = plan_to_dict(got, "qwen2-0.5b")
    assert doc["predicted"]["ppl_increase"] == 0.004
    assert doc["predicted"]["ppl_increase_source"].startswith("measured")
    int4 = next(c for c in got.candidates if c.estimate.layout.fmt.name == "int4-g128")
    assert [v.constraint for v in int4.violations] == ["perplexity increase (measured)"]


def test_a_measured_accuracy_miss_is_relaxed_by_its_measured_figure() -> None:
    qwen, hw = read_architecture("qwen2-0.5b"), parse_hardware("L4")
    req = Request(max_ppl_increase=0.001, formats=("int8",), allow_offload=False)
    got = plan(qwen, hw, req, known=_measured({"int8": 0.004}))
    assert not got.feasible
    changes = [change for change, _ in got.relaxations]
    assert "accuracy budget 0.4% (int8, measured)" in changes
