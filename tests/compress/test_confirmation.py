"""The search's confidence margin and the confirmation on a text the search never saw, on
the toy MLP: what counts as within budget, what is reported, what is resumed."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from kiln.compress import workflow
from kiln.compress.configs import Int4WeightOnly, Int8WeightOnly, SemiStructured24
from kiln.compress.modules import CompressedLinear
from kiln.compress.plan import search
from kiln.compress.plan_report import mixed_row, plan_summary
from kiln.compress.rounds import plan_key
from kiln.compress.sensitivity import SensitivityTable
from kiln.quality.spread import PairedDifference
from tests.compress.toy import ToyTask, correlated_inputs, toy_mlp

OPTIONS = (
    Int8WeightOnly(method="gptq"),
    Int4WeightOnly(group_size=32, method="gptq"),
    SemiStructured24(method="sparsegpt"),
)


@pytest.fixture(scope="module")
def analysed() -> tuple[ToyTask, SensitivityTable]:
    task = ToyTask(toy_mlp(seed=4))
    return task, workflow.analyse_model(task, OPTIONS)


def test_a_plan_that_fits_only_without_its_margin_is_rejected(analysed) -> None:
    task, table = analysed
    budget = task.budget(0.01)
    fits = search(task.model, table, budget, lambda m: PairedDifference(0.9 * budget, 0.0, 9))
    assert fits.met
    over = search(
        task.model, table, budget, lambda m: PairedDifference(0.9 * budget, 0.2 * budget, 9)
    )
    assert not over.met
    assert all(r.measured <= budget < r.upper for r in over.rounds)


def test_the_search_keeps_increase_plus_margin_within_budget(analysed) -> None:
    """Measured = the prediction, margin = half of it: the chosen plan's increase plus margin
    is within budget, and the margin costs bytes against the same search without it."""
    task, table = analysed
    predicted = {id(o.module): o.predicted for opts in table.options.values() for o in opts}

    def measure(with_margin: bool):
        def fake(model: nn.Module) -> PairedDifference:
            p = sum(predicted.get(id(m), 0.0) for m in model.modules())
            return PairedDifference(p, 0.5 * p if with_margin else 0.0, 16)

        return fake

    budget = task.budget(0.01)
    bare = search(task.model, table, budget, measure(False), max_rounds=8)
    guarded = search(task.model, table, budget, measure(True), max_rounds=8)
    assert bare.met and guarded.met
    assert guarded.final.upper == pytest.approx(1.5 * guarded.final.measured)
    assert guarded.final.upper <= budget
    assert guarded.final.nbytes >= bare.final.nbytes
    if 1.5 * bare.final.measured > budget:  # the bare plan does not fit with its margin
        assert guarded.final.choice != bare.final.choice


class ShiftedTask(ToyTask):
    """The toy task whose confirmation text loses ``factor`` times what the search text
    does (or a constant ``fixed`` loss), so the two figures are told apart."""

    def __init__(self, model: nn.Module, factor: float = 1.0, fixed: float | None = None) -> None:
        super().__init__(model)
        self.factor, self.fixed = factor, fixed
        self.confirmed: list[float] = []

    def measure_confirmation(self, model: nn.Module) -> PairedDifference:
        real = super().measure_confirmation(model)
        if self.fixed is not None:
            value = self.budget(self.fixed)
        else:
            value = self.factor * ToyTask.measure_search(self, model).mean
        self.confirmed.append(value)
        return PairedDifference(value, real.margin, real.n)


def test_reported_accuracy_is_the_confirmation_figure() -> None:
    task = ShiftedTask(toy_mlp(seed=4), factor=0.5)
    out = workflow.compress_to_budget(task, 0.01, options=OPTIONS, check=False)
    final, conf = out.result.final, out.confirmation
    assert out.met and conf is not None and conf.within
    assert len(out.searches) == 1 and task.confirmed == [conf.increase]
    assert conf.increase == pytest.approx(0.5 * final.measured, rel=1e-9)
    assert conf.text == "toy confirmation inputs"
    shown = f"{task.describe(conf.increase):+.3%}"
    assert out.verdict.startswith(f"confirmed: loss {shown} on toy confirmation inputs")
    row = mixed_row(out, task, "mixed", 1.0)
    assert row.confirmed == pytest.approx(task.describe(conf.increase))
    assert row.increase == pytest.approx(task.describe(final.measured))  # the search figure
    assert row.within is True
    assert f"confirmed on toy confirmation inputs: {shown}" in plan_summary(out, task)
    assert any(isinstance(m, CompressedLinear) for m in task.model.modules())


def test_a_failed_confirmation_searches_once_more_tighter() -> None:
    """Confirmation 3x the search figure: the first plan fails it; the second search aims at
    the first plan's search figure scaled down by the overshoot, and its plan passes."""
    task = ShiftedTask(toy_mlp(seed=4), factor=3.0)
    out = workflow.compress_to_budget(task, 0.01, options=OPTIONS, check=False)
    budget = task.budget(0.01)
    first, second = out.searches
    assert first.confirmation is not None and not first.confirmation.within
    assert first.confirmation.increase > budget
    scale = workflow.TIGHTEN_MARGIN * budget / first.confirmation.increase
    assert second.budget == pytest.approx(first.final.upper * scale)
    assert second.rounds[0].predicted_budget == pytest.approx(first.final.predicted_budget * scale)
    assert out.result is second and out.met
    assert out.confirmation is not None and out.confirmation.increase <= budget
    assert out.result.final.nbytes > first.final.nbytes  # tighter costs bytes
    assert out.verdict.startswith("confirmed:")


