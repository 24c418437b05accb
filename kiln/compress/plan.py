"""The mixed-precision plan: allocate one option per layer, measure, tighten, repeat.

1. ``allocate`` (grouped knapsack, exact) picks the cheapest per-layer choice whose
   *predicted* loss increase fits the budget.
2. The chosen model's loss increase is *measured* on the search text (``measure(model)``,
   e.g. the log of the perplexity ratio on *Pride and Prejudice*), with a confidence margin
   from its spread across windows or sentences (``kiln.quality.spread``). The plan counts
   as within budget only if increase + margin is.
3. Over budget: the prediction under-estimated; scale the predicted budget by
   budget / (increase + margin) (aiming a little lower) and go to 1. Within budget: done.

The search never reports a plan as within budget that was not measured to be, margin
included. It does not confirm the plan on unseen text: the caller does that
(``workflow.compress_to_budget``) and records it as the result's ``confirmation``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import nn

from kiln.compress.allocate import FrontierPoint, Objective, Option, allocate, pareto_frontier
from kiln.compress.rounds import RoundStore
from kiln.compress.sensitivity import DENSE, SensitivityTable
from kiln.compress.verbs import set_submodule
from kiln.quality.spread import PairedDifference

# A measured loss increase: with its margin, or a bare float (a margin of 0).
Measure = Callable[[nn.Module], PairedDifference | float]
TIGHTEN_MARGIN = 0.9  # aim a little below what the last round's ratio says
LOOSEN_BELOW = 0.8  # a plan measured within budget but under 80 % of it is loosened
LOOSEN_FLOOR = 0.05  # measured increases below 5 % of the budget count as 5 % (noise)
MAX_STEP = 4.0  # the predicted budget moves by at most 4x per round
CONVERGED = 1.1  # stop once the within/over predicted budgets are this close


@dataclass(frozen=True)
class PlanRound:
    predicted_budget: float
    predicted: float  # the allocation's summed predicted loss
    measured: float  # measured loss increase on the search text
    margin: float  # z standard errors of ``measured`` (0 when the measure gives none)
    nbytes: int
    choice: dict[str, str]  # layer -> option name

    @property
    def upper(self) -> float:
        """What the search compares with the budget: the increase plus its margin."""
        return self.measured + self.margin


@dataclass(frozen=True)
class Confirmation:
    """The chosen plan measured on the confirmation text, which its search never saw."""

    text: str  # which text, e.g. "Sense and Sensibility (first 20,000 tokens)"
    increase: float  # measured loss increase there: the plan's reported accuracy
    margin: float  # z standard errors of ``increase``, for information only
    within: bool  # increase <= the budget asked for (not the search's tightened one)


@dataclass(frozen=True)
class PlanResult:
    budget: float  # the loss budget this search worked to (increase + margin <= budget)
    rounds: tuple[PlanRound, ...]
    met: bool  # a plan was within ``budget`` on the search text, margin included
    chosen: int  # index of the chosen round: the smallest within budget, else the last
    confirmation: Confirmation | None = None  # the chosen plan on the confirmation text

    @property
    def final(self) -> PlanRound:
        """The chosen plan: measured within budget (margin included) when ``met``."""
        return self.rounds[self.chosen]


def groups(
    table: SensitivityTable, latency: dict[tuple[str, str], float] | None = None
) -> list[list[Option]]:
    """The knapsack's groups: one per layer, its options in table order."""
    return [
        [
            Option(
                o.name, o.nbytes, max(o.predicted, 0.0), (latency or {}).get((layer, o.name), 0.0)
            )
            for o in opts
        ]
        for layer, opts in table.options.items()
    ]


def choice_names(table: SensitivityTable, choice: tuple[int, ...]) -> dict[str, str]:
    return {layer: opts[i].name for (layer, opts), i in zip(table.options.items(), choice)}


def plan_nbytes(table: SensitivityTable, choice: dict[str, str]) -> int:
    return sum(table.option(layer, name).nbytes for layer, name in choice.items())


@contextmanager
def applied(
    model: nn.Module, table: SensitivityTable, choice: dict[str, str]
) -> Iterator[nn.Module]:
    """``model`` with the chosen compressed layers swapped in; restored on exit."""
    originals: dict[str, nn.Module] = {}
    try:
        for layer, name in choice.items():
            module = table.option(layer, name).module
            if module is not None:
                originals[layer] = set_submodule(model, layer, module)
        yield model
    finally:
        for layer, mod in originals.items():
            set_submodule(model, layer, mod)


