"""``kiln plan``: read a model's shape and a hardware spec, plan, and return the document."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.deploy.architecture import Architecture, read_architecture
from kiln.deploy.estimate import Measurements
from kiln.deploy.hardware import Hardware, meminfo_bytes, parse_hardware
from kiln.deploy.mixed import (
    TARGETS,
    Sensitivity,
    calibration_of,
    frontier,
    is_mixed,
    label,
)
from kiln.deploy.mixed_measure import remember
from kiln.deploy.plan_quality import checkpoint_bytes
from kiln.deploy.plan_schema import check_plan, plan_to_dict
from kiln.deploy.planner import MIXED, Candidate, Plan, Request, accuracy_kind, plan
from kiln.models.config import ModelConfig

# Mixed per-layer plans measured on the search text before one is counted on (each is a
# scoring pass: 1-2 min on SmolLM2-135M here); measured ones are cached.
MIXED_ROUNDS = 4

if TYPE_CHECKING:
    from kiln.deploy.plan_quality import AccuracyCheck, MeasuredAccuracy


@dataclass
class PlanResult:
    """The plan, its JSON document, and where the document was written (if asked)."""

    plan: Plan
    document: dict[str, Any]
    written: Path | None


def plan_deployment(
    model: str, hardware: str, request: Request, out: str | None = None,
    note: Callable[[str], None] = lambda _: None, measure_accuracy: bool = True,
) -> PlanResult:  # fmt: skip
    """Plan ``model`` (a checkpoint or a config file) on ``hardware`` (a spec string or
    file) for ``request``; with ``out``, write the plan document there. ``note`` hears
    what is being measured (a CPU plan times this machine's engines the first time; with an
    accuracy budget and ``measure_accuracy``, each format's perplexity on a checkpoint that
    can be scored: ``format_accuracy``)."""
    arch = read_architecture(model)
    hw = parse_hardware(hardware)
    known = measurements(model, hw, note)
    scored = measure_accuracy and request.max_ppl_increase is not None and arch.config is not None
    if scored:
        known = replace(known, accuracy=format_accuracy(model, request.formats, note))
    sens = mixed_sensitivity(model, request, known, note) if scored else None
    if sens is not None:
        known = with_mixed(sens, request, with_measured_before(model, known))
    elif MIXED in request.formats:
        note("no per-layer mixed formats: they are planned for a checkpoint kiln can score "
             "against an accuracy budget (--max-ppl-increase)")  # fmt: skip
    result = plan(arch, hw, request, known=known)
    for _ in range(MIXED_ROUNDS):
        chosen = result.best
        if sens is None or not is_mixed(chosen.estimate.layout.fmt.name):
            break
        if accuracy_kind(chosen.ppl_source) == "measured":
            break
        known = with_mixed(sens, request, measure_mixed(model, chosen, known, note))
        result = plan(arch, hw, request, known=known)
    doc = check_plan(plan_to_dict(result, model))
    path = None
    if out:
        path = Path(out)
        path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return PlanResult(result, doc, path)


def mixed_sensitivity(
    model: str, request: Request, known: Measurements, note: Callable[[str], None]
) -> Sensitivity | None:
    """Checkpoint ``model``'s per-layer sensitivity over the request's INT8 / INT4 formats
    (``deploy.mixed``), when the request asks for mixed formats and the uniform formats
    were measured (the predictions are calibrated on those measurements)."""
    from kiln.deploy.mixed_measure import sensitivity_of
    from kiln.models.load import LoadError, resolve

    if MIXED not in request.formats or known.accuracy is None:
        return None
    try:
        resolve(model)
    except LoadError:  # a config file: nothing to calibrate
        return None
    return sensitivity_of(model, request.formats, note)


def with_mixed(sens: Sensitivity, request: Request, known: Measurements) -> Measurements:
    """``known`` with the allocator's mixed plans for ``request``, each one's accuracy its
    predicted upper bound from the calibration on what is measured so far; the plans
    measured already stay (their measurement is their accuracy)."""
    acc = known.accuracy
    upper, increase = (acc.upper, acc.increase) if acc is not None else ({}, {})
    cal = calibration_of(sens, increase, upper)
    budget = request.max_ppl_increase
    plans = frontier(sens, cal, (*TARGETS, budget) if budget is not None else TARGETS)
    kept = {spec: known.mixed[spec] for spec in known.mixed if spec in upper}
    return replace(known, mixed={**kept, **plans})


def with_measured_before(model: str, known: Measurements) -> Measurements:
    """``known`` with the mixed plans earlier searches measured on this checkpoint: the
    calibration starts from them, and any of them the search picks again is not measured
    again."""
    from kiln.deploy.mixed_measure import measured_before

    before, acc = measured_before(model), known.accuracy
    if not before or acc is None:
        return known
    upper = {spec: up for spec, (_, up) in before.items()}
    increase = {spec: inc for spec, (inc, _) in before.items()}
    return replace(known, accuracy=acc.merged(upper, increase), mixed={**known.mixed, **upper})


def measure_mixed(
    model: str, chosen: Candidate, known: Measurements, note: Callable[[str], None]
) -> Measurements:
    """``known`` with mixed plan ``chosen``'s perplexity increase measured on the search
    text (as the uniform formats were)."""
    from kiln.deploy.plan_quality import measure_formats

    spec = chosen.estimate.layout.fmt.name
    note(f"measuring the chosen per-layer plan {label(spec)} (predicted "
         f"{chosen.ppl_increase:+.2%})")  # fmt: skip
    got = measure_formats(model, [spec], note=note)
    acc = known.accuracy
    if got is None or acc is None:  # cannot happen after a sensitivity was built
        raise RuntimeError(f"{model}: the mixed plan could not be measured")
    note(f"{label(spec)}: measured {got.upper[spec]:+.2%} (95% upper bound)")
    remember(model, spec, got.increase[spec], got.upper[spec])
    return replace(known, accuracy=acc.merged(got.upper, got.increase),
                   mixed={**known.mixed, spec: got.upper[spec]})  # fmt: skip


def verify(result: PlanResult, model: str) -> dict[str, dict[str, float]]:
    """Execute the chosen plan here (a CPU plan; or a one-GPU plan on this machine's GPU)
    and put the measured figures beside the predicted ones: {figure: {"predicted",
    "measured", "error"}}."""
    import torch

    from kiln.deploy.execute import measure

    doc = result.document
    device = result.plan.best.hardware.device
    layout = dict(doc["layout"])
    if device.kind != "cpu":
        if not torch.cuda.is_available():
            raise ValueError("--verify executes plans for this machine: this one has no GPU "
                             "(--hardware cpu); a GPU plan's figures stay predictions")  # fmt: skip
        layout["device"] = "cuda"
    req = result.plan.request
    got = measure(model, layout, doc["compression"]["format"], req.prompt_len, req.gen_len)
    pred = doc["predicted"]
    pairs = {
        "ms_per_token": (pred["ms_per_token"], got.ms_per_token),
        "ttft_ms": (pred["ttft_ms"], got.ttft_ms),
        "peak_bytes": (float(pred["peak_device_bytes"]), float(got.peak_bytes)),
    }
    return {k: {"predicted": p, "measured": m, "error": p / m - 1} for k, (p, m) in pairs.items()}


def format_accuracy(
    model: str, formats: tuple[str, ...], note: Callable[[str], None]
) -> MeasuredAccuracy | None:
    """``formats``' perplexity increases measured on ``model`` (those kiln runs on this CPU;
    ``plan_quality.measure_formats``), or None where ``model`` is not a checkpoint here."""
    from kiln.deploy.kernel_rates import FORMATS as RUN_FORMATS
    from kiln.deploy.plan_quality import measure_formats
    from kiln.models.load import LoadError, resolve

    try:
        resolve(model)
    except LoadError:  # a config file: nothing to load and score
        return None
    runnable = [f for f in formats if f in RUN_FORMATS]
    return measure_formats(model, runnable, note=note) if runnable else None


def verify_accuracy(
    result: PlanResult, model: str, tokens: int, note: Callable[[str], None] = lambda _: None
) -> AccuracyCheck:
    """The chosen plan's perplexity increase on ``model``, measured on ``tokens`` tokens of
    the confirmation text beside its prior and budget (``plan_quality``)."""
    from kiln.deploy.plan_quality import check_accuracy

    doc = result.document
    return check_accuracy(model, doc["compression"]["format"], doc["predicted"]["ppl_increase"],
                          result.plan.request.max_ppl_increase, tokens, note)  # fmt: skip


def measurements(
    model: str, hw: Hardware, note: Callable[[str], None] = lambda _: None,
    per_architecture: bool = True,
) -> Measurements:  # fmt: skip
    """What kiln can measure for planning ``model`` on ``hw``: the checkpoint's size, and on
    this CPU its engines' measured costs at the thread count of every rank count the plan
    may use — the calibration's table (``kiln calibrate``), with every engine re-timed on
    the model's own blocks and vocabulary (``arch_rates``) unless ``per_architecture`` is
    off or the model has no shape kiln builds. Both are cached after the first plan;
    measuring a missing table takes minutes."""
    if hw.device.kind != "cpu":
        return Measurements(checkpoint_bytes(model))
    from kiln.deploy.estimate_cpu import threads_per_rank
    from kiln.deploy.rates_table import load_rates

    cores = len(os.sched_getaffinity(0))
    threads = {threads_per_rank(cores, ranks) for ranks in range(1, hw.count + 1)}
    rates = {t: load_rates(t, note=note) for t in sorted(threads, reverse=True)}
    cfg = read_architecture(model).config if per_architecture else None
    if cfg is not None and probe_fits(cfg, note):
        from kiln.deploy.arch_rates import load_arch_rates, with_layouts

        rates = {t: with_layouts(table, load_arch_rates(cfg, t, cores, note))
                 for t, table in rates.items()}  # fmt: skip
    return Measurements(checkpoint_bytes(model), rates, cores)


def probe_fits(cfg: ModelConfig, note: Callable[[str], None]) -> bool:
    """Whether timing ``cfg``'s blocks here leaves room: the larger fp32 probe (its head
    included) within a third of the memory available now. Otherwise the plan is
    priced with the calibration's shapes alone, and ``note`` says so."""
    from kiln.deploy.arch_rates import probe_config, probe_layers

    probe = Architecture.from_model_config(probe_config(cfg, max(probe_layers(cfg))), "", "")
    need, have = 4 * probe.total_params, meminfo_bytes("MemAvailable")
    if need <= have / 3:
        return True
    note(f"not timing this model's blocks: its probe needs {need / 1e9:.1f} GB of the "
         f"{have / 1e9:.1f} GB available; priced with the calibration's shapes")  # fmt: skip
    return False


