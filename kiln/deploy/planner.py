"""The deployment planner: the cheapest layout that meets an accuracy budget, a latency
target and a hardware budget, or, when none does, why not and what would fix it.

The joint space: weight format (``estimate.FORMATS``), number of devices (up to the
hardware spec's count), tensor- and pipeline-parallel degrees (tp x pp = devices, tp a
power of two up to 8 that is at most the head count), and where weights that do not fit go
(nowhere, host memory or disk). Every point is estimated (``estimate.estimate``) and checked
against every constraint; the objective ranks the feasible ones. The space is small (a few
hundred points for 8 devices), so it is enumerated exactly rather than searched.

Accuracy per format (``accuracy_of``): for a checkpoint kiln can load and score, each
format's perplexity increase measured on the search text (``plan_quality.measure_formats``,
its 95% upper bound); otherwise (a config-only model, no tokenizer) a stated *prior*
(``PRIORS``). Every output labels which.

Per-layer mixed formats (``"mixed"`` among the request's formats): each plan of the
compression allocator's size / loss frontier over the request's INT8 / INT4 formats
(``deploy.mixed``, in ``Measurements.mixed``) is one more format of the joint space, its
accuracy the allocator's prediction (labelled predicted) until ``plan_job`` has measured
it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from kiln.deploy import mixed
from kiln.deploy.architecture import Architecture
from kiln.deploy.estimate import (
    FORMATS,
    NOTHING_MEASURED,
    Estimate,
    Layout,
    Measurements,
    WeightFormat,
    estimate,
    mixed_format,
)
from kiln.deploy.hardware import Hardware

Objective = Literal["cost", "latency", "throughput"]
OFFLOAD = ("none", "host", "disk")
MIXED = "mixed"  # in ``Request.formats``: the per-layer mixed formats ``known`` has

# Assumed perplexity increase of each weight-only format on a large (>= 7B) model: the
# order of magnitude published GPTQ / LLM.int8 results show, NOT a kiln measurement.
PRIORS: dict[str, float] = {
    "fp32": 0.0,
    "fp16": 0.0,
    "bf16": 0.0,
    "int8": 0.001,
    "int4-g32": 0.01,
    "int4-g64": 0.015,
    "int4-g128": 0.02,
}
PRIOR_NOTE = "assumed from published weight-only results, not measured by kiln"
PRIOR_SOURCE = f"prior: {PRIOR_NOTE}"


def accuracy_of(fmt: str, known: Measurements = NOTHING_MEASURED) -> tuple[float, str]:
    """Format ``fmt``'s perplexity increase and where it comes from: measured on this
    checkpoint when ``known`` has it, else a mixed format's prediction, else the prior."""
    measured = known.accuracy
    if measured is not None and fmt in measured.upper:
        return measured.upper[fmt], measured.source
    if fmt in known.mixed:
        return known.mixed[fmt], mixed.SOURCE
    return PRIORS.get(fmt, float("nan")), PRIOR_SOURCE


def accuracy_kind(source: str) -> str:
    """``prior``, ``predicted`` or ``measured``: how an ``accuracy_of`` figure was obtained."""
    if source == PRIOR_SOURCE:
        return "prior"
    return "predicted" if source == mixed.SOURCE else "measured"


