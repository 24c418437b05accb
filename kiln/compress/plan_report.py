"""Reports of a compression run: tables (markdown) and the size-vs-accuracy plot.

Every figure says which text it was measured on: the search text (where plans were tuned,
with the search's margin) or the confirmation text (unseen by the search; a mixed plan's
reported accuracy).
"""

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
    """One row of the comparison table: a uniform scheme or a mixed plan.

    ``metric`` and ``increase`` are measured on the search text; a mixed plan also has the
    search's ``margin`` and its ``confirmed`` increase on the confirmation text, which is
    its reported accuracy, and ``within`` says whether that is within its budget.
    """

    name: str
    nbytes: int  # bytes of the compressible linear layers
    metric: float  # perplexity (language model) or mean cosine (encoder), search text
    increase: float  # relative perplexity increase, or mean 1 - cosine, search text
    within: bool | None = None  # within the budget it was made for (mixed plans)
    margin: float | None = None  # the search's margin on ``increase`` (mixed plans)
    confirmed: float | None = None  # increase on the confirmation text (mixed plans)


def metric_name(task: Task) -> str:
    return "perplexity" if task.kind == "lm" else "mean cosine"


def texts_line(task: Task) -> str:
    """Which text each column was measured on."""
    return (
        f"Search text: {task.search_text}. Confirmation text: {task.confirm_text}, which "
        "no search saw; a mixed plan's accuracy is its figure there."
    )


def scheme_table(rows: list[SchemeResult], task: Task, total_other_bytes: int) -> str:
    """Markdown: scheme, linear-layer MB, whole-model MB, metric and increase on the search
    text, the search's margin, the increase on the confirmation text, within budget there."""
    inc = "ppl increase" if task.kind == "lm" else "1 - cosine"
    lines = [
        texts_line(task),
        "",
        f"| scheme | linear layers (MB) | model (MB) | {metric_name(task)} (search) "
        f"| {inc} (search) | margin | {inc} (confirmation) | within budget (confirmation) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | :---: |",
    ]
    for r in rows:
        within = "" if r.within is None else ("yes" if r.within else "**no**")
        margin = "" if r.margin is None else f"{r.margin:.3%}"
        confirmed = "" if r.confirmed is None else f"{r.confirmed:+.3%}"
        lines.append(
            f"| {r.name} | {r.nbytes / 1e6:.1f} | {(r.nbytes + total_other_bytes) / 1e6:.1f} "
            f"| {r.metric:.4f} | {r.increase:+.3%} | {margin} | {confirmed} | {within} |"
        )
    return "\n".join(lines)


def mixed_row(outcome: CompressionOutcome, task: Task, name: str, metric: float) -> SchemeResult:
    """The comparison-table row of a mixed plan (``metric``: on the search text)."""
    final, conf = outcome.result.final, outcome.confirmation
    margin = task.describe(final.upper) - task.describe(final.measured)
    confirmed = None if conf is None else task.describe(conf.increase)
    return scheme_of(outcome.table, final.choice, name, metric, task.describe(final.measured),
                     outcome.met, margin, confirmed)  # fmt: skip


def plan_summary(outcome: CompressionOutcome, task: Task) -> str:
    """Markdown: the verdict, each search's rounds and confirmation, the options used."""
    table = outcome.table
    lines = [f"**{outcome.verdict}**"]
    for k, result in enumerate(outcome.searches, 1):
        title = "search" if len(outcome.searches) == 1 else f"search {k}"
        lines += [
            "",
            f"{title} on {task.search_text}, budget {task.describe(result.budget):.3%} "
            "(increase + margin must fit):",
            "",
            "| round | predicted budget | predicted | measured | margin | within | linear MB |",
            "| ---: | ---: | ---: | ---: | ---: | :---: | ---: |",
        ]
        lines += [_round_row(i, rnd, result.budget, task) for i, rnd in enumerate(result.rounds, 1)]
        conf = result.confirmation
        if conf is not None:
            lines += ["", f"round {result.chosen + 1} confirmed on {conf.text}: "
                      f"{task.describe(conf.increase):+.3%} (margin "
                      f"{task.describe(conf.increase + conf.margin) - task.describe(conf.increase):.3%}), "
                      f"{'within' if conf.within else '**over**'} the budget"]  # fmt: skip
    final = outcome.result.final.choice
    counts = Counter(final.values())
    lines += [
        "",
        "| option | layers | MB | predicted | measured alone (search) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    checked = {c.option: c for c in outcome.option_checks}
    for name, count in sorted(counts.items(), key=lambda kv: -kv[1]):
        mb = sum(table.option(lay, name).nbytes for lay, n in final.items() if n == name) / 1e6
        c = checked.get(name)
        pred = "" if c is None else f"{task.describe(c.predicted):+.3%}"
        meas = "" if c is None else f"{task.describe(c.measured):+.3%}"
        lines.append(f"| {name} | {count} | {mb:.1f} | {pred} | {meas} |")
    return "\n".join(lines)


def _round_row(i: int, rnd: PlanRound, budget: float, task: Task) -> str:
    margin = task.describe(rnd.upper) - task.describe(rnd.measured)
    return (
        f"| {i} | {task.describe(rnd.predicted_budget):+.3%} | {task.describe(rnd.predicted):+.3%} "
        f"| {task.describe(rnd.measured):+.3%} | {margin:.3%} "
        f"| {'yes' if rnd.upper <= budget else 'no'} | {rnd.nbytes / 1e6:.1f} |"
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
    """The predicted frontier, and uniform schemes and mixed plans as measured on the search
    text (one text for every point, so that they compare; the table has the confirmation)."""
    from kiln.compress.frontier_plot import plot_frontier

    uniform = {r.name: (float(r.nbytes), 100 * r.increase) for r in rows if r.within is None}
    chosen = {r.name: (float(r.nbytes), 100 * r.increase) for r in rows if r.within is not None}
    y_label = "perplexity increase" if task.kind == "lm" else "1 - cosine"
    y_label += f" (%), {task.search_text}"
    return plot_frontier(
        frontier_in_units(outcome_frontier, task), path, uniform=uniform, chosen=chosen,
        x_label="linear layers (MB)", y_label=y_label, title=title, y_log=True,
    )  # fmt: skip


def scheme_of(table: SensitivityTable, choice: dict[str, str], name: str, metric: float,
              increase: float, within: bool | None = None, margin: float | None = None,
              confirmed: float | None = None) -> SchemeResult:  # fmt: skip
    return SchemeResult(
        name, plan_nbytes(table, choice), metric, increase, within, margin, confirmed
    )