def test_could_not_confirm_is_said_plainly_and_the_model_is_left_alone() -> None:
    task = ShiftedTask(toy_mlp(seed=4), fixed=0.03)  # always 3 % on the unseen text
    out = workflow.compress_to_budget(task, 0.01, options=OPTIONS, check=False)
    assert not out.met
    assert len(out.searches) == 1 + workflow.CONFIRM_RETRIES
    assert all(s.met and s.confirmation and not s.confirmation.within for s in out.searches)
    assert out.verdict.startswith(
        "could not confirm: loss +3.000% on toy confirmation inputs for a 1.00% budget"
    )
    assert out.confirmation is not None and out.confirmation.increase == task.budget(0.03)
    assert not any(isinstance(m, CompressedLinear) for m in task.model.modules())
    assert mixed_row(out, task, "mixed", 1.0).within is False


def test_when_the_tighter_search_finds_nothing_the_rejected_plan_is_reported() -> None:
    """Every plan measures half the budget on the search text and twice it on the unseen
    text: the first plan fails confirmation, the tighter search finds no plan at all."""
    task = ShiftedTask(toy_mlp(seed=4), fixed=0.02)
    half = task.budget(0.005)
    task.measure_search = lambda model: PairedDifference(half, 0.0, 1)  # type: ignore[method-assign]
    out = workflow.compress_to_budget(task, 0.01, options=OPTIONS, check=False)
    first, second = out.searches
    assert first.met and not second.met and second.confirmation is None
    assert out.result is first and not out.met
    assert out.verdict.startswith("could not confirm: loss +2.000% on toy confirmation inputs")
    assert out.verdict.endswith("the tighter search found no plan within it on toy search inputs")
    assert not any(isinstance(m, CompressedLinear) for m in task.model.modules())


def test_without_confirmation_the_outcome_says_so() -> None:
    task = ToyTask(toy_mlp(seed=4))
    out = workflow.compress_to_budget(task, 0.01, options=OPTIONS, check=False, confirm=False)
    assert out.confirmation is None and out.met
    assert out.verdict.startswith("not confirmed on unseen text")
    assert mixed_row(out, task, "mixed", 1.0).confirmed is None


def test_search_and_confirmation_inputs_are_disjoint() -> None:
    task = ToyTask(toy_mlp())
    search_rows = {tuple(r) for r in task.eval_inputs().tolist()}
    confirm_rows = {tuple(r) for r in task.confirm_inputs().tolist()}
    assert search_rows.isdisjoint(confirm_rows)


def test_a_rerun_resumes_everything_and_changed_settings_resume_nothing(rounds_in_tmp) -> None:
    task = ToyTask(toy_mlp(seed=4), z=1.645)
    table = workflow.analyse_model(task, OPTIONS)
    first = workflow.compress_to_budget(task, 0.01, table=table, check=False, apply=False)
    assert first.confirmation is not None and first.result.final.margin > 0

    calls: list[str] = []
    rerun = ToyTask(toy_mlp(seed=4), z=1.645)
    search_fn, confirm_fn = rerun.measure_search, rerun.measure_confirmation
    rerun.measure_search = lambda m: calls.append("s") or search_fn(m)  # type: ignore[assignment]
    rerun.measure_confirmation = lambda m: calls.append("c") or confirm_fn(m)  # type: ignore[assignment]
    again = workflow.compress_to_budget(rerun, 0.01, table=table, check=False, apply=False)
    assert calls == []  # every search round and the confirmation came from the file
    assert again.result.rounds == first.result.rounds
    assert again.confirmation == first.confirmation

    key = plan_key(task, table)
    assert plan_key(ToyTask(toy_mlp(seed=4), z=1.645), table) == key
    assert plan_key(ToyTask(toy_mlp(seed=4), z=1.2816), table) != key  # margin setting
    assert plan_key(ToyTask(toy_mlp(seed=4), z=1.645, confirm_rows=1024), table) != key

    class OtherText(ToyTask):
        def confirm_inputs(self) -> torch.Tensor:
            return correlated_inputs(self.confirm_rows, seed=6)

    assert plan_key(OtherText(toy_mlp(seed=4), z=1.645), table) != key  # confirmation data


def test_a_tighter_search_reuses_the_plans_already_measured(rounds_in_tmp) -> None:
    """The second search of a failed confirmation measures no plan the first one did."""
    task = ShiftedTask(toy_mlp(seed=4), factor=3.0)
    table = workflow.analyse_model(task, OPTIONS)
    calls: list[int] = []
    search_fn = task.measure_search

    def counting(model: nn.Module) -> PairedDifference:
        calls.append(1)
        return search_fn(model)

    task.measure_search = counting  # type: ignore[method-assign]
    out = workflow.compress_to_budget(task, 0.01, table=table, check=False)
    assert len(out.searches) == 2
    plans = {tuple(sorted(r.choice.items())) for s in out.searches for r in s.rounds}
    assert len(calls) == len(plans)  # each distinct plan measured once, across both searches


def test_each_option_of_a_plan_is_checked_alone(analysed) -> None:
    task, table = analysed
    choice = {layer: "int8-gptq" for layer in table.layers}
    (check,) = workflow.check_options(task, table, choice)
    assert dataclasses.asdict(check).keys() == {"option", "layers", "predicted", "measured"}
    assert check.option == "int8-gptq" and check.layers == len(table.layers)
