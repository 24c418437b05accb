"""What a weight format costs a real checkpoint in perplexity, measured: the planner's
accuracy for models kiln can load, and the accuracy half of ``kiln plan --verify``.

A format's cost is measured by loading the model as ``kiln run`` loads a plan (each block
stored in the format as it is read, ``deploy.execute``) and as the float original, and
scoring both on the same tokens window by window; the increase is reported with a
one-sided 95% margin from the spread of the paired window differences (``quality.spread``):

    increase = exp(mean_w d_w) - 1          d_w: plan's mean NLL - original's, window w
    upper    = exp(mean_w d_w + margin) - 1

Two texts, kept apart (``quality.corpus``):

* the *search* text (*Pride and Prejudice*): ``measure_formats`` scores every candidate
  format there, and the planner (``planner.accuracy_of``) takes each one's upper bound as
  its accuracy in place of the published-result prior (``planner.PRIORS``), which a small
  model misses by far (SmolLM2-135M: INT4-g32 at +23.6% perplexity, prior +1%);
* the *confirmation* text (*Sense and Sensibility*): ``check_accuracy`` scores the chosen
  plan there (``--verify``), text its choice never saw.

A plan is *confirmed* within its budget when ``upper <= budget``; an increase within budget
whose margin crosses it is reported as not confirmed, as is a checkpoint with no tokenizer
(a published config with random weights: its perplexity means nothing) or a machine
without the texts installed (``python -m kiln.quality.corpus fetch``).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kiln.quality.perplexity import WindowLosses

CONFIRM_TOKENS = 4096  # a SmolLM2-135M pass over them takes ~20-60 s on 2 cores
SEARCH_TOKENS = 2048  # per format the planner measures (cached per checkpoint)
VERSION = 1  # of the cached measurements
CONTEXT, STRIDE = 512, 256  # the perplexity windows (``quality.perplexity``)


@dataclass(frozen=True)
class AccuracyCheck:
    """The plan's measured perplexity increase beside the one planned (relative: 0.01 = +1%)."""

    fmt: str
    planned: float  # the increase the planner counted on (measured on the search text, or a prior)
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
        return (f"not confirmed: {increase:+.2%} is within the {budget:.2%} budget but its "
                f"95% upper bound {upper:+.2%} is not (measure more text)")  # fmt: skip
    return f"over budget: {increase:+.2%} against {budget:.2%}"


def increase_of(
    plan_nll: torch.Tensor, base_nll: torch.Tensor, counts: torch.Tensor
) -> tuple[float, float]:
    """(increase, upper bound) from each window's mean NLL of the plan and the original
    (W,) and the tokens each window scores (W,): the token-weighted mean difference is
    exactly log(ppl_plan / ppl_original)."""
    from kiln.quality.spread import paired_difference

    d = paired_difference(plan_nll - base_nll, counts)
    return math.expm1(d.mean), math.expm1(d.mean + d.margin)


def too_large_to_score(model: str, meminfo: str = "/proc/meminfo") -> str | None:
    """Why ``model`` cannot be scored on this machine (None when it can): scoring holds the
    model in fp32 (the original) or in a plan format, one at a time, plus a batch of
    windows' logits (4 x 512 positions x the vocabulary, fp32), and must stay within half
    of the memory available now."""
    from kiln.deploy.architecture import read_architecture
    from kiln.deploy.hardware import meminfo_bytes

    arch = read_architecture(model)
    need = 4 * arch.total_params + 4 * 4 * CONTEXT * arch.vocab_size * 2  # logits and softmax
    have = meminfo_bytes("MemAvailable", meminfo)
    if need <= have / 2:
        return None
    return (f"scoring it needs about {need / 2**30:.1f} GiB, more than half of the "
            f"{have / 2**30:.1f} GiB available here")  # fmt: skip