@dataclass(frozen=True)
class Request:
    """What the deployment must do and meet (None: no such constraint)."""

    batch: int = 1
    max_batch: int = 0  # > batch: also try batches up to this (powers of two), for cost
    prompt_len: int = 512
    gen_len: int = 128
    max_ppl_increase: float | None = None
    max_ms_per_token: float | None = None
    max_ttft_ms: float | None = None
    objective: Objective = "cost"
    formats: tuple[str, ...] = ("fp16", "int8", "int4-g128")
    allow_offload: bool = True

    def __post_init__(self) -> None:
        if min(self.batch, self.prompt_len, self.gen_len) < 1:
            raise ValueError("batch, prompt_len and gen_len must be >= 1")
        if self.max_batch and self.max_batch < self.batch:
            raise ValueError(f"max_batch {self.max_batch} is below batch {self.batch}")
        unknown = [f for f in self.formats if f not in FORMATS and f != MIXED]
        if unknown:
            raise ValueError(f"unknown weight formats {unknown}; known: {sorted(FORMATS)} "
                             f"and {MIXED!r} (per-layer)")  # fmt: skip

    @property
    def batches(self) -> list[int]:
        """The batch sizes the search tries: ``batch``, and with ``max_batch`` every power
        of two between them and ``max_batch`` itself (more sequences per step share each
        weight read: cheaper tokens, slower steps)."""
        if self.max_batch <= self.batch:
            return [self.batch]
        doubling = [b for b in (2**i for i in range(20)) if self.batch < b < self.max_batch]
        return [self.batch, *doubling, self.max_batch]


@dataclass(frozen=True)
class Violation:
    """A constraint a candidate misses: what it needs against the limit."""

    constraint: str
    needed: float
    limit: float

    @property
    def ratio(self) -> float:
        return self.needed / self.limit if self.limit > 0 else float("inf")


@dataclass(frozen=True)
class Candidate:
    """One estimated layout with its accuracy prior, price and misses."""

    estimate: Estimate
    hardware: Hardware
    ppl_increase: float
    violations: tuple[Violation, ...]
    ppl_source: str = PRIOR_SOURCE

    @property
    def feasible(self) -> bool:
        return not self.violations

    @property
    def cost_per_1m_tokens(self) -> float:
        """USD per million generated tokens at this layout's throughput."""
        return self.hardware.price_per_hour / (self.estimate.tokens_per_s * 3600) * 1e6

    def describe(self) -> str:
        lay = self.estimate.layout
        off = "" if lay.offload == "none" else f", offload to {lay.offload}"
        return (f"{lay.fmt.label} on {lay.devices}x{self.hardware.device.name} (tp {lay.tp}, "
                f"pp {lay.pp}{off}, batch {lay.batch})")  # fmt: skip


@dataclass
class Plan:
    """The planner's answer: the chosen candidate (or the least-bad one), the runner-ups
    and why they lost, the latency / cost frontier, and for an infeasible request the
    relaxations that would make it feasible."""

    arch: Architecture
    request: Request
    best: Candidate
    runners_up: list[tuple[Candidate, str]] = field(default_factory=list)
    frontier: list[Candidate] = field(default_factory=list)
    candidates: list[Candidate] = field(default_factory=list)  # every layout evaluated
    relaxations: list[tuple[str, Candidate]] = field(default_factory=list)

    @property
    def feasible(self) -> bool:
        return self.best.feasible


def weight_formats(
    arch: Architecture, request: Request, known: Measurements = NOTHING_MEASURED
) -> list[WeightFormat]:
    """The request's formats; ``mixed`` stands for every mixed format ``known`` has."""
    out = []
    for name in request.formats:
        if name != MIXED:
            out.append(FORMATS[name])
        else:
            out.extend(mixed_format(spec, arch) for spec in known.mixed)
    return out


def layouts(
    arch: Architecture, hw: Hardware, request: Request, known: Measurements = NOTHING_MEASURED
) -> list[Layout]:
    """Every layout of the joint space for this hardware budget."""
    counts = sorted({n for n in (1, 2, 4, 8, 16, 32, 64) if n <= hw.count} | {hw.count})
    offloads = OFFLOAD if request.allow_offload else ("none",)
    out = []
    for n in counts:
        for tp in (1, 2, 4, 8):
            if n % tp or tp > arch.n_heads or n // tp > arch.n_layers:
                continue
            for fmt in weight_formats(arch, request, known):
                act = activation_bytes(hw, fmt.name)
                for off in offloads:
                    for b in request.batches:
                        lay = Layout(fmt, n, tp, n // tp, b, request.prompt_len,
                                     request.gen_len, off, act)  # fmt: skip
                        out.append(lay)
    return out


