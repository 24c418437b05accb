"""The planner's predictions against execution on this CPU: ``python -m kiln.bench.plan_accuracy``.

For each plan of a fixed list (``PLANS``: SmolLM2's real GGUF and two published
architectures with random weights, Qwen2-0.5B and 1.5B; weight format, SmolLM2's
per-layer mix for a 5% budget included, x batch 1 / 4 x tensor- and pipeline-parallel
ranks x disk offload under a RAM limit), the planner's
estimate for its hardware spec is put beside the plan executed in a fresh process
(``kiln.deploy.execute.measure``: decode ms/token, time to first token, peak RSS of every
process of the plan). Reported: each relative error, their median and worst, whether
predicted memory was ever more than 5% below the measured peak, and whether an executed
plan exceeded its RAM limit (docs/benchmarks.md, "Large-model measurements").

    python -m kiln.bench.plan_accuracy [--only smollm2,qwen2-0.5b] [--prompt-len 64]
    python -m kiln.bench.plan_accuracy --rescore results/plan-accuracy-....json

Each plan is also priced from the calibration's two shapes alone (``per_architecture``
off: without timing the model's own blocks) against the same runs, the A/B of
``kiln.deploy.arch_rates``.

``--gpu`` does the same for one-GPU plans on this machine's CUDA device (``GPU_PLANS``,
planned for ``1x<its catalog name>``): the device's launch costs are calibrated first
(``kiln calibrate``'s GPU profile, micro-benchmarks only: the plans' runs are not fitted),
each plan loads straight onto the GPU and decodes with the CUDA-graph step, and its peak
memory is the GPU's (``execute.peak_device_bytes``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.bench import RESULTS_DIR, system
from kiln.bench.random_checkpoint import random_checkpoint
from kiln.deploy import parse
from kiln.deploy.architecture import published_config, read_architecture
from kiln.deploy.estimate import FORMATS, Layout, mixed_format
from kiln.deploy.execute import Measured, measure
from kiln.deploy.hardware import parse_hardware
from kiln.deploy.mixed import is_mixed
from kiln.deploy.plan_job import measurements, plan_deployment
from kiln.deploy.planner import MIXED, Request, activation_bytes, evaluate


@dataclass(frozen=True)
class PlanSpec:
    """One executed plan: the model, its layout, and the hardware spec it is planned for
    (``Nxcpu``: N ranks of this host; ``cpu,ram=2GB``: a RAM limit that forces offload).
    ``fmt`` ``mixed@B``: the per-layer mix ``kiln plan`` chooses for a budget of B
    (``plan_format``)."""

    model: str
    fmt: str
    batch: int
    tp: int = 1
    pp: int = 1
    offload: str = "none"
    hardware: str = ""

    @property
    def spec(self) -> str:
        return self.hardware or (f"{self.tp * self.pp}xcpu" if self.tp * self.pp > 1 else "cpu")

    def describe(self) -> str:
        where = f", tp {self.tp}, pp {self.pp}" if self.tp * self.pp > 1 else ""
        off = f", offload {self.offload} ({self.spec})" if self.offload != "none" else ""
        return f"{self.model} {self.fmt}, batch {self.batch}{where}{off}"


# SmolLM2 is the real GGUF; the Qwen2 models are their published configs, random weights.
PLANS = (
    PlanSpec("smollm2", "fp32", 1), PlanSpec("smollm2", "fp32", 4),
    PlanSpec("smollm2", "bf16", 1), PlanSpec("smollm2", "int8", 1),
    PlanSpec("smollm2", "int8", 4), PlanSpec("smollm2", "int4-g64", 1),
    PlanSpec("smollm2", "int4-g32", 4), PlanSpec("smollm2", "int8", 1, tp=2),
    PlanSpec("smollm2", "fp32", 1, pp=2), PlanSpec("smollm2", "int4-g64", 4, tp=2),
    PlanSpec("smollm2", "fp32", 1, offload="disk", hardware="cpu,ram=1GB"),
    PlanSpec("qwen2-0.5b", "fp32", 1), PlanSpec("qwen2-0.5b", "int8", 4),
    PlanSpec("qwen2-0.5b", "int8", 1, tp=2), PlanSpec("qwen2-0.5b", "bf16", 4, pp=2),
    PlanSpec("qwen2-0.5b", "fp32", 1, offload="disk", hardware="cpu,ram=2GB"),
    PlanSpec("qwen2-1.5b", "int8", 1), PlanSpec("qwen2-1.5b", "int4-g128", 4),
    PlanSpec("qwen2-1.5b", "bf16", 1), PlanSpec("qwen2-1.5b", "int8", 1, tp=2),
    PlanSpec("smollm2", "mixed@5%", 1), PlanSpec("smollm2", "mixed@5%", 4),
    PlanSpec("smollm2", "mixed@5%", 1, tp=2),
)  # fmt: skip
# One GPU: the two published architectures, bf16 and kiln's Triton INT8 / INT4 kernels.
GPU_PLANS = (
    PlanSpec("qwen2-0.5b", "bf16", 1), PlanSpec("qwen2-0.5b", "bf16", 4),
    PlanSpec("qwen2-0.5b", "int8", 1), PlanSpec("qwen2-1.5b", "bf16", 1),
    PlanSpec("qwen2-1.5b", "bf16", 4), PlanSpec("qwen2-1.5b", "int8", 1),
    PlanSpec("qwen2-1.5b", "int4-g128", 1),
)  # fmt: skip
MIX_FORMATS = ("int8", "int4-g128", "int4-g64", "int4-g32", MIXED)


def on_this_gpu(plans: Sequence[PlanSpec]) -> list[PlanSpec]:
    """``plans`` planned for one of this machine's CUDA device (its catalog entry)."""
    import torch

    from kiln.deploy.hardware import catalog_name

    name = catalog_name(torch.cuda.get_device_name())
    return [dataclasses.replace(p, hardware=f"1x{name}") for p in plans]