def request_from_plan(
    doc: dict[str, Any], prompt: str, max_new_tokens: int, offload_dir: str | None = None,
    **options: Any,
) -> Any:  # fmt: skip
    """The ``GenerateRequest`` that executes plan document ``doc`` (checked) on this machine:
    its checkpoint, weight format, ranks and stage split, and a disk offload store in
    ``offload_dir`` when the plan streams its blocks. ``options``: sampling, chat, ..."""
    import torch

    from kiln.deploy.generate_job import GenerateRequest

    doc = check_plan(doc)
    lay = doc["layout"]
    on_gpu = lay["device_type"] != "cpu"
    if on_gpu and not torch.cuda.is_available():
        raise ValueError(f"this plan is for {lay['devices']} x {lay['device_type']}; this "
                         "machine has no GPU (plan again with --hardware cpu)")  # fmt: skip
    if lay["offload"] == "host" and not on_gpu:
        raise ValueError("a CPU plan cannot offload to host memory (it is the device)")
    if on_gpu and (lay["offload"] != "none" or lay["tp"] * lay["pp"] > 1):
        raise ValueError("kiln executes GPU plans on one device with every weight in its "
                         f"memory; this one has tp {lay['tp']}, pp {lay['pp']}, offload "
                         f"{lay['offload']} (emit it for another engine: --emit vllm)")  # fmt: skip
    if lay["offload"] != "none" and offload_dir is None:
        raise ValueError("this plan streams its blocks from disk: give a folder for the store")
    parallel = lay["tp"] * lay["pp"] > 1
    return GenerateRequest(
        checkpoint=doc["model"], prompt=prompt, max_new_tokens=max_new_tokens,
        weights=doc["compression"]["format"], tp=lay["tp"], pp=lay["pp"],
        split=tuple(lay["stage_layers"]) if lay["pp"] > 1 else None,
        offload=offload_dir if lay["offload"] != "none" else None,
        engine="eager" if parallel or lay["offload"] != "none" else "auto",
        packed=False, device="cuda" if on_gpu else "cpu", **options,
    )  # fmt: skip
