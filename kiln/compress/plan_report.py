"""Reports of a compression run: tables (markdown) and the size-vs-accuracy plot."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from kiln.compress.allocate import FrontierPoint
from kiln.compress.plan import PlanRound, plan_nbytes
from kiln.compress.sensitivity import DENSE, SensitivityTable
from kiln.compress.tasks import Task
from kiln.compress.workflow import CompressionOutcome


@dataclass(frozen=True)
class SchemeResult:
    """One row of the comparison table: a uniform scheme or a mixed plan."""

    name: str
    nbytes: int  # bytes of the compressible linear layers
    metric: float  # perplexity (language model) or mean cosine (encoder)
    increase: float  # relative perplexity increase, or mean 1 - cosine
    within: bool | None = None  # within the budget it was made for (mixed plans)


def metric_name(task: Task) -> str:
    return "perplexity" if task.kind == "lm" else "mean cosine"


def scheme_table(rows: list[SchemeResult], task: Task, total_other_bytes: int) -> str:
    """Markdown: scheme, linear-layer MB, whole-model MB, metric, measured increase."""
    inc = "ppl increase" if task.kind == "lm" else "1 - cosine"
    lines = [
        f"| scheme | linear layers (MB) | model (MB) | {metric_name(task)} | {inc} | within budget |",
        "| --- | ---: | ---: | ---: | ---: | :---: |",
    ]
    for r in rows:
        within = "" if r.within is None else ("yes" if r.within else "**no**")
        lines.append(
            f"| {r.name} | {r.nbytes / 1e6:.1f} | {(r.nbytes + total_other_bytes) / 1e6:.1f} "
            f"| {r.metric:.4f} | {r.increase:+.3%} | {within} |"
        )
    return "\n".join(lines)


def plan_summary(outcome: CompressionOutcome, task: Task) -> str:
    """Markdown: the rounds of the search, the options used, and their confirmation."""
    table = outcome.table
    lines = [
        "| round | predicted budget | predicted | measured | linear MB |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for i, rnd in enumerate(outcome.result.rounds, 1):
        lines.append(_round_row(i, rnd, task))
    final = outcome.result.final.choice
    counts = Counter(final.values())
    lines += [
        "",
        "| option | layers | MB | predicted | measured alone |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    confirmed = {c.option: c for c in outcome.confirmations}
    for name, count in sorted(counts.items(), key=lambda kv: -kv[1]):
        mb = sum(table.option(lay, name).nbytes for lay, n in final.items() if n == name) / 1e6
        c = confirmed.get(name)
        pred = "" if c is None else f"{task.describe(c.predicted):+.3%}"
        meas = "" if c is None else f"{task.describe(c.measured):+.3%}"
        lines.append(f"| {name} | {count} | {mb:.1f} | {pred} | {meas} |")
    return "\n".join(lines)


def _round_row(i: int, rnd: PlanRound, task: Task) -> str:
    return (
        f"| {i} | {task.describe(rnd.predicted_budget):+.3%} | {task.describe(rnd.predicted):+.3%} "
        f"| {task.describe(rnd.measured):+.3%} | {rnd.nbytes / 1e6:.1f} |"
    )


def layer_table(table: SensitivityTable, choice: dict[str, str], task: Task) -> str:
    """Markdown: every layer's choice, bytes, and predicted increase."""
    lines = ["| layer | choice | KB | dense KB | predicted |", "| --- | --- | ---: | ---: | ---: |"]
    for layer, name in choice.items():
        opt, dense = table.option(layer, name), table.option(layer, DENSE)
        lines.append(
            f"| {layer} | {name} | {opt.nbytes / 1e3:.0f} | {dense.nbytes / 1e3:.0f} "
            f"| {task.describe(opt.predicted):+.4%} |"
        )
    return "\n".join(lines)


def frontier_in_units(frontier: list[FrontierPoint], task: Task) -> list[FrontierPoint]:
    """Frontier with its loss turned into the task's reported unit (percent)."""
    return [FrontierPoint(p.cost, 100 * task.describe(p.loss), p.choice) for p in frontier]


def plot(
    outcome_frontier: list[FrontierPoint],
    rows: list[SchemeResult],
    task: Task,
    path: Path,
    title: str,
) -> Path:
    """The predicted frontier, measured uniform schemes, and measured mixed plans."""
    from kiln.compress.frontier_plot import plot_frontier

    uniform = {r.name: (float(r.nbytes), 100 * r.increase) for r in rows if r.within is None}
    chosen = {r.name: (float(r.nbytes), 100 * r.increase) for r in rows if r.within is not None}
    y_label = "perplexity increase (%)" if task.kind == "lm" else "1 - cosine (%)"
    return plot_frontier(
        frontier_in_units(outcome_frontier, task), path, uniform=uniform, chosen=chosen,
        x_label="linear layers (MB)", y_label=y_label, title=title, y_log=True,
    )  # fmt: skip


def scheme_of(table: SensitivityTable, choice: dict[str, str], name: str, metric: float,
              increase: float, within: bool | None = None) -> SchemeResult:  # fmt: skip
    return SchemeResult(name, plan_nbytes(table, choice), metric, increase, within)
