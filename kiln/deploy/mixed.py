"""Per-layer mixed weight formats: the compression allocator's size / loss frontier as
candidates of the deployment planner.

A *mixed* format stores each linear layer of the blocks in one of the weight-only formats
kiln runs (INT8, INT4 in groups of 128, 64 or 32; the head is INT8 as in every packed
plan). It is written as one string, its *spec*, so it travels wherever a format name
does (plan documents, ``kiln run``, rank processes): ``mixed:`` and one letter per block
linear, in the model's module order (``layers.0.attn.q``, ``layers.0.attn.k``, ...)::

    mixed:8a8ab...      "8" int8, "a" int4-g128, "b" int4-g64, "c" int4-g32

Where mixed formats come from: the checkpoint's block linears are calibrated on *Emma*
(inputs' second moments and output gradients, as ``kiln compress`` does), every layer is
stored in every candidate format exactly as execution stores it, and each (layer,
format) gets a second-order estimate of its loss increase (``compress.sensitivity``;
``mixed_measure.sensitivity_of``, cached). For each of a ladder of perplexity targets (``TARGETS``,
and the request's budget), the allocator (``compress.allocate.allocate``: exact, HiGHS
or DP) picks the smallest per-layer plan predicted within it (``frontier``): the size /
loss frontier at the points a budget can ask for, uniform plans left to the planner.

The per-layer estimate is a sum of independent second-order terms and can be off by far
(10x has been seen on an already-quantized model), so it is calibrated on measurement
(``calibration_of``): a plan's loss beyond the least-loss measured plan's (uniform INT8)
is scaled by the largest measured / predicted ratio of the plans measured on the search
text (the uniform formats first, then every mixed plan the planner measures), added to
that plan's measured increase, and a measurement's margin (its 95% upper bound above the
increase) is interpolated from theirs. A mixed plan's accuracy is that *predicted* upper
bound, labelled so, until the planner has measured it (``plan_job``: the mixed plan it
would choose is measured, the calibration refitted, the frontier drawn again, up to
``plan_job.MIXED_ROUNDS`` times), as ``kiln compress`` measures and tightens its plans.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kiln.compress.sensitivity import SensitivityTable

PREFIX = "mixed:"
CODES = {"int8": "8", "int4-g128": "a", "int4-g64": "b", "int4-g32": "c"}
FORMAT_OF = {code: fmt for fmt, code in CODES.items()}
SOURCE = "predicted: the allocator's per-layer losses, calibrated on the plans measured so far"


def is_mixed(fmt: str) -> bool:
    return fmt.startswith(PREFIX)


def spec_of(formats: Sequence[str]) -> str:
    """The spec of one format per block linear (module order)."""
    bad = sorted(set(formats) - set(CODES))
    if bad:
        raise ValueError(f"a mixed plan stores layers as {sorted(CODES)}; not {bad}")
    return PREFIX + "".join(CODES[f] for f in formats)


def parse_spec(spec: str) -> list[str]:
    """One format per block linear, from a spec; a malformed spec raises naming the fault."""
    if not is_mixed(spec):
        raise ValueError(f"{spec!r} is not a mixed format (it starts with {PREFIX!r})")
    codes = spec[len(PREFIX) :]
    bad = sorted(set(codes) - set(FORMAT_OF))
    if not codes or bad:
        raise ValueError(f"mixed format {label(spec)}: letters must be from "
                         f"{''.join(FORMAT_OF)}, got {bad or 'none'}")  # fmt: skip
    return [FORMAT_OF[c] for c in codes]


def label(spec: str) -> str:
    """A short name for tables: ``mixed-3f2a (int8 x 120, int4-g64 x 90)`` (a digest of
    the spec, then the layers in each format)."""
    codes = spec[len(PREFIX) :]
    counts = {fmt: codes.count(code) for fmt, code in CODES.items() if code in codes}
    parts = ", ".join(f"{fmt} x {n}" for fmt, n in counts.items())
    digest = hashlib.sha256(spec.encode()).hexdigest()[:4]
    return f"mixed-{digest} ({parts})"


def shown(fmt: str) -> str:
    """How outputs name any weight format: a mixed spec by its ``label``, others as is."""
    return label(fmt) if is_mixed(fmt) else fmt


def per_block(spec: str, linears_per_block: int) -> list[list[str]]:
    """The spec's formats grouped by block (every block has ``linears_per_block``)."""
    formats = parse_spec(spec)
    if len(formats) % linears_per_block:
        raise ValueError(f"mixed format {label(spec)}: {len(formats)} layers is not a whole "
                         f"number of blocks of {linears_per_block}")  # fmt: skip
    n = linears_per_block
    return [formats[i : i + n] for i in range(0, len(formats), n)]


@dataclass(frozen=True)
class Shares:
    """How a mixed plan's block weights divide among its formats: (format, share of the
    stored bytes, share of the parameters), and the mean stored bits per weight."""

    parts: tuple[tuple[str, float, float], ...]
    bits: float


def shares(spec: str, sizes: Sequence[int], bits_of: Mapping[str, float]) -> Shares:
    """``sizes``: the parameter count of each block linear of one block (module order),
    the same in every block; ``bits_of``: each format's stored bits per weight."""
    blocks = per_block(spec, len(sizes))
    params: dict[str, float] = {}
    for block in blocks:
        for fmt, size in zip(block, sizes, strict=True):
            params[fmt] = params.get(fmt, 0.0) + size
    bits = {f: p * bits_of[f] for f, p in params.items()}
    total_p, total_b = sum(params.values()), sum(bits.values())
    parts = tuple((f, bits[f] / total_b, params[f] / total_p) for f in params)
    return Shares(parts, total_b / total_p)