def activation_bytes(hw: Hardware, fmt: str) -> int:
    """Element size of activations and KV cache: kiln's CPU step keeps them in fp32 (bf16
    for bf16 weights); GPUs run them in 16 bits."""
    return 4 if hw.device.kind == "cpu" and fmt not in ("bf16", "fp16") else 2


def evaluate(
    arch: Architecture,
    hw: Hardware,
    layout: Layout,
    request: Request,
    known: Measurements = NOTHING_MEASURED,
) -> Candidate:
    """Estimate ``layout`` and list the constraints it misses."""
    used = hw.with_count(layout.devices)
    est = estimate(arch, used, layout, known)
    ppl, source = accuracy_of(layout.fmt.name, known)
    misses = []
    if est.peak_device_bytes > est.device_memory_bytes:
        misses.append(
            Violation("device memory (bytes)", est.peak_device_bytes, est.device_memory_bytes)
        )
    if est.peak_host_bytes > used.host_memory_bytes:
        misses.append(Violation("host memory (bytes)", est.peak_host_bytes, used.host_memory_bytes))
    if request.max_ms_per_token is not None and est.ms_per_token > request.max_ms_per_token:
        misses.append(Violation("ms per token", est.ms_per_token, request.max_ms_per_token))
    if request.max_ttft_ms is not None and est.ttft_ms > request.max_ttft_ms:
        misses.append(Violation("time to first token (ms)", est.ttft_ms, request.max_ttft_ms))
    if request.max_ppl_increase is not None and ppl > request.max_ppl_increase:
        misses.append(Violation(f"perplexity increase ({accuracy_kind(source)})", ppl,
                                request.max_ppl_increase))  # fmt: skip
    return Candidate(est, used, ppl, tuple(misses), source)


def plan(
    arch: Architecture,
    hw: Hardware,
    request: Request,
    *,
    relax: bool = True,
    known: Measurements = NOTHING_MEASURED,
) -> Plan:
    """The best candidate for ``request`` on up to ``hw.count`` devices (see module doc);
    ``known``: what has been measured of this model and machine (``estimate.Measurements``)."""
    cands = [evaluate(arch, hw, lay, request, known) for lay in layouts(arch, hw, request, known)]
    # an offload layout that offloads nothing is its "none" twin: keep one of the two
    cands = [c for c in cands if c.estimate.layout.offload == "none" or c.estimate.offloaded_bytes]
    if not cands:
        raise ValueError(f"no layout of {arch.name} fits the shape of {hw.spec}")
    feasible = sorted((c for c in cands if c.feasible), key=lambda c: _rank(c, request.objective))
    if feasible:
        best = feasible[0]
        result = Plan(arch, request, best, _runners_up(best, feasible), _frontier(feasible),
                      cands)  # fmt: skip
    else:
        best = min(cands, key=_badness)
        result = Plan(arch, request, best, frontier=_frontier(cands), candidates=cands)
        if relax:
            result.relaxations = relaxations(arch, hw, request, known)
    return result


