"""Per-layer mixed weight formats in the planner: the spec, execution, pricing, the
allocator's frontier and the search that measures the mixed plan it would choose."""

from __future__ import annotations

import copy
import itertools
import math
from typing import Any

import pytest
import torch

from kiln.compress import Int4WeightOnly, Int8WeightOnly, quantize_
from kiln.compress.modules import Int4Linear, Int8Linear
from kiln.deploy import mixed, mixed_measure, plan_job
from kiln.deploy.architecture import Architecture, read_architecture
from kiln.deploy.estimate import FORMATS, Measurements, mixed_format
from kiln.deploy.estimate_cpu import blend
from kiln.deploy.hardware import parse_hardware
from kiln.deploy.kernel_rates import Cost
from kiln.deploy.plan_quality import MeasuredAccuracy
from kiln.deploy.plan_schema import PlanError, check_plan, plan_to_dict
from kiln.deploy.planner import Request, plan
from kiln.deploy.weights import load_format, store_in_format
from kiln.models.config import ModelConfig
from kiln.models.transformer import Transformer

TINY = ModelConfig(family="llama", vocab_size=128, hidden_size=128, n_layers=2, n_heads=4,
                   n_kv_heads=2, head_dim=32, intermediate_size=256, max_positions=64)  # fmt: skip
PER_BLOCK = 7  # q, k, v, o, gate, up, down


def test_spec_round_trip_and_refusals() -> None:
    formats = ["int8", "int4-g128", "int4-g64", "int4-g32"] * 2
    spec = mixed.spec_of(formats)
    assert spec == "mixed:8abc8abc" and mixed.parse_spec(spec) == formats
    with pytest.raises(ValueError, match="letters must be from"):
        mixed.parse_spec("mixed:8x")
    with pytest.raises(ValueError, match="not"):
        mixed.spec_of(["fp32"])
    arch = Architecture.from_model_config(TINY, "tiny", "test")
    with pytest.raises(ValueError, match="another model"):
        mixed_format("mixed:8a", arch)