def plan_format(p: PlanSpec, prompt_len: int, gen_len: int) -> str:
    """``p``'s weight format: as named, or for ``mixed@B`` the format ``kiln plan`` chooses
    for a perplexity budget of B among INT8, INT4 and their per-layer mixes (its
    measurements cached, so a plan chosen before is found again without scoring)."""
    if not p.fmt.startswith("mixed@"):
        return p.fmt
    budget = parse.fraction(p.fmt[len("mixed@") :])
    request = Request(batch=p.batch, prompt_len=prompt_len, gen_len=gen_len,
                      max_ppl_increase=budget, formats=MIX_FORMATS)  # fmt: skip
    doc = plan_deployment(checkpoint_of(p.model), "cpu", request, note=print).document
    return str(doc["compression"]["format"])


def checkpoint_of(model: str) -> str:
    """A catalog model as it is; a published config as its random-weight checkpoint."""
    if published_config(model) is None:
        return model
    return str(random_checkpoint(model))


def predict(
    p: PlanSpec, prompt_len: int, gen_len: int, per_architecture: bool = True
) -> tuple[Any, dict[str, Any]]:
    """The planner's candidate for plan ``p`` (its estimate, feasibility and memory limit)
    and the layout ``measure`` executes. ``per_architecture`` off: priced from the
    calibration's two shapes alone, without timing the model's own blocks (the A/B)."""
    path = checkpoint_of(p.model)
    arch, hw = read_architecture(path), parse_hardware(p.spec)
    known = measurements(path, hw, note=print, per_architecture=per_architecture)
    fmt = plan_format(p, prompt_len, gen_len)
    weights = mixed_format(fmt, arch) if is_mixed(fmt) else FORMATS[fmt]
    lay = Layout(weights, p.tp * p.pp, p.tp, p.pp, p.batch, prompt_len, gen_len,
                 p.offload, activation_bytes(hw, fmt))  # fmt: skip
    cand = evaluate(arch, hw, lay, Request(batch=p.batch, prompt_len=prompt_len,
                                           gen_len=gen_len), known)  # fmt: skip
    layout = {"tp": p.tp, "pp": p.pp, "batch": p.batch, "offload": p.offload,
              "stage_layers": list(cand.estimate.stages), "format": fmt,
              "device": "cpu" if hw.device.kind == "cpu" else "cuda"}  # fmt: skip
    return cand, layout


