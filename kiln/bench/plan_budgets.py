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

    python -m kiln.bench.plan_budgets [--model smollm2] [--budgets 0.5%,1%,5%] [--tokens 4096] [--priors]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from kiln.bench import RESULTS_DIR, system
from kiln.deploy import parse
from kiln.deploy.plan_job import format_accuracy, plan_deployment, verify_accuracy
from kiln.deploy.planner import Request

FORMATS = ("bf16", "int8", "int4-g32", "int4-g64", "int4-g128")


def run(model: str, budgets: list[float], tokens: int, priors: bool) -> dict[str, Any]:
    rows = []
    for budget in budgets:
        request = Request(batch=1, prompt_len=64, gen_len=32, max_ppl_increase=budget,
                          formats=FORMATS)  # fmt: skip
        result = plan_deployment(model, "cpu", request, note=print, measure_accuracy=not priors)
        if not result.document["feasible"]:
            rows.append({"budget": budget, "feasible": False})
            continue
        got = verify_accuracy(result, model, tokens, note=print)
        source = result.document["predicted"]["ppl_increase_source"]
        rows.append({"budget": budget, "feasible": True, "planned_source": source,
                     **got.as_dict()})  # fmt: skip
        print(f"budget {budget:.2%}: {got.fmt}: {got.verdict}", flush=True)
    searched = None if priors else format_accuracy(model, FORMATS, print)  # cached by now
    return {"kind": "plan-budgets", "date": time.strftime("%Y-%m-%d"), "model": model,
            "searched": None if searched is None else {"source": searched.source,
                                                       "upper": dict(searched.upper)},
            "cpu": system.cpu_info(), "versions": system.versions(), "tokens": tokens,
            "formats": list(FORMATS), "accuracy": "priors" if priors else "measured",
            "rows": rows}  # fmt: skip


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
        "| budget | format | planned | measured | upper bound | ppl original / plan | verdict |",
        "| ---: | --- | ---: | ---: | ---: | --- | --- |",
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
            lines.append(f"| {r['budget']:.1%} | no feasible plan | | | | | |")
            continue
        measured = "" if r["increase"] is None else f"{r['increase']:+.2%}"
        upper = "" if r["upper"] is None else f"{r['upper']:+.2%}"
        ppl = ("" if r["ppl_original"] is None else
               f"{r['ppl_original']:.2f} / {r['ppl_plan']:.2f}")  # fmt: skip
        lines.append(f"| {r['budget']:.1%} | {r['fmt']} | {r['planned']:+.2%} | {measured} | "
                     f"{upper} | {ppl} | {r['verdict']} |")  # fmt: skip
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
    p.add_argument("--out", default=str(RESULTS_DIR))
    args = p.parse_args(argv)
    budgets = [parse.fraction(b) for b in args.budgets.split(",") if b.strip()]
    result = run(args.model, budgets, args.tokens, args.priors)
    kind = "priors" if args.priors else "measured"
    system.publish(result, args.out, f"plan-budgets-{kind}-{system.device_slug(result['cpu'])}",
                   markdown(result))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