@dataclass(frozen=True)
class Sensitivity:
    """Each block linear (module order) with its options: (format, stored bytes, predicted
    loss increase in nats per token, unscaled)."""

    layers: tuple[tuple[tuple[str, int, float], ...], ...]

    @staticmethod
    def of(table: SensitivityTable) -> Sensitivity:
        return Sensitivity(tuple(tuple((o.name, o.nbytes, max(o.predicted, 0.0)) for o in opts)
                                 for opts in table.options.values()))  # fmt: skip

    def uniform_loss(self) -> dict[str, float]:
        """The summed predicted loss of each format every layer can take."""
        common = set.intersection(*({f for f, _, _ in opts} for opts in self.layers))
        return {f: sum(loss for opts in self.layers for g, _, loss in opts if g == f)
                for f in CODES if f in common}  # fmt: skip

    def loss_of(self, spec: str) -> float:
        formats = parse_spec(spec)
        return sum(next(loss for g, _, loss in opts if g == f)
                   for opts, f in zip(self.layers, formats, strict=True))  # fmt: skip


@dataclass(frozen=True)
class Calibration:
    """How a summed per-layer prediction maps to a measured perplexity increase. Plans are
    predicted relative to the *anchor*, the least-loss plan measured (uniform INT8 as a
    rule): its measured log increase, plus ``scale`` times the predicted loss beyond its
    own. A measurement has a margin (its 95% upper bound above the increase) that grows
    with the increase as the measured plans' did."""

    scale: float
    margins: tuple[tuple[float, float], ...]  # (increase, upper - increase), measured plans
    anchor: tuple[float, float] = (0.0, 0.0)  # (predicted loss, measured log increase)

    def increase(self, loss: float) -> float:
        loss0, log0 = self.anchor
        return math.expm1(log0 + self.scale * (loss - loss0))

    def loss_for(self, increase: float) -> float:
        """The predicted loss whose increase is ``increase`` (``increase``'s inverse)."""
        loss0, log0 = self.anchor
        return loss0 + (math.log1p(increase) - log0) / self.scale

    def margin(self, increase: float) -> float:
        """Interpolated between the measured plans' margins, never falling with the
        increase (so the upper bound rises with the loss)."""
        if not self.margins:
            return 0.0
        xs, ys = zip(*sorted(self.margins), strict=True)
        return float(np.interp(increase, xs, np.maximum.accumulate(ys)))

    def largest_increase(self, target: float) -> float | None:
        """The largest increase whose upper bound is within ``target`` (None: none is)."""
        if target - self.margin(0.0) <= 0:
            return None
        lo, hi = 0.0, target
        for _ in range(60):  # bisection: increase + margin(increase) rises with it
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if mid + self.margin(mid) <= target else (lo, mid)
        return lo

    def upper(self, loss: float) -> float:
        """The predicted 95% upper bound a measurement of the plan would report."""
        inc = self.increase(loss)
        return inc + self.margin(inc)


def calibration_of(
    sens: Sensitivity, increase: Mapping[str, float], upper: Mapping[str, float]
) -> Calibration:
    """Fit the prediction to the plans measured so far (uniform formats and mixed specs,
    their ``increase`` and 95% ``upper`` bound). The anchor is the least-loss one; the
    second-order sum over-weights the many tiny INT8 errors against the few large INT4
    ones, so only the loss beyond the anchor's is scaled. ``scale`` is the largest measured
    / predicted ratio of that excess among the measurements that stand clear of their
    margin (else among all; 1 when only the anchor or nothing was measured), so the
    prediction leans high."""
    predicted = {**sens.uniform_loss(), **{n: sens.loss_of(n) for n in increase if is_mixed(n)}}
    measured = [(n, increase[n], upper[n]) for n in increase if n in upper and n in predicted]
    if not measured:
        return Calibration(1.0, ())
    first = min(measured, key=lambda m: predicted[m[0]])
    loss0, log0 = predicted[first[0]], math.log1p(max(first[1], 0.0))
    ratios = [((math.log1p(max(inc, 0.0)) - log0) / (predicted[n] - loss0), inc > up - inc)
              for n, inc, up in measured if predicted[n] > loss0]  # fmt: skip
    clear = [r for r, ok in ratios if ok and r > 0]
    scale = max(clear or [r for r, _ in ratios if r > 0] or [1.0])
    return Calibration(scale, tuple((inc, up - inc) for _, inc, up in measured), (loss0, log0))


# Predicted upper bounds the frontier offers plans at (and the request's budget itself).
TARGETS = (0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2)


def frontier(
    sens: Sensitivity, cal: Calibration, targets: Sequence[float] = TARGETS
) -> dict[str, float]:
    """The allocator's mixed plans: for each target upper bound, the smallest plan whose
    predicted upper bound is within it (``compress.allocate.allocate``, exact), uniform
    plans left out (the planner has them). Spec -> predicted upper bound."""
    from kiln.compress.allocate import Option, allocate

    groups = [[Option(f, n, loss) for f, n, loss in opts] for opts in sens.layers]
    least = sum(min(loss for _, _, loss in opts) for opts in sens.layers)
    out: dict[str, float] = {}
    for target in sorted(set(targets)):
        inc = cal.largest_increase(target)
        if inc is None or cal.increase(least) > inc:
            continue  # even the least-loss plan is predicted over this target
        got = allocate(groups, cal.loss_for(inc))
        formats = [groups[i][j].name for i, j in enumerate(got.choice)]
        if len(set(formats)) > 1:
            out[spec_of(formats)] = cal.upper(got.loss)
    return out