def run(
    plans: Sequence[PlanSpec], prompt_len: int, gen_len: int, rounds: int,
    budget_s: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Predict every plan, then execute all of them ``rounds`` times in turn (co-tenants on
    this shared host slow a run by up to ~30%, in bursts of minutes): each plan's fastest
    decode and first token over the rounds, its largest peak, and the spread of its runs.
    A plan whose execution fails is reported with its error (and not run again); past
    ``budget_s`` no further execution starts (the rounds done so far count)."""
    t0 = time.monotonic()
    rows: list[dict[str, Any]] = []
    runs: list[tuple[str, dict[str, Any], str, list[Measured]]] = []
    for p in plans:
        cand, layout = predict(p, prompt_len, gen_len)
        est = cand.estimate
        runs.append((checkpoint_of(p.model), layout, layout["format"], []))
        rows.append({
            "plan": p.describe(), "hardware": p.spec,
            "fits": cand.feasible, "memory_limit_bytes": est.device_memory_bytes,
            "predicted": {"ms_per_token": est.ms_per_token, "ttft_ms": est.ttft_ms,
                          "peak_bytes": est.peak_device_bytes},
        })  # fmt: skip
    for r in range(rounds):
        for row, (path, layout, fmt, got) in zip(rows, runs, strict=True):
            if "failed" in row:
                continue
            if budget_s is not None and time.monotonic() - t0 > budget_s:
                row.setdefault("rounds_skipped", 0)
                row["rounds_skipped"] += 1
                continue
            try:
                got.append(measure(path, layout, fmt, prompt_len, gen_len))
            except (RuntimeError, ValueError, OSError, subprocess.SubprocessError) as err:
                row["failed"] = f"{type(err).__name__}: {str(err)[-1500:]}"
                print(f"round {r + 1}/{rounds} {row['plan']:48s} FAILED: {row['failed']}")
                continue
            print(f"round {r + 1}/{rounds} {row['plan']:48s} ms/token {got[-1].ms_per_token:7.2f}"
                  f"  ttft {got[-1].ttft_ms:7.1f}  peak {got[-1].peak_bytes / 1e9:5.2f} GB",
                  flush=True)  # fmt: skip
    for row, (_, _, _, got) in zip(rows, runs, strict=True):
        if not got:
            row.setdefault("failed", "not run: the time budget was spent")
            continue
        ms = [g.ms_per_token for g in got]
        row["engine"] = got[0].engine
        row["device"] = got[0].device_name
        row["measured"] = {"ms_per_token": min(ms), "ttft_ms": min(g.ttft_ms for g in got),
                           "peak_bytes": max(g.peak_bytes for g in got)}  # fmt: skip
        row["runs"] = [{"ms_per_token": g.ms_per_token, "ttft_ms": g.ttft_ms,
                        "peak_bytes": g.peak_bytes} for g in got]  # fmt: skip
        row["decode_spread"] = max(ms) / min(ms) - 1
    cpu = system.cpu_info()
    result = {"kind": "plan-accuracy", "date": time.strftime("%Y-%m-%d"), "cpu": cpu,
              "versions": system.versions(), "prompt_len": prompt_len, "gen_len": gen_len,
              "rounds": rounds, "rows": rows}  # fmt: skip
    return score(result, plans)


def score(result: dict[str, Any], plans: Sequence[PlanSpec]) -> dict[str, Any]:
    """Errors and summary of ``result``'s rows (one per plan of ``plans``, measured), and
    beside them the calibration-only prices of the same plans against the same runs."""
    pairs = [(p, row) for p, row in zip(plans, result["rows"], strict=True) if "measured" in row]
    rows = [row for _, row in pairs]
    for p, row in pairs:
        row["error"] = {k: row["predicted"][k] / row["measured"][k] - 1 for k in row["measured"]}
        est = predict(p, result["prompt_len"], result["gen_len"], per_architecture=False)[0]
        base = {"ms_per_token": est.estimate.ms_per_token, "ttft_ms": est.estimate.ttft_ms}
        row["calibration_only"] = {k: {"predicted": v, "error": v / row["measured"][k] - 1}
                                   for k, v in base.items()}  # fmt: skip
    summary: dict[str, Any] = {}
    for k in ("ms_per_token", "ttft_ms", "peak_bytes"):
        summary[k] = _spread([abs(r["error"][k]) for r in rows])
    summary["calibration_only"] = {
        k: _spread([abs(r["calibration_only"][k]["error"]) for r in rows])
        for k in ("ms_per_token", "ttft_ms")
    }
    summary["memory_under_predicted_over_5pct"] = [
        r["plan"] for r in rows if r["error"]["peak_bytes"] < -0.05
    ]
    summary["over_memory_limit"] = [
        r["plan"] for r in rows if r["measured"]["peak_bytes"] > r["memory_limit_bytes"]
    ]
    summary["failed"] = {r["plan"]: r["failed"] for r in result["rows"] if "failed" in r}
    result["summary"] = summary
    return result


def _spread(errors: list[float]) -> dict[str, float]:
    if not errors:  # every plan failed: nothing to score
        return {"median_abs_error": float("nan"), "max_abs_error": float("nan")}
    return {"median_abs_error": statistics.median(errors), "max_abs_error": max(errors)}


def markdown(result: dict[str, Any]) -> str:
    cpu, gpu = result["cpu"], result.get("gpu")
    rescored = result.get("rescored")
    where = (f"{gpu['name']} (one GPU; launch costs {gpu['launch_costs']})" if gpu else
             f"{cpu['name']} ({'AVX-512' if cpu['avx512f'] else 'AVX2'})")  # fmt: skip
    lines = [
        f"Planner predictions vs execution, {where}, "
        f"{result['date']}: prompt {result['prompt_len']}, {result['gen_len']} new tokens, greedy; "
        "each plan in its own process(es) (ranks: cores // ranks threads each); Qwen2 models "
        f"are their published configs with random weights. Every plan executed "
        f"{result.get('rounds', 1)} times, the plans in turn: measured = the fastest decode and "
        "first token, the largest peak; spread = slowest / fastest decode run - 1 (this "
        "host's co-tenants)."
        + (
            f" Predictions re-priced on {rescored} from the tables cached then." if rescored else ""
        ),
        "",
        "| plan | engine | ms/token pred / meas | err | spread | TTFT ms pred / meas | err | peak GB pred / meas | err |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        if "measured" not in r:
            lines.append(f"| {r['plan']} | failed: {r['failed'][:200]} | | | | | | | |")
            continue
        p, m, e = r["predicted"], r["measured"], r["error"]
        lines.append(
            f"| {r['plan']} | {r['engine']} | {p['ms_per_token']:.2f} / {m['ms_per_token']:.2f} | "
            f"{e['ms_per_token']:+.0%} | {r.get('decode_spread', 0.0):.0%} | "
            f"{p['ttft_ms']:.0f} / {m['ttft_ms']:.0f} | {e['ttft_ms']:+.0%} | "
            f"{p['peak_bytes'] / 1e9:.2f} / {m['peak_bytes'] / 1e9:.2f} | {e['peak_bytes']:+.0%} |"
        )
    s = result["summary"]
    lines += ["", "| figure | median abs error | worst |", "| --- | ---: | ---: |"]
    for k in ("ms_per_token", "ttft_ms", "peak_bytes"):
        lines.append(f"| {k} | {s[k]['median_abs_error']:.1%} | {s[k]['max_abs_error']:.1%} |")
    base = s.get("calibration_only")
    if base:
        lines.append("")
        lines.append(
            "The same plans priced from the calibration's two shapes alone (without timing "
            "the model's own blocks), against the same runs: ms_per_token median "
            f"{base['ms_per_token']['median_abs_error']:.1%} (worst "
            f"{base['ms_per_token']['max_abs_error']:.1%}), ttft_ms median "
            f"{base['ttft_ms']['median_abs_error']:.1%} (worst "
            f"{base['ttft_ms']['max_abs_error']:.1%})."
        )
    under, over = s["memory_under_predicted_over_5pct"], s["over_memory_limit"]
    lines.append("")
    lines.append(
        "Memory under-predicted by more than 5%: " + (", ".join(under) if under else "never")
    )
    lines.append("Executed plans over their RAM limit: " + (", ".join(over) if over else "none"))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kiln.bench.plan_accuracy", description=__doc__)
    p.add_argument("--only", default="", help="comma list of models to keep (default: all)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="executions of every plan, in turn")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no execution after this many seconds (the rounds done count)",
    )
    p.add_argument("--gpu", action="store_true",
                   help="one-GPU plans on this machine's CUDA device (GPU_PLANS)")  # fmt: skip
    p.add_argument("--out", default=str(RESULTS_DIR))
    p.add_argument("--rescore", default="", metavar="FILE",
                   help="price the plans of a result file again from this machine's "
                        "cached tables (no execution: the runs stay) and rewrite it")  # fmt: skip
    args = p.parse_args(argv)
    keep = {m for m in args.only.split(",") if m}
    plans = [p for p in (GPU_PLANS if args.gpu else PLANS) if not keep or p.model in keep]
    if args.gpu:
        return run_gpu(plans, args)
    if args.rescore:
        path = Path(args.rescore)
        result = json.loads(path.read_text(encoding="utf-8"))
        by_name = {p.describe(): p for p in PLANS}
        plans = [by_name[row["plan"]] for row in result["rows"]]
        for plan, row in zip(plans, result["rows"], strict=True):
            est = predict(plan, result["prompt_len"], result["gen_len"])[0].estimate
            row["predicted"] = {"ms_per_token": est.ms_per_token, "ttft_ms": est.ttft_ms,
                                "peak_bytes": est.peak_device_bytes}  # fmt: skip
        result["rescored"] = time.strftime("%Y-%m-%d %H:%M")
        result = score(result, plans)
        system.write_result(result, str(path.parent), path.name, markdown(result))
        print(markdown(result))
        return 0
    result = run(plans, args.prompt_len, args.gen_len, args.rounds, args.budget_s)
    system.publish(result, args.out, f"plan-accuracy-{system.device_slug(result['cpu'])}",
                   markdown(result))  # fmt: skip
    return 0


def run_gpu(plans: Sequence[PlanSpec], args: argparse.Namespace) -> int:
    """``--gpu``: calibrate the device's launch costs, then run ``plans`` on it."""
    import torch

    from kiln.core.gpu_profile import calibrate_gpu_profile
    from kiln.deploy.gpu_launches import launch_costs
    from kiln.deploy.hardware import parse_hardware

    if not torch.cuda.is_available():
        raise SystemExit("--gpu needs a CUDA device")
    profile = calibrate_gpu_profile()
    plans = on_this_gpu(plans)
    costs = launch_costs(parse_hardware(plans[0].spec).device)
    result = run(plans, args.prompt_len, args.gen_len, args.rounds, args.budget_s)
    result["gpu"] = {"name": torch.cuda.get_device_name(), "profile": json.loads(profile.to_json()),
                     "launch_costs": f"{costs.graph_us:.2f} us a graph node, {costs.launch_us:.2f} "
                                     f"us a launch, {costs.source}"}  # fmt: skip
    slug = re.sub(r"[^a-z0-9]+", "-", result["gpu"]["name"].lower()).strip("-")
    system.publish(result, args.out, f"plan-accuracy-gpu-{slug}", markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