def test_a_plan_document_with_a_malformed_mixed_format_is_refused() -> None:
    qwen = read_architecture("qwen2-0.5b")
    spec = "mixed:" + "8a" * (qwen.n_layers * PER_BLOCK // 2)
    doc = plan_to_dict(_plan_with(qwen, {spec: 0.004}, budget=0.01), "qwen2-0.5b")
    assert doc["compression"]["format"] == spec
    assert check_plan(doc) is doc
    assert sum(doc["compression"]["layer_counts"].values()) == qwen.n_layers * PER_BLOCK
    doc["compression"]["format"] = "mixed:8z"
    with pytest.raises(PlanError, match="compression.format"):
        check_plan(doc)
    doc["compression"]["format"] = "int3"
    with pytest.raises(PlanError, match="compression.format"):
        check_plan(doc)


def _reference(model: Transformer, formats: list[str]) -> Transformer:
    """``model`` with each block linear quantized on its own, by name (the spec not used)."""
    names = [n for n, m in model.named_modules()
             if n.startswith("layers.") and isinstance(m, torch.nn.Linear)]  # fmt: skip
    out = copy.deepcopy(model)
    for name, fmt in zip(names, formats, strict=True):
        config: Int8WeightOnly | Int4WeightOnly = (
            Int8WeightOnly() if fmt == "int8" else Int4WeightOnly(group_size=int(fmt[6:]))
        )

        def this_one(_m: torch.nn.Module, n: str, name: str = name) -> bool:
            return n == name

        quantize_(out, config, filter_fn=this_one)
    return out


def test_a_mixed_format_stores_each_layer_in_its_own_format() -> None:
    torch.manual_seed(0)
    model = Transformer(TINY).eval()
    formats = [["int8", "int4-g32", "int4-g64", "int4-g128"][i % 4] for i in range(2 * PER_BLOCK)]
    spec = mixed.spec_of(formats)
    ref = _reference(model, formats)
    got = store_in_format(copy.deepcopy(model), spec)
    kinds = [(n, type(m).__name__, getattr(m, "group_size", None))
             for n, m in got.named_modules()
             if n.startswith("layers.") and isinstance(m, Int8Linear | Int4Linear)]  # fmt: skip
    assert [k[1] for k in kinds] == ["Int8Linear" if f == "int8" else "Int4Linear" for f in formats]
    assert [k[2] for k in kinds if k[1] == "Int4Linear"] == [
        int(f[6:]) for f in formats if f != "int8"
    ]
    ids = torch.randint(0, TINY.vocab_size, (2, 16))
    # every block linear against the reference's, quantized on its own
    for a, b in zip(got.layers, ref.layers, strict=True):
        for (na, ma), (nb, mb) in zip(a.named_modules(), b.named_modules(), strict=True):
            assert na == nb and type(ma) is type(mb)
            if isinstance(ma, Int8Linear | Int4Linear):
                x = torch.randn(3, ma.in_features)
                torch.testing.assert_close(ma(x), mb(x), rtol=0, atol=0)
    # a streaming load's per-block hook stores the same
    dtype, hook = load_format(spec)
    assert dtype == torch.float32 and hook is not None
    streamed = copy.deepcopy(model)
    for i, block in enumerate(streamed.layers):
        hook(i, block)  # type: ignore[arg-type]
    store_in_format(streamed, spec)  # the blocks are kept, the head quantized
    torch.testing.assert_close(
        streamed(ids, 0, streamed.new_cache(2, 16)), got(ids, 0, got.new_cache(2, 16)),
        rtol=0, atol=0,
    )  # fmt: skip


def test_blended_engines_price_each_part_at_its_own_rate() -> None:
    rates = {
        "fast-int8": {1: Cost(10.0, 1e-4), 4: Cost(20.0, 1e-4)},
        "fast-int4-g64": {1: Cost(25.0, 3e-4)},
        "prefill-int8": {64: Cost(100.0, 0.0)},
        "prefill-int4-g64": {64: Cost(50.0, 1e-3)},
        "eager-int8": {1: Cost(5.0, 0.0)},  # no int4 twin: not blended
    }
    mix = mixed.Shares((("int8", 0.6, 0.4), ("int4-g64", 0.4, 0.6)), 6.0)
    got = blend(rates, "mixed:x", mix)
    assert set(got) == {"fast-mixed:x", "prefill-mixed:x"}
    assert set(got["fast-mixed:x"]) == {1}  # the rows both parts measured
    nbytes, blocks = 3e8, 5
    want = (0.6 * nbytes / 10e9 + 0.4 * nbytes / 25e9) + blocks * (0.4 * 1e-4 + 0.6 * 3e-4)
    assert math.isclose(got["fast-mixed:x"][1].seconds(nbytes, blocks), want, rel_tol=1e-12)
    flops = 2e11  # a prefill's FLOPs divide like the parameters
    want = 0.4 * flops / 100e9 + 0.6 * flops / 50e9 + blocks * 0.6 * 1e-3
    assert math.isclose(got["prefill-mixed:x"][64].seconds(flops, blocks), want, rel_tol=1e-12)


def _sens(losses: list[float]) -> mixed.Sensitivity:
    """Layers with an INT8 option (100 bytes, loss 0.001) and an INT4 one (50 bytes)."""
    return mixed.Sensitivity(tuple((("int8", 100, 0.001), ("int4-g64", 50, loss))
                                   for loss in losses))  # fmt: skip


def _brute_force(sens: mixed.Sensitivity) -> list[tuple[int, float, list[str]]]:
    out = []
    for pick in itertools.product(*sens.layers):
        out.append(
            (sum(n for _, n, _ in pick), sum(x for _, _, x in pick), [f for f, _, _ in pick])
        )
    return out


def test_the_frontier_is_the_smallest_plan_predicted_within_each_target() -> None:
    sens = _sens([0.002, 0.05, 0.01, 0.2])
    assert sens.uniform_loss() == pytest.approx({"int8": 0.004, "int4-g64": 0.262})
    cal = mixed.Calibration(2.0, ((0.001, 0.002), (0.1, 0.02)))  # margins grow with increase
    targets = [0.01, 0.03, 0.1, 0.5]
    got = mixed.frontier(sens, cal, targets)
    every = _brute_force(sens)
    assert got, "plans between the uniform ones"
    for target in targets:
        fits = [e for e in every if cal.upper(e[1]) <= target]
        if not fits:  # 1%: even INT8 is predicted over it
            assert target == 0.01
            continue
        best = min(fits, key=lambda e: (e[0], e[1]))
        if len(set(best[2])) > 1:  # the allocator's plan for this target is offered
            spec = mixed.spec_of(best[2])
            assert spec in got and got[spec] == pytest.approx(cal.upper(best[1]))
    for spec, upper in got.items():
        assert len(set(mixed.parse_spec(spec))) == 2  # the uniform plans are not repeated
        assert upper <= max(targets) and upper == pytest.approx(cal.upper(sens.loss_of(spec)))


def test_the_calibration_scales_the_loss_beyond_the_anchor_where_it_stands_clear() -> None:
    sens = _sens([0.002, 0.05, 0.01, 0.2])  # INT8 0.004 in all, INT4 0.262
    assert mixed.calibration_of(sens, {}, {}).scale == 1.0
    # INT8 (the anchor) measured at 0.002; INT4 at 1.5x the loss beyond INT8's, clear
    inc = {"int8": math.expm1(0.002), "int4-g64": math.expm1(0.002 + 1.5 * 0.258)}
    up = {"int8": inc["int8"] + 0.01, "int4-g64": inc["int4-g64"] + 0.05}
    cal = mixed.calibration_of(sens, inc, up)
    assert cal.scale == pytest.approx(1.5)
    assert cal.increase(0.004) == pytest.approx(inc["int8"])  # the anchor as measured
    assert cal.increase(0.262) == pytest.approx(inc["int4-g64"])
    assert cal.margin(inc["int8"]) == pytest.approx(0.01)
    assert cal.margin(inc["int4-g64"]) == pytest.approx(0.05)
    assert cal.upper(0.262) == pytest.approx(inc["int4-g64"] + 0.05)
    # a mixed plan measured at 4x its excess raises the scale for every other plan
    spec = mixed.spec_of(["int4-g64", "int8", "int8", "int8"])
    excess = sens.loss_of(spec) - 0.004
    inc[spec] = math.expm1(0.002 + 4 * excess)
    up[spec] = inc[spec] + 0.001
    assert mixed.calibration_of(sens, inc, up).scale == pytest.approx(4.0)
    # one inside its margin counts only when nothing stands clear
    del inc["int4-g64"], up["int4-g64"]
    up[spec] = 2 * inc[spec] + 0.001
    assert mixed.calibration_of(sens, inc, up).scale == pytest.approx(4.0)


def _plan_with(arch: Architecture, predicted: dict[str, float], budget: float,
               measured: dict[str, float] | None = None) -> Any:  # fmt: skip
    upper = {"int8": 0.005, "int4-g64": 0.04, **(measured or {})}
    known = Measurements(accuracy=MeasuredAccuracy(upper, "measured: test"), mixed=predicted)
    req = Request(max_ppl_increase=budget, formats=("int8", "int4-g64", "mixed"),
                  allow_offload=False)  # fmt: skip
    return plan(arch, parse_hardware("L4"), req, known=known)


def _half_int4(arch: Architecture) -> str:
    n = arch.n_layers * PER_BLOCK
    return mixed.spec_of(["int4-g64" if i % 2 else "int8" for i in range(n)])


def test_the_planner_chooses_a_mixed_plan_within_budget_and_labels_it_predicted() -> None:
    qwen = read_architecture("qwen2-0.5b")
    spec = _half_int4(qwen)
    got = _plan_with(qwen, {spec: 0.008}, budget=0.01)
    fmt = got.best.estimate.layout.fmt
    assert got.feasible and fmt.name == spec
    assert FORMATS["int4-g64"].bits < fmt.bits < FORMATS["int8"].bits
    doc = plan_to_dict(got, "qwen2-0.5b")
    assert doc["predicted"]["ppl_increase_source"] == mixed.SOURCE
    assert doc["compression"]["label"].startswith("mixed-")
    # measured over the budget, it is not chosen: INT8 is
    again = _plan_with(qwen, {spec: 0.008}, budget=0.01, measured={spec: 0.013})
    assert again.best.estimate.layout.fmt.name == "int8"


def test_plan_deployment_measures_the_mixed_plan_before_counting_on_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The per-layer prediction is 3x low: the first mixed plan chosen measures over
    budget, the calibration is refitted on it, and the search goes on until the plan
    it settles on was measured within budget (or is a uniform format)."""
    qwen = read_architecture("qwen2-0.5b")
    n = qwen.n_layers * PER_BLOCK
    rng = torch.Generator().manual_seed(0)
    losses = (torch.rand(n, generator=rng) * 1e-3).tolist()
    sens = mixed.Sensitivity(tuple((("int8", 800, loss / 50), ("int4-g64", 450, loss))
                                   for loss in losses))  # fmt: skip
    measured: list[str] = []

    base8 = sum(losses) / 50  # INT8's predicted loss

    def measure_formats(model: str, formats: list[str], **_: Any) -> MeasuredAccuracy:
        measured.extend(formats)
        # the truth: INT8 as predicted, 3x the prediction beyond it
        inc = {f: math.expm1(base8 + 3 * (sens.loss_of(f) - base8)) for f in formats}
        return MeasuredAccuracy({f: x + 0.001 for f, x in inc.items()}, "measured: test", inc)

    inc8, inc4 = math.expm1(base8), math.expm1(sum(losses))  # the uniform plans, as predicted
    base = MeasuredAccuracy({"int8": inc8 + 0.001, "int4-g64": inc4 + 0.01}, "measured: test",
                            {"int8": inc8, "int4-g64": inc4})  # fmt: skip
    monkeypatch.setattr(plan_job, "measurements", lambda *a, **k: Measurements())
    monkeypatch.setattr(plan_job, "format_accuracy", lambda *a, **k: base)
    monkeypatch.setattr(plan_job, "mixed_sensitivity", lambda *a, **k: sens)
    monkeypatch.setattr("kiln.deploy.plan_quality.measure_formats", measure_formats)
    kept: dict[str, tuple[float, float]] = {}
    monkeypatch.setattr("kiln.deploy.mixed_measure.measured_before", lambda model: dict(kept))
    monkeypatch.setattr(plan_job, "remember", lambda m, spec, i, u: kept.update({spec: (i, u)}))
    budget = 0.05
    req = Request(max_ppl_increase=budget, formats=("int8", "int4-g64", "mixed"),
                  allow_offload=False)  # fmt: skip
    doc = plan_job.plan_deployment("qwen2-0.5b", "L4", req).document
    assert measured, "the mixed plan first chosen was measured"
    first = measured[0]
    assert math.expm1(base8 + 3 * (sens.loss_of(first) - base8)) + 0.001 > budget  # over
    fmt = doc["compression"]["format"]
    if mixed.is_mixed(fmt):  # the final mixed plan was measured, and within budget
        assert fmt in measured and doc["predicted"]["ppl_increase_source"].startswith("measured")
    assert doc["predicted"]["ppl_increase"] <= budget
    assert fmt != "int8", "a mixed plan smaller than INT8 meets a 5% budget"
    # every measurement was kept; planning again measures nothing and chooses the same
    assert set(kept) == set(measured)
    n_measured = len(measured)
    again = plan_job.plan_deployment("qwen2-0.5b", "L4", req).document
    assert len(measured) == n_measured and again["compression"]["format"] == fmt


def test_measured_mixed_plans_are_kept_per_checkpoint(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setenv("KILN_PLAN_MIXED_DIR", str(tmp_path))
    monkeypatch.setattr("kiln.deploy.plan_quality.checkpoint_key", lambda model: f"key:{model}")
    assert mixed_measure.measured_before("a") == {}
    mixed_measure.remember("a", "mixed:8a", 0.01, 0.015)
    mixed_measure.remember("a", "mixed:a8", 0.02, 0.03)
    mixed_measure.remember("b", "mixed:aa", 0.5, 0.6)
    assert mixed_measure.measured_before("a") == {
        "mixed:8a": (0.01, 0.015),
        "mixed:a8": (0.02, 0.03),
    }
    assert mixed_measure.measured_before("b") == {"mixed:aa": (0.5, 0.6)}


def test_a_model_too_large_to_calibrate_here_says_so(tmp_path: Any) -> None:
    """Qwen2-1.5B's per-layer statistics alone (a 8960 x 8960 moment per MLP down
    projection, 28 of them) need about 9 GB: refused on 16 GB available, taken on 256."""
    assert mixed_measure.calibration_bytes("qwen2-1.5b") > 9e9 + 4 * 1.5e9
    small, large = tmp_path / "small", tmp_path / "large"
    small.write_text("MemAvailable:   16000000 kB\n")
    large.write_text("MemAvailable:   256000000 kB\n")
    why = mixed_measure.too_large_to_calibrate("qwen2-1.5b", str(small))
    assert why is not None and "layer by layer" in why
    assert mixed_measure.too_large_to_calibrate("qwen2-1.5b", str(large)) is None
