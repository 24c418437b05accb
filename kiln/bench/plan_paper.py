"""The planner on models far beyond this machine, on paper: ``python -m kiln.bench.plan_paper``.

Every figure here is a *prediction* of kiln's cost model for the catalog's GPUs (nothing is
executed; accuracy per format is the planner's stated prior). Three tables:

1. Published feasibility: GLM-130B as its own repository documents it (INT4 on 4 x RTX 3090
   without offload, on 8 x RTX 2080 Ti only with offload; INT8 on 8 x RTX 3090; FP16 on
   8 x A100-40GB; one A100-80GB not without offload), served at its full 2,048 tokens, and
   Llama-2-70B in FP16 on one or two A100-80GB.
2. A request that cannot be met (GLM-130B, 1 % budget, 4 x RTX 3090, 300 ms/token): what
   it misses and the relaxations that fix it.
3. Better than the obvious choices: Llama-2-70B on up to 8 x A100-40GB, batch 8, a 2,048
   token prompt, 60 ms/token: kiln's plan against FP16 with the smallest tensor-parallel
   degree that fits, and uniform INT4 on one GPU with host offload.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from kiln.bench import RESULTS_DIR, system
from kiln.deploy.architecture import read_architecture
from kiln.deploy.estimate import FORMATS, Layout
from kiln.deploy.hardware import parse_hardware
from kiln.deploy.planner import Candidate, Request, evaluate, plan

GLM_FULL = {"prompt_len": 1920, "gen_len": 128}  # GLM-130B's published 2,048-token figures
FEASIBILITY = (  # (model, hardware, format, offload allowed, published: fits)
    ("glm-130b", "4xRTX3090", "int4-g128", False, True),
    ("glm-130b", "8xRTX2080Ti", "int4-g128", False, False),
    ("glm-130b", "8xRTX2080Ti", "int4-g128", True, True),
    ("glm-130b", "4xRTX3090", "int8", False, False),
    ("glm-130b", "8xRTX3090", "int8", False, True),
    ("glm-130b", "8xA100-40GB", "fp16", False, True),
    ("glm-130b", "A100-80GB", "int4-g128", False, False),
    ("glm-130b", "A100-80GB", "int4-g128", True, True),
    ("llama-2-70b", "A100-80GB", "fp16", False, False),
    ("llama-2-70b", "2xA100-80GB", "fp16", False, True),
)
CHOICE = Request(batch=8, prompt_len=2048, gen_len=256, max_ms_per_token=60.0,
                 max_ppl_increase=0.02, formats=("fp16", "int8", "int4-g128"))  # fmt: skip


def _row(c: Candidate) -> dict[str, Any]:
    e = c.estimate
    return {"plan": c.describe(), "feasible": c.feasible, "ms_per_token": e.ms_per_token,
            "ttft_ms": e.ttft_ms, "peak_device_gib": e.peak_device_bytes / 2**30,
            "cost_per_1m_tokens_usd": c.cost_per_1m_tokens,
            "misses": [f"{v.constraint}: {v.needed:.4g} > {v.limit:.4g}" for v in c.violations]}  # fmt: skip


def feasibility() -> list[dict[str, Any]]:
    rows = []
    for model, spec, fmt, offload, published in FEASIBILITY:
        extra = GLM_FULL if model == "glm-130b" else {}
        req = Request(formats=(fmt,), allow_offload=offload, **extra)  # type: ignore[arg-type]
        got = plan(read_architecture(model), parse_hardware(spec), req, relax=False)
        rows.append({"model": model, "hardware": spec, "format": fmt, "offload_allowed": offload,
                     "published_fits": published, "kiln_fits": got.feasible,
                     "agrees": got.feasible == published, **_row(got.best)})  # fmt: skip
    return rows


def refusal() -> dict[str, Any]:
    req = Request(max_ppl_increase=0.01, max_ms_per_token=300.0, **GLM_FULL)  # type: ignore[arg-type]
    got = plan(read_architecture("glm-130b"), parse_hardware("4xRTX3090"), req)
    return {"request": "GLM-130B on 4 x RTX 3090, <= 1% perplexity (prior), <= 300 ms/token",
            "feasible": got.feasible, "closest": _row(got.best),
            "relaxations": [{"change": what, "plan": c.describe()} for what, c in got.relaxations]}  # fmt: skip


def obvious_choices() -> dict[str, Any]:
    arch, hw = read_architecture("llama-2-70b"), parse_hardware("8xA100-40GB")
    kiln = plan(arch, hw, CHOICE).best
    req = CHOICE
    fp16 = None
    for n in (1, 2, 4, 8):  # FP16, the smallest tensor-parallel degree that fits
        lay = Layout(FORMATS["fp16"], n, n, 1, req.batch, req.prompt_len, req.gen_len, "none", 2)
        cand = evaluate(arch, hw, lay, req)
        if not any("memory" in v.constraint for v in cand.violations):
            fp16 = cand
            break
    assert fp16 is not None, "FP16 Llama-2-70B fits 8 x A100-40GB"
    lay = Layout(FORMATS["int4-g128"], 1, 1, 1, req.batch, req.prompt_len, req.gen_len, "host", 2)
    int4 = evaluate(arch, hw, lay, req)
    rows = {"kiln": _row(kiln), "fp16_smallest_tp": _row(fp16), "int4_one_gpu_offload": _row(int4)}
    for name in ("fp16_smallest_tp", "int4_one_gpu_offload"):
        rows[name]["cost_vs_kiln"] = (
            rows[name]["cost_per_1m_tokens_usd"] / rows["kiln"]["cost_per_1m_tokens_usd"]
        )
        rows[name]["ms_per_token_vs_kiln"] = (
            rows[name]["ms_per_token"] / rows["kiln"]["ms_per_token"]
        )
    return {"request": "Llama-2-70B on up to 8 x A100-40GB, batch 8, prompt 2048, 256 new "
            "tokens, <= 60 ms/token, <= 2% perplexity (prior)", **rows}  # fmt: skip


def markdown(result: dict[str, Any]) -> str:
    lines = [f"Planner on paper ({result['date']}): every figure is predicted by kiln's cost "
             "model (catalog datasheets, stated efficiencies); accuracy per format is a prior.",
             "", "## Published feasibility", "",
             "| model | hardware | format | offload allowed | published | kiln | kiln's plan |",
             "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in result["feasibility"]:
        lines.append(
            f"| {r['model']} | {r['hardware']} | {r['format']} | {r['offload_allowed']} | "
            f"{'fits' if r['published_fits'] else 'does not fit'} | "
            f"{'fits' if r['kiln_fits'] else 'does not fit'} | {r['plan']}, "
            f"{r['peak_device_gib']:.1f} GiB per device |"
        )
    ref = result["refusal"]
    lines += ["", "## A request that cannot be met", "", ref["request"] + ":", ""]
    lines += [f"- misses {m}" for m in ref["closest"]["misses"]]
    lines += [f"- would be met with {r['change']}: {r['plan']}" for r in ref["relaxations"]]
    ch = result["obvious_choices"]
    lines += ["", "## Better than the obvious choices", "", ch["request"] + ":", "",
              "| plan | ms/token | $ per 1M tokens | meets the request | vs kiln (cost) |",
              "| --- | ---: | ---: | --- | ---: |"]  # fmt: skip
    for name in ("kiln", "fp16_smallest_tp", "int4_one_gpu_offload"):
        r = ch[name]
        vs = f"{r['cost_vs_kiln']:.2f}x" if "cost_vs_kiln" in r else "1.00x"
        lines.append(f"| {name}: {r['plan']} | {r['ms_per_token']:.1f} | "
                     f"{r['cost_per_1m_tokens_usd']:.2f} | {'yes' if r['feasible'] else 'no: ' + '; '.join(r['misses'])} | {vs} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kiln.bench.plan_paper", description=__doc__)
    p.add_argument("--out", default=str(RESULTS_DIR))
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    result: dict[str, Any] = {"kind": "plan-paper", "date": time.strftime("%Y-%m-%d"),
              "feasibility": feasibility(), "refusal": refusal(),
              "obvious_choices": obvious_choices()}  # fmt: skip
    result["planning_s"] = time.perf_counter() - t0
    result["versions"] = system.versions()
    system.write_result(result, args.out, f"plan-paper-{time.strftime('%Y%m%d')}.json",
                        markdown(result))  # fmt: skip
    print(markdown(result))
    print(f"wrote {result['path']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
