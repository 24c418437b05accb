"""Accuracy budgets against the executed plan: ``python -m kiln.bench.plan_budgets``.

For each perplexity budget (0.5%, 1%, 5% by default) ``kiln plan`` chooses a CPU plan for a
real checkpoint (SmolLM2-135M by default) among kiln's weight formats, each format's
perplexity increase measured on the search text (*Pride and Prejudice*, its 95% upper bound;
``--priors``: the planner's published-result priors instead, as for a model kiln cannot
score); the chosen format is then loaded as ``kiln run`` loads it and scored beside the
float original on the confirmation text (*Sense and Sensibility*), which nothing in the
choice saw (``deploy.plan_quality``). Reported per budget: the format, the increase the
plan counted on, the confirmed increase, its 95% upper bound, and the verdict (confirmed
within budget, not confirmed, over budget).

``--mixed`` adds the per-layer mixed formats (``deploy.mixed``: the compression
allocator's INT8/INT4 mixes, measured on the search text before the planner counts on
one). Each chosen plan is then also executed here (``deploy.execute.measure``: a fresh
process, the fastest of ``--speed-rounds`` runs) beside the INT8 plan, executed the same
way in turn, so its size and speed are compared with the uniform format it replaces.

    python -m kiln.bench.plan_budgets [--model smollm2] [--budgets 0.5%,1%,5%] [--tokens 4096] [--priors] [--mixed]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from kiln.bench import RESULTS_DIR, system
from kiln.deploy import parse
from kiln.deploy.plan_job import format_accuracy, plan_deployment, verify_accuracy
from kiln.deploy.planner import MIXED, Request

FORMATS = ("bf16", "int8", "int4-g32", "int4-g64", "int4-g128")


PROMPT, GEN = 64, 32  # the requests' prompt and generated tokens


def run(
    model: str, budgets: list[float], tokens: int, priors: bool, mixed: bool = False,
    speed_rounds: int = 0,
) -> dict[str, Any]:  # fmt: skip
    rows = []
    formats = (*FORMATS, MIXED) if mixed else FORMATS
    for budget in budgets:
        request = Request(batch=1, prompt_len=PROMPT, gen_len=GEN, max_ppl_increase=budget,
                          formats=formats)  # fmt: skip
        result = plan_deployment(model, "cpu", request, note=print, measure_accuracy=not priors)
        doc = result.document
        if not doc["feasible"]:
            rows.append({"budget": budget, "feasible": False})
            continue
        got = verify_accuracy(result, model, tokens, note=print)
        source = doc["predicted"]["ppl_increase_source"]
        comp = doc["compression"]
        rows.append({"budget": budget, "feasible": True, "planned_source": source,
                     **got.as_dict(), "label": comp["label"],
                     "weight_bytes": comp["weight_bytes"], "layer_counts": comp["layer_counts"],
                     "predicted_ms_per_token": doc["predicted"]["ms_per_token"],
                     "layout": doc["layout"]})  # fmt: skip
        print(f"budget {budget:.2%}: {comp['label']}: {got.verdict}", flush=True)
    if speed_rounds:
        _speeds(model, rows, speed_rounds)
    searched = None if priors else format_accuracy(model, FORMATS, print)  # cached by now
    return {"kind": "plan-budgets", "date": time.strftime("%Y-%m-%d"), "model": model,
            "searched": None if searched is None else {"source": searched.source,
                                                       "upper": dict(searched.upper)},
            "cpu": system.cpu_info(), "versions": system.versions(), "tokens": tokens,
            "formats": list(formats), "accuracy": "priors" if priors else "measured",
            "rows": rows}  # fmt: skip


def _speeds(model: str, rows: list[dict[str, Any]], rounds: int) -> None:
    """Execute each row's plan and the INT8 plan in turn, ``rounds`` times, and keep each
    one's fastest decode (ms/token) in the rows (``int8_ms_per_token`` beside its own)."""
    from kiln.deploy.execute import measure

    plans = {r["fmt"]: r["layout"] for r in rows if r["feasible"]}
    one = next(iter(plans.values()), None)
    if one is None:
        return
    plans.setdefault("int8", one)  # the same one-process layout
    best: dict[str, float] = {}
    for i in range(rounds):
        for fmt, layout in plans.items():
            got = measure(model, layout, fmt, PROMPT, GEN)
            best[fmt] = min(best.get(fmt, got.ms_per_token), got.ms_per_token)
            print(f"round {i + 1}: {fmt[:24]}: {got.ms_per_token:.2f} ms/token", flush=True)
    for r in rows:
        if r["feasible"]:
            r["ms_per_token"], r["int8_ms_per_token"] = best[r["fmt"]], best["int8"]


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"`kiln plan {result['model']} --hardware cpu --max-ppl-increase B --verify` "
        f"({result['date']}): the format chosen among {', '.join(result['formats'])} on "
        + (
            "the planner's published-result priors"
            if result["accuracy"] == "priors"
            else "each format's increase measured on Pride and Prejudice (95% upper bound)"
        )
        + f", then measured beside the float original on the first "
        f"{result['tokens']} tokens of Sense and Sensibility (windows of 512, stride 256; "
        "upper = one-sided 95% bound from the spread across windows).",
        "",
        "| budget | format | planned | measured | upper bound | ppl original / plan | verdict |"
        " weights MB | ms/token pred / meas | INT8 ms/token |",
        "| ---: | --- | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: |",
    ]
    searched = result.get("searched")
    if searched:
        per = ", ".join(f"{f} {u:+.2%}" for f, u in searched["upper"].items())
        lines[1:1] = [
            "",
            f"Each format's increase on the search text ({searched['source']}): {per}.",
        ]
    for r in result["rows"]:
        if not r["feasible"]:
            lines.append(f"| {r['budget']:.1%} | no feasible plan | | | | | | | | |")
            continue
        measured = "" if r["increase"] is None else f"{r['increase']:+.2%}"
        upper = "" if r["upper"] is None else f"{r['upper']:+.2%}"
        ppl = ("" if r["ppl_original"] is None else
               f"{r['ppl_original']:.2f} / {r['ppl_plan']:.2f}")  # fmt: skip
        mb = f"{r['weight_bytes'] / 1e6:.1f}" if "weight_bytes" in r else ""
        speed = (f"{r['predicted_ms_per_token']:.2f} / {r['ms_per_token']:.2f}"
                 if "ms_per_token" in r else "")  # fmt: skip
        int8 = f"{r['int8_ms_per_token']:.2f}" if "int8_ms_per_token" in r else ""
        lines.append(f"| {r['budget']:.1%} | {r.get('label', r['fmt'])} | {r['planned']:+.2%} | "
                     f"{measured} | {upper} | {ppl} | {r['verdict']} | {mb} | {speed} | "
                     f"{int8} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kiln.bench.plan_budgets", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument(
        "--model", default="smollm2", help="a language-model checkpoint with a tokenizer"
    )
    p.add_argument("--budgets", default="0.5%,1%,5%", help="comma list of perplexity budgets")
    p.add_argument("--tokens", type=int, default=4096, help="confirmation-text tokens scored")
    p.add_argument("--priors", action="store_true",
                   help="choose on the planner's priors, not on measured accuracy")  # fmt: skip
    p.add_argument("--mixed", action="store_true",
                   help="also consider per-layer mixed INT8/INT4 formats")  # fmt: skip
    p.add_argument("--speed-rounds", type=int, default=0,
                   help="execute each chosen plan and the INT8 plan this many times each")  # fmt: skip
    p.add_argument("--out", default=str(RESULTS_DIR))
    args = p.parse_args(argv)
    budgets = [parse.fraction(b) for b in args.budgets.split(",") if b.strip()]
    result = run(args.model, budgets, args.tokens, args.priors, args.mixed, args.speed_rounds)
    kind = ("priors" if args.priors else "measured") + ("-mixed" if args.mixed else "")
    system.publish(result, args.out, f"plan-budgets-{kind}-{system.device_slug(result['cpu'])}",
                   markdown(result))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