def relaxations(
    arch: Architecture, hw: Hardware, request: Request, known: Measurements = NOTHING_MEASURED
) -> list[tuple[str, Candidate]]:
    """The single changes that make an infeasible request feasible, the smallest of each
    kind: more devices, a larger accuracy budget, offloading, a smaller batch, a shorter
    prompt, a looser latency target."""
    tries: list[tuple[str, str, Hardware, Request]] = []  # (kind, change, hardware, request)
    for n in (hw.count + 1, hw.count * 2, hw.count * 4, hw.count * 8):
        tries.append(("devices", f"{n} devices instead of {hw.count}", hw.with_count(n), request))
    if request.max_ppl_increase is not None:
        costs = {name: accuracy_of(name, known) for name in FORMATS}
        for name, (ppl, source) in sorted(costs.items(), key=lambda kv: kv[1][0]):
            if ppl > request.max_ppl_increase:  # nan (no figure) is never a relaxation
                formats = tuple(dict.fromkeys((*request.formats, name)))
                change = f"accuracy budget {ppl:.1%} ({name}, {accuracy_kind(source)})"
                tries.append(("accuracy", change, hw,
                              replace(request, max_ppl_increase=ppl, formats=formats)))  # fmt: skip
    if not request.allow_offload:
        tries.append(
            ("offload", "allow offloading weights", hw, replace(request, allow_offload=True))
        )
    b = request.batch // 2
    while b >= 1:
        tries.append(
            ("batch", f"batch {b} instead of {request.batch}", hw, replace(request, batch=b))
        )
        b //= 2
    p = request.prompt_len // 2
    while p >= 64:
        tries.append(("prompt", f"prompt of {p} tokens instead of {request.prompt_len}", hw,
                      replace(request, prompt_len=p)))  # fmt: skip
        p //= 2
    found: list[tuple[str, Candidate]] = []
    seen: set[str] = set()
    for kind, change, h, r in tries:
        if kind in seen:
            continue
        got = plan(arch, h, r, relax=False, known=known)
        if got.feasible:
            found.append((change, got.best))
            seen.add(kind)
    if request.max_ms_per_token or request.max_ttft_ms:
        unbounded = replace(request, max_ms_per_token=None, max_ttft_ms=None)
        looser = plan(arch, hw, unbounded, relax=False, known=known)
        if looser.feasible:
            est = looser.best.estimate
            found.append((f"latency target {est.ms_per_token:.0f} ms/token, "
                          f"{est.ttft_ms:.0f} ms to first token", looser.best))  # fmt: skip
    return found


def _rank(c: Candidate, objective: Objective) -> tuple[float, ...]:
    e = c.estimate
    if objective == "latency":
        return (e.ms_per_token, e.ttft_ms, c.cost_per_1m_tokens)
    if objective == "throughput":
        return (-e.tokens_per_s, c.cost_per_1m_tokens)
    return (c.cost_per_1m_tokens, e.layout.devices, e.ms_per_token)


def _badness(c: Candidate) -> float:
    """How far an infeasible candidate is from feasible: summed excess ratios."""
    return sum(max(v.ratio - 1.0, 0.0) for v in c.violations)


def _runners_up(best: Candidate, feasible: Sequence[Candidate]) -> list[tuple[Candidate, str]]:
    """The best candidate of each other (format, devices, offload), with why it lost."""
    out: list[tuple[Candidate, str]] = []
    seen = {_key(best)}
    for c in feasible[1:]:
        if _key(c) in seen:
            continue
        seen.add(_key(c))
        out.append((c, _why_lost(c, best)))
        if len(out) == 4:
            break
    return out


def _key(c: Candidate) -> tuple[str, int, str]:
    lay = c.estimate.layout
    return (lay.fmt.name, lay.devices, lay.offload)


def _why_lost(c: Candidate, best: Candidate) -> str:
    parts = []
    if c.cost_per_1m_tokens > best.cost_per_1m_tokens:
        parts.append(f"{c.cost_per_1m_tokens / max(best.cost_per_1m_tokens, 1e-12):.2f}x the cost")
    if c.estimate.ms_per_token > best.estimate.ms_per_token:
        parts.append(f"{c.estimate.ms_per_token / best.estimate.ms_per_token:.2f}x the ms/token")
    if c.estimate.layout.devices > best.estimate.layout.devices:
        parts.append(f"{c.estimate.layout.devices} devices")
    return ", ".join(parts) or "ties on the objective; ranked later"


def _frontier(cands: Sequence[Candidate]) -> list[Candidate]:
    """Candidates no other beats on both ms/token and cost per token (memory-feasible)."""
    fits = [
        c for c in cands if not any(v.constraint.endswith("memory (bytes)") for v in c.violations)
    ]
    fits.sort(key=lambda c: (c.estimate.ms_per_token, c.cost_per_1m_tokens))
    out: list[Candidate] = []
    for c in fits:
        if not out or c.cost_per_1m_tokens < out[-1].cost_per_1m_tokens:
            out.append(c)
    return out
