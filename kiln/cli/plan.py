"""kiln plan: the cheapest deployment that meets an accuracy budget, a latency target and a
hardware budget, predicted and explained."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from kiln.cli._console import console, refused


def plan(
    model: Annotated[str, typer.Argument(help="a checkpoint (as kiln generate takes) or a config.json-style file")],
    hardware: Annotated[str, typer.Option(help="e.g. 4xRTX3090, 8xA100-40GB,host=256GB,nvme=3GB/s, cpu, or a JSON file")] = "cpu",
    max_ppl_increase: Annotated[str, typer.Option(help="largest perplexity increase, e.g. 1%")] = "",
    max_ms_per_token: Annotated[float | None, typer.Option(help="decode latency target")] = None,
    max_ttft_ms: Annotated[float | None, typer.Option(help="time-to-first-token target")] = None,
    batch: Annotated[int, typer.Option(help="sequences decoded together")] = 1,
    max_batch: Annotated[int, typer.Option(help="also try larger batches up to this (cheaper tokens, slower steps)")] = 0,
    prompt_len: Annotated[int, typer.Option(help="prompt tokens")] = 512,
    gen_len: Annotated[int, typer.Option(help="generated tokens")] = 128,
    objective: Annotated[str, typer.Option(help="cost | latency | throughput")] = "cost",
    formats: Annotated[str, typer.Option(help="weight formats to consider: fp32, fp16, bf16, int8, int4-g32/g64/g128, and mixed (per-layer mixes of the INT8/INT4 ones chosen by the compression allocator; needs --max-ppl-increase and a checkpoint kiln can score)")] = "fp16,int8,int4-g128",
    no_offload: Annotated[bool, typer.Option("--no-offload", help="never offload weights")] = False,
    out: Annotated[str, typer.Option(help="write the plan (JSON) here")] = "",
    as_json: Annotated[bool, typer.Option("--json", help="print the plan as one JSON object")] = False,
    verify: Annotated[bool, typer.Option("--verify", help="execute the plan here and compare (CPU plans; one-GPU plans on this machine's GPU): speed, memory, and perplexity on held-out text")] = False,
    verify_tokens: Annotated[int, typer.Option(help="tokens of the confirmation text --verify scores")] = 4096,
    emit: Annotated[str, typer.Option(help="also print the launch for torchrun or vllm")] = "",
    plot: Annotated[str, typer.Option(help="write the latency / cost picture (PNG) here; default: beside --out")] = "",
) -> None:  # fmt: skip
    """Plan how to serve MODEL on HARDWARE: weight format, number of devices, tensor- and
    pipeline-parallel degrees and weight offloading, chosen for the objective among every
    layout that meets the constraints. Every speed and memory figure is predicted by kiln's
    cost model. With --max-ppl-increase, a checkpoint kiln can load and score (one with a
    tokenizer) has each weight format's perplexity increase measured on Pride and Prejudice
    (a 95% upper bound, cached; minutes the first time); otherwise accuracy per format is a
    stated prior from published results. Every output says which. With "mixed" among
    --formats such a checkpoint is also calibrated layer by layer (cached), and the
    compression allocator's smallest per-layer INT8/INT4 mixes predicted within a ladder of
    budgets join the search; the mixed plan the search would choose is measured on Pride and
    Prejudice before it is counted on (up to 4, a minute or two each).

    An infeasible request prints the closest plan, each constraint it misses and by how
    much, and the single changes that would make it feasible. With --verify a CPU plan is
    executed in a fresh process and its measured figures are printed beside the predicted
    ones, and its perplexity increase is measured on text no choice was made on (Sense and
    Sensibility, --verify-tokens tokens) with a 95% upper bound: confirmed within the
    budget, or said not to be. With --emit torchrun|vllm the plan is also printed as that engine's launch line(s),
    with the parts of the plan the engine cannot express. The latency / cost Pareto frontier
    is printed as a table and drawn (every layout that fits, coloured by accuracy) to --plot,
    or beside --out (plan.json -> plan.png)."""
    from kiln.deploy import parse
    from kiln.deploy.plan_job import plan_deployment
    from kiln.deploy.planner import Request

    with refused():
        request = Request(
            batch=batch, max_batch=max_batch, prompt_len=prompt_len, gen_len=gen_len,
            max_ppl_increase=parse.fraction(max_ppl_increase) if max_ppl_increase else None,
            max_ms_per_token=max_ms_per_token, max_ttft_ms=max_ttft_ms,
            objective=parse.plan_objective(objective),
            formats=tuple(f.strip() for f in formats.split(",") if f.strip()),
            allow_offload=not no_offload,
        )  # fmt: skip
        with console.status("planning") as status:
            result = plan_deployment(model, hardware, request, out or None, status.update)
    doc = result.document
    launch = None
    if emit:
        from kiln.deploy.emit import ENGINES
        from kiln.deploy.emit import emit as emit_plan

        with refused():
            if emit not in ENGINES:
                raise ValueError(f"--emit must be one of {', '.join(ENGINES)}, got {emit!r}")
            launch = emit_plan(doc, emit)  # type: ignore[arg-type]
    checked, accuracy = None, None
    if verify and doc["feasible"]:
        from kiln.deploy.plan_job import verify as verify_plan
        from kiln.deploy.plan_job import verify_accuracy

        with console.status("executing the plan") as status, refused():
            checked = verify_plan(result, model)
            accuracy = verify_accuracy(result, model, verify_tokens, status.update)
    picture = Path(plot) if plot else (Path(out).with_suffix(".png") if out else None)
    if picture is not None:
        from kiln.deploy.plan_plot import plot_plan

        plot_plan(result.plan, picture)
    if as_json:
        extra: dict = {"verified": checked} if checked else {}
        if accuracy is not None:
            extra["verified_accuracy"] = accuracy.as_dict()
        if launch is not None:
            extra["emit"] = {"engine": emit, "lines": launch.lines,
                             "cannot_express": launch.cannot_express}  # fmt: skip
        print(json.dumps({**doc, **extra}, indent=1))
        return
    _render(doc)
    if checked:
        table = Table("figure", "predicted", "measured", "error")
        for name, row in checked.items():
            table.add_row(
                name, f"{row['predicted']:.4g}", f"{row['measured']:.4g}", f"{row['error']:+.1%}"
            )
        console.print(table)
    if accuracy is not None:
        measured = ("" if accuracy.increase is None else
                    f", measured {accuracy.increase:+.2%} (95% upper bound {accuracy.upper:+.2%})"
                    f" on {accuracy.tokens} tokens of {accuracy.text}")  # fmt: skip
        console.print(f"perplexity: planned {accuracy.planned:+.2%}{measured}: {accuracy.verdict}")
    if launch is not None:
        console.print(f"[bold]{emit}[/bold]:")
        for line in launch.lines:
            console.print(line, markup=False, highlight=False, soft_wrap=True)
        for gap in launch.cannot_express:
            console.print(f"[yellow]{emit} cannot express[/yellow] {gap}")
    if result.written is not None:
        console.print(f"[dim]plan written to {result.written}[/dim]")
    if picture is not None:
        console.print(f"[dim]latency / cost picture written to {picture}[/dim]")
    if not doc["feasible"]:
        raise typer.Exit(1)


def _render(doc: dict) -> None:
    lay, pred, comp = doc["layout"], doc["predicted"], doc["compression"]
    verdict = "[green]feasible[/green]" if doc["feasible"] else "[red]infeasible[/red]"
    console.print(f"{doc['model']} on {doc['hardware']}: {verdict} (all figures predicted)")
    table = Table("", "plan")
    off = lay["offload"]
    table.add_row("layout", f"{lay['devices']} x {lay['device_type']}, tp {lay['tp']}, pp {lay['pp']} "
                  f"(layers per stage {lay['stage_layers']}), offload {off}, batch {lay['batch']}")  # fmt: skip
    table.add_row("weights", f"{comp['label']}: {comp['weight_bytes'] / 1e9:.2f} GB, "
                  f"{comp['bits_per_weight']:.2f} bits per parameter")  # fmt: skip
    table.add_row("speed", f"{pred['ms_per_token']:.1f} ms/token, {pred['tokens_per_s']:.1f} tokens/s, "
                  f"time to first token {pred['ttft_ms']:.0f} ms")  # fmt: skip
    table.add_row("memory", f"peak {pred['peak_device_bytes'] / 1e9:.1f} GB per device, "
                  f"{pred['peak_host_bytes'] / 1e9:.1f} GB host")  # fmt: skip
    table.add_row(
        "accuracy", f"{pred['ppl_increase']:+.1%} perplexity ({pred['ppl_increase_source']})"
    )
    table.add_row("cost", f"${doc['cost_per_1m_tokens_usd']:.2f} per 1M tokens")
    console.print(table)
    for v in doc["violations"]:
        console.print(
            f"[red]misses[/red] {v['constraint']}: needs {v['needed']:.4g}, limit {v['limit']:.4g}"
        )
    for r in doc["relaxations"]:
        console.print(f"[yellow]would fit with[/yellow] {r['change']}: {r['plan']}")
    for r in doc["runners_up"]:
        console.print(f"[dim]runner-up {r['plan']}: {r['why_lost']}[/dim]")
    if doc["frontier"]:
        front = Table("latency / cost frontier", "ms/token", "$ per 1M tokens", "ppl", "meets all")
        for f in doc["frontier"]:
            front.add_row(f["plan"], f"{f['ms_per_token']:.1f}", f"{f['cost_per_1m_tokens_usd']:.3f}",
                          f"{f['ppl_increase']:+.1%}", "yes" if f["feasible"] else "no")  # fmt: skip
        console.print(front)
