"""Compress a model to an accuracy budget, end to end.

    calibrate -> analyse every (layer, option) -> allocate + measure + tighten
              -> confirm the picked options by measurement -> (caller saves)

``compress_to_budget`` leaves the model compressed with the final plan when the budget
was met, and untouched otherwise. Progress goes to an optional ``Reporter``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from torch import nn

from kiln.compress.allocate import FrontierPoint, Objective
from kiln.compress.configs import (
    CompressionConfig,
    Int4WeightOnly,
    Int8WeightOnly,
    LowRank,
    SemiStructured24,
)
from kiln.compress.moments import collect_stats, linear_layers
from kiln.compress.plan import PlanResult, PlanRound, apply_choice, frontier, search
from kiln.compress.rounds import RoundStore, default_path, plan_key
from kiln.compress.sensitivity import DENSE, SensitivityTable, analyse, measured_layer_loss
from kiln.compress.tasks import Task

# The options the mixed plan chooses among by default: the error-compensating variants
# (they beat round-to-nearest at equal bytes). Symmetric INT4 only: SmolLM2's published
# weights are themselves Q4_1 (asymmetric, groups of 32), so asymmetric g32 would
# reproduce them exactly and flatter the plan.
DEFAULT_OPTIONS: tuple[CompressionConfig, ...] = (
    Int8WeightOnly(method="gptq"),
    Int4WeightOnly(group_size=128, method="gptq"),
    Int4WeightOnly(group_size=64, method="gptq"),
    Int4WeightOnly(group_size=32, method="gptq"),
    SemiStructured24(method="sparsegpt"),
    LowRank(max_error=0.3, activation_aware=True),
)


class Reporter(Protocol):
    def stage(self, name: str, total: int) -> None: ...
    def advance(self, done: int, total: int) -> None: ...
    def note(self, text: str) -> None: ...


@dataclass(frozen=True)
class Confirmation:
    option: str
    layers: int
    predicted: float  # summed predicted loss increase of the layers with this option
    measured: float  # measured loss increase with only those layers compressed


@dataclass
class CompressionOutcome:
    table: SensitivityTable
    result: PlanResult
    frontier: list[FrontierPoint]
    confirmations: list[Confirmation]
    baseline: float  # the task's baseline metric (perplexity for a language model)


def analyse_model(
    task: Task, options: Sequence[CompressionConfig], reporter: Reporter | None = None
) -> SensitivityTable:
    """Calibrate the task's model and predict every (layer, option)'s loss increase."""
    model = task.model
    task.baseline()  # on the original model, before any layer is swapped
    layers = linear_layers(model)
    batches = task.calibration()
    if reporter:
        reporter.stage("calibrating (forward + backward)", len(batches))
    stats = collect_stats(
        model, batches, layers, loss_fn=task.loss_fn, n_batches=len(batches),
        progress=reporter.advance if reporter else None,
    )  # fmt: skip
    if reporter:
        reporter.stage("compressing every layer with every option", len(layers))
    return analyse(layers, stats, options, progress=reporter.advance if reporter else None)


def confirm(
    task: Task, table: SensitivityTable, choice: dict[str, str], reporter: Reporter | None = None
) -> list[Confirmation]:
    """For each option the plan uses, measure the loss increase of compressing only the
    layers that use it, next to the prediction for those layers."""
    by_option: dict[str, list[str]] = {}
    for layer, name in choice.items():
        if name != DENSE:
            by_option.setdefault(name, []).append(layer)
    if reporter:
        reporter.stage("confirming the picked options by measurement", len(by_option))
    out = []
    for i, (name, layers) in enumerate(sorted(by_option.items())):
        swaps = {layer: table.option(layer, name).module for layer in layers}
        measured = measured_layer_loss(task.model, swaps, task.measure)  # type: ignore[arg-type]
        predicted = sum(table.option(layer, name).predicted for layer in layers)
        out.append(Confirmation(name, len(layers), predicted, measured))
        if reporter:
            reporter.advance(i + 1, len(by_option))
    return out


def compress_to_budget(
    task: Task,
    max_increase: float,
    *,
    options: Sequence[CompressionConfig] = DEFAULT_OPTIONS,
    objective: Objective = "bytes",
    table: SensitivityTable | None = None,
    check: bool = True,
    apply: bool = True,
    reporter: Reporter | None = None,
    resume: bool = True,
    rounds_dir: Path | None = None,
) -> CompressionOutcome:
    """Find and apply the smallest plan whose measured increase is within ``max_increase``
    (relative perplexity for a language model, mean 1 - cosine for an encoder).

    ``table`` reuses an earlier analysis (several budgets, one calibration); with
    ``apply=False`` the model is left uncompressed whatever the outcome.

    Every measured plan is kept in ``<rounds_dir>/<key>.json`` (by default under
    ``cache_dir("compress-rounds")``; ``rounds.plan_key``) as soon as it is measured, and a
    rerun of the same model, task and options measures none of them again; ``resume=False``
    neither reads nor writes the file."""
    if table is None:
        table = analyse_model(task, options, reporter)
    if reporter:
        reporter.stage("measuring the original model", 1)
    baseline = task.baseline()
    budget = task.budget(max_increase)

    def on_round(rnd: PlanRound) -> None:
        if reporter:
            reporter.note(
                f"plan of {rnd.nbytes / 1e6:.1f} MB: predicted {task.describe(rnd.predicted):+.3%}, "
                f"measured {task.describe(rnd.measured):+.3%} (budget {max_increase:.2%})"
            )

    latency = None
    if objective == "latency":
        from kiln.compress.latency import measure_latency

        if reporter:
            reporter.stage("timing every (layer, option) at batch 1", len(table.options))
        latency = measure_latency(
            table, linear_layers(task.model), progress=reporter.advance if reporter else None
        )
    store = None
    if resume:
        key = plan_key(task, table)
        store = RoundStore(default_path(key, rounds_dir), key)
        if reporter and store.resumed:
            reporter.note(f"resumed {store.resumed} measured plans from {store.path}")
    if reporter:
        reporter.stage("allocating, measuring, tightening", 1)
    result = search(
        task.model, table, budget, task.measure, objective=objective, latency=latency,
        on_round=on_round, store=store,
    )  # fmt: skip
    confirmations = confirm(task, table, result.final.choice, reporter) if check else []
    if result.met and apply:
        apply_choice(task.model, table, result.final.choice)
    return CompressionOutcome(
        table, result, frontier(table, objective, latency), confirmations, baseline
    )


def model_nbytes(model: nn.Module) -> int:
    """Bytes of all parameters and buffers, each shared tensor counted once."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total
