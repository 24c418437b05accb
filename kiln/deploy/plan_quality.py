"""The executed plan's perplexity, measured: the accuracy half of ``kiln plan --verify``.

The planner picks a weight format on a stated prior (``planner.PRIORS``), with no text
involved. ``--verify`` then measures what that choice costs this checkpoint: the model is
loaded as ``kiln run`` loads the plan (each block stored in the plan's format as it is
read, ``deploy.execute``) and as the float original, both score the first tokens of the
confirmation text (*Sense and Sensibility*, ``quality.corpus``) window by window, and the
increase is reported with a one-sided 95% margin from the spread of the paired window
differences (``quality.spread``):

    increase = exp(mean_w d_w) - 1          d_w: plan's mean NLL - original's, window w
    upper    = exp(mean_w d_w + margin) - 1

The plan is *confirmed* within its budget when ``upper <= budget``; an increase within
budget whose margin crosses it is reported as not confirmed, as is a checkpoint with no
tokenizer (a published config with random weights: its perplexity means nothing) or a
machine without the text installed (``python -m kiln.quality.corpus fetch``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

CONFIRM_TOKENS = 4096  # a SmolLM2-135M pass over them takes ~20-60 s on 2 cores
CONTEXT, STRIDE = 512, 256  # the perplexity windows (``quality.perplexity``)


@dataclass(frozen=True)
class AccuracyCheck:
    """The plan's measured perplexity increase beside its prior (relative: 0.01 = +1%)."""

    fmt: str
    prior: float
    budget: float | None
    increase: float | None  # None: not measured (``verdict`` says why)
    upper: float | None  # the one-sided 95% upper bound of ``increase``
    text: str
    tokens: int
    verdict: str
    ppl_original: float | None = None  # on the same tokens
    ppl_plan: float | None = None

    @property
    def confirmed(self) -> bool:
        """Measured, and within the budget even at its upper bound."""
        return self.upper is not None and self.budget is not None and self.upper <= self.budget

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"confirmed": self.confirmed}


def verdict(increase: float, upper: float, budget: float | None) -> str:
    """What a measured increase says about a budget (see the module docstring)."""
    if budget is None:
        return "measured (no accuracy budget was set)"
    if upper <= budget:
        return f"confirmed within the {budget:.2%} budget"
    if increase <= budget:
        return (f"not confirmed: +{increase:.2%} is within the {budget:.2%} budget but its "
                f"95% upper bound +{upper:.2%} is not (measure more text)")  # fmt: skip
    return f"over budget: +{increase:.2%} against {budget:.2%}"


def increase_of(
    plan_nll: torch.Tensor, base_nll: torch.Tensor, counts: torch.Tensor
) -> tuple[float, float]:
    """(increase, upper bound) from each window's mean NLL of the plan and the original
    (W,) and the tokens each window scores (W,): the token-weighted mean difference is
    exactly log(ppl_plan / ppl_original)."""
    from kiln.quality.spread import paired_difference

    d = paired_difference(plan_nll - base_nll, counts)
    return math.expm1(d.mean), math.expm1(d.mean + d.margin)


def _scorer(model: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """kiln's ``Transformer`` as ``quality.perplexity`` calls a model: ids (B, T) ->
    logits (B, T, V), a fresh cache per batch of windows."""

    def logits(ids: torch.Tensor) -> torch.Tensor:
        return model(ids, 0, model.new_cache(ids.shape[0], ids.shape[1]))

    return logits


def check_accuracy(
    model: str, fmt: str, prior: float, budget: float | None, tokens: int = CONFIRM_TOKENS,
    note: Callable[[str], None] = lambda _: None,
) -> AccuracyCheck:  # fmt: skip
    """Measure plan format ``fmt``'s perplexity increase on checkpoint ``model`` (see the
    module docstring); never raises for a checkpoint or machine that cannot be measured,
    it says so in the verdict."""
    from kiln.deploy.execute import run_request
    from kiln.deploy.generate_job import load_options, prepare
    from kiln.models.load import load_model
    from kiln.quality import corpus
    from kiln.quality.perplexity import window_losses

    text = corpus.CONFIRMATION_NOVEL

    def unmeasured(why: str) -> AccuracyCheck:
        return AccuracyCheck(fmt, prior, budget, None, None, text, 0, f"not confirmed: {why}")

    reference = load_model(model, torch.float32, packed=False, with_tokenizer=True)
    if reference.tokenizer is None:
        return unmeasured("the checkpoint has no tokenizer (random weights: no perplexity)")
    if not corpus.corpus_available():
        return unmeasured("the confirmation text is not installed "
                          "(python -m kiln.quality.corpus fetch)")  # fmt: skip
    ids = corpus.confirmation_tokens(reference.tokenizer, tokens)  # (tokens,)
    note(f"scoring the original on {ids.numel()} tokens of {text}")
    base = window_losses(_scorer(reference.model), ids, CONTEXT, STRIDE)
    del reference
    request = run_request(model, fmt)
    dtype, in_format = load_options(request)
    planned = load_model(model, dtype, packed=False, with_tokenizer=False, on_block=in_format)
    prepare(planned, request)
    note(f"scoring the plan ({fmt}) on the same tokens")
    got = window_losses(_scorer(planned.model), ids, CONTEXT, STRIDE)
    increase, upper = increase_of(got.mean_nll, base.mean_nll, base.counts)
    return AccuracyCheck(fmt, prior, budget, increase, upper, text, ids.numel(),
                         verdict(increase, upper, budget), base.total().ppl,
                         got.total().ppl)  # fmt: skip