def logits_fn(model: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """kiln's ``Transformer`` as ``quality.perplexity`` calls a model: ids (B, T) ->
    logits (B, T, V), a fresh cache per batch of windows."""

    def logits(ids: torch.Tensor) -> torch.Tensor:
        return model(ids, 0, model.new_cache(ids.shape[0], ids.shape[1]))

    return logits


def unscorable(model: str) -> str | None:
    """Why ``model`` cannot be scored here (None when it can): no tokenizer, too large for
    this machine's memory, or the texts not installed. Reads no weight."""
    from kiln.models.load import has_tokenizer
    from kiln.quality import corpus

    if not has_tokenizer(model):
        return "the checkpoint has no tokenizer (random weights: no perplexity)"
    large = too_large_to_score(model)
    if large is not None:
        return large
    if not corpus.corpus_available():
        return "the texts are not installed (python -m kiln.quality.corpus fetch)"
    return None


def _score(
    model: str, formats: Sequence[str], text: str, tokens: int, note: Callable[[str], None]
) -> tuple[WindowLosses, dict[str, WindowLosses]]:
    """The float original's window losses on the first ``tokens`` tokens of novel ``text``,
    and each of ``formats``' on the same windows (one model in memory at a time)."""
    from kiln.deploy.mixed import shown
    from kiln.models.load import load_model
    from kiln.quality import corpus
    from kiln.quality.perplexity import window_losses

    reference = load_model(model, torch.float32, packed=False, with_tokenizer=True)
    assert reference.tokenizer is not None  # checked by ``unscorable``
    ids = corpus.first_tokens(text, reference.tokenizer, tokens)  # (tokens,): exactly, or raises
    note(f"scoring the original on {ids.numel()} tokens of {text}")
    base = window_losses(logits_fn(reference.model), ids, CONTEXT, STRIDE)
    del reference
    out = {}
    for fmt in formats:
        note(f"scoring {shown(fmt)} on the same tokens")
        out[fmt] = window_losses(_loaded_scorer(model, fmt), ids, CONTEXT, STRIDE)
    return base, out


def check_accuracy(
    model: str, fmt: str, planned: float, budget: float | None, tokens: int = CONFIRM_TOKENS,
    note: Callable[[str], None] = lambda _: None,
) -> AccuracyCheck:  # fmt: skip
    """Measure plan format ``fmt``'s perplexity increase on checkpoint ``model`` (see the
    module docstring); never raises for a checkpoint or machine that cannot be measured,
    it says so in the verdict."""
    from kiln.quality import corpus

    text = corpus.CONFIRMATION_NOVEL
    why = unscorable(model)
    if why is not None:
        return AccuracyCheck(fmt, planned, budget, None, None, text, 0, f"not confirmed: {why}")
    base, got = _score(model, [fmt], text, tokens, note)
    increase, upper = increase_of(got[fmt].mean_nll, base.mean_nll, base.counts)
    return AccuracyCheck(fmt, planned, budget, increase, upper, text, tokens,
                         verdict(increase, upper, budget), base.total().ppl,
                         got[fmt].total().ppl)  # fmt: skip


@dataclass(frozen=True)
class MeasuredAccuracy:
    """Each format's perplexity increase on the search text, as its 95% upper bound."""

    upper: Mapping[str, float]
    source: str  # what and where: for every output that shows the figure
    increase: Mapping[str, float] = field(default_factory=dict)  # the estimates themselves

    def merged(self, upper: Mapping[str, float], increase: Mapping[str, float]) -> MeasuredAccuracy:
        """These measurements with more (of the same text and tokens) added."""
        return MeasuredAccuracy({**self.upper, **upper}, self.source,
                                {**self.increase, **increase})  # fmt: skip


def _loaded_scorer(model: str, fmt: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """``model`` loaded in plan format ``fmt`` as ``kiln run`` loads it, as a scorer."""
    from kiln.deploy.execute import run_request
    from kiln.deploy.generate_job import load_options, prepare
    from kiln.models.load import load_model

    request = run_request(model, fmt)
    dtype, in_format = load_options(request)
    planned = load_model(model, dtype, packed=False, with_tokenizer=False, on_block=in_format)
    prepare(planned, request)
    return logits_fn(planned.model)


def checkpoint_key(model: str) -> str:
    """What identifies a checkpoint file or folder: its resolved path, size and
    modification time."""
    from kiln.models.load import resolve

    where = resolve(model)
    stat = where.stat()
    return f"{where.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"


def checkpoint_bytes(model: str) -> int:
    """Bytes of the checkpoint file(s) kiln's loader maps for ``model`` (0 for a config-only
    model: nothing is loaded)."""
    from kiln.models.load import LoadError, resolve

    try:
        path = resolve(model)
    except LoadError:  # a config.json-style file: planned on paper, never loaded
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(
        f.stat().st_size for f in path.iterdir() if f.suffix in (".safetensors", ".bin", ".gguf")
    )


def _cache_path(model: str, fmt: str, tokens: int) -> Any:
    """Where one format's measurement of ``model`` is kept: keyed by the checkpoint
    (``checkpoint_key``), the format, the tokens scored and torch's version."""
    from kiln.core.cache import cache_dir

    key = f"{checkpoint_key(model)}|{fmt}|{tokens}|{torch.__version__}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return cache_dir("plan_accuracy") / f"v{VERSION}-{digest}.json"


def measure_formats(
    model: str, formats: Sequence[str], tokens: int = SEARCH_TOKENS,
    note: Callable[[str], None] = lambda _: None,
) -> MeasuredAccuracy | None:  # fmt: skip
    """Each of ``formats``' perplexity increase on ``model`` over the first ``tokens``
    tokens of the search text (95% upper bound; the float original itself is 0), cached per
    checkpoint and format. None when it cannot be measured here (no tokenizer, texts not
    installed): the planner then keeps its priors."""
    from kiln.quality import corpus

    text = corpus.SEARCH_NOVEL
    source = f"measured: 95% upper bound on {tokens} tokens of {text}"
    cached: dict[str, float] = {}
    estimates: dict[str, float] = {"fp32": 0.0}
    for fmt in formats:
        path = _cache_path(model, fmt, tokens)
        if path.is_file():
            kept = json.loads(path.read_text(encoding="utf-8"))
            cached[fmt], estimates[fmt] = float(kept["upper"]), float(kept["increase"])
    missing = [f for f in formats if f not in cached and f != "fp32"]
    if not missing:
        return MeasuredAccuracy({**cached, "fp32": 0.0}, source, estimates)
    why = unscorable(model)
    if why is not None:
        note(f"accuracy per format stays a prior: {why}")
        return None
    note(f"measuring perplexity per weight format on {tokens} tokens of {text} (cached)")
    base, got = _score(model, missing, text, tokens, note)
    for fmt, losses in got.items():
        increase, upper = increase_of(losses.mean_nll, base.mean_nll, base.counts)
        cached[fmt], estimates[fmt] = upper, increase
        _cache_path(model, fmt, tokens).write_text(
            json.dumps({"format": fmt, "increase": increase, "upper": upper, "tokens": tokens,
                        "text": text}), encoding="utf-8")  # fmt: skip
    return MeasuredAccuracy({**cached, "fp32": 0.0}, source, estimates)