def apply_choice(model: nn.Module, table: SensitivityTable, choice: dict[str, str]) -> None:
    """Swap the chosen compressed layers into ``model`` for good."""
    for layer, name in choice.items():
        module = table.option(layer, name).module
        if module is not None:
            set_submodule(model, layer, module)


def uniform_choice(table: SensitivityTable, option: str) -> dict[str, str]:
    """Every layer gets ``option`` (layers that cannot take it stay dense)."""
    return {
        layer: option if any(o.name == option for o in opts) else DENSE
        for layer, opts in table.options.items()
    }


def split_measurement(value: PairedDifference | float) -> tuple[float, float]:
    """A measure's result -> (increase, margin); a bare float has a margin of 0."""
    if isinstance(value, PairedDifference):
        return value.mean, value.margin
    return float(value), 0.0


def search(
    model: nn.Module,
    table: SensitivityTable,
    budget: float,
    measure: Measure,
    *,
    objective: Objective = "bytes",
    latency: dict[tuple[str, str], float] | None = None,
    max_rounds: int = 5,
    on_round: Callable[[PlanRound], None] | None = None,
    store: RoundStore | None = None,
    start: float | None = None,
) -> PlanResult:
    """Find the cheapest plan whose measured loss increase plus margin is within ``budget``.

    Each round allocates at a *predicted* budget (the first at ``start``, by default
    ``budget``) and measures the result. The next predicted budget rescales by how far
    off the prediction was (budget / (increase + margin)), kept strictly between the
    largest predicted budget measured within the real one and the smallest measured over
    it (bisecting geometrically when the rescaled guess falls outside). A plan measured
    well under budget is loosened, not just accepted: predictions can be pessimistic too.
    The smallest plan measured within budget wins.

    With a ``store``, each measured plan is kept on disk as soon as it is measured, and a
    plan already in the store is not measured again (its kept increase and margin are used).
    """
    grp = groups(table, latency)
    predicted_budget = budget if start is None else start
    good, bad = 0.0, math.inf  # predicted budgets known to measure within / over
    rounds: list[PlanRound] = []
    best: int | None = None
    costs: list[float] = []
    for _ in range(max_rounds):
        alloc = allocate(grp, predicted_budget, objective)
        choice = choice_names(table, alloc.choice)
        if rounds and any(r.choice == choice for r in rounds):
            break  # the predicted budget moved but the plan did not: nothing new to learn
        kept = store.lookup(choice) if store is not None else None
        nbytes = plan_nbytes(table, choice)
        if kept is None:
            with applied(model, table, choice):
                measured, margin = split_measurement(measure(model))
            if store is not None:
                store.append({"choice": choice, "measured": measured, "margin": margin,
                              "text": "search", "predicted": alloc.loss,
                              "predicted_budget": predicted_budget, "budget": budget,
                              "nbytes": nbytes, "status": alloc.status})  # fmt: skip
        else:
            measured, margin = kept
        rnd = PlanRound(predicted_budget, alloc.loss, measured, margin, nbytes, choice)
        rounds.append(rnd)
        costs.append(alloc.cost)
        if on_round is not None:
            on_round(rnd)
        if rnd.upper <= budget:
            good = max(good, predicted_budget)
            if best is None or alloc.cost < costs[best]:
                best = len(rounds) - 1
            if rnd.upper >= LOOSEN_BELOW * budget:
                break  # close enough to the budget: more rounds would gain little
        else:
            bad = min(bad, predicted_budget)
            if alloc.loss <= 0.0:  # even the least-loss plan measures over budget
                break
        ratio = budget / max(rnd.upper, LOOSEN_FLOOR * budget)
        guess = max(alloc.loss, 1e-12) * TIGHTEN_MARGIN * min(ratio, MAX_STEP)
        if not good < guess < bad:
            if good > 0 and bad < math.inf:
                guess = math.sqrt(good * bad)
            else:
                guess = good * 2 if bad == math.inf else bad / 2
        if bad < math.inf and bad / max(good, 1e-300) < CONVERGED:
            break
        predicted_budget = guess
    if best is None:
        return PlanResult(budget, tuple(rounds), met=False, chosen=len(rounds) - 1)
    return PlanResult(budget, tuple(rounds), met=True, chosen=best)


def frontier(
    table: SensitivityTable,
    objective: Objective = "bytes",
    latency: dict[tuple[str, str], float] | None = None,
    max_points: int = 40,
) -> list[FrontierPoint]:
    """Size (or latency) vs predicted loss, non-dominated plans, for the planner and plots."""
    return pareto_frontier(groups(table, latency), objective, max_points=max_points)
