"""Time on this CPU: kiln's own engines, priced by what they were measured to do.

On a CPU the devices of a layout are *processes of one host*: ``tp x pp`` ranks share its
cores (each runs ``cores // ranks`` threads, as ``kiln.parallel.launch`` starts them), its
memory bandwidth and its RAM. Which engine runs decides the cost, so each part of a step
is priced with that engine's measured ``Cost`` (``kernel_rates``: a fixed time per block
plus weight bytes or FLOPs at a measured rate, at the thread count a rank has):

* one process, weights resident: kiln's C++ decode step (``fast-<fmt>``);
* blocks streamed from disk: the eager module over the offload store (``offload-<fmt>``);
* tensor- or pipeline-parallel ranks: the layout's own engine (``tp<T>-pp<P>-<fmt>``),
  timed with its ranks launched side by side (``rank_rates``: the all-reduces in a step,
  the stages running in turn, the cores they share), priced on the bytes along the step's
  critical path (each stage's shard in turn, the whole head on the last stage: kiln's
  ranks hold the whole embedding and head), plus the broadcast of the last position's
  logits, which grows with the vocabulary. A layout that was not timed (more ranks than
  cores) is composed from the one-process eager engine (``eager-<fmt>``), two
  all-reduces per block under TP and a send per stage boundary (``gloo``), which runs
  fast on paper: an estimate of what it would cost with a core per rank.

Where the planned model's own blocks were timed (``arch_rates``, the default for a model
kiln builds), every engine above is that model's, and the head (with the embedding and the
final norm) has its own measured cost, ``<engine>+head``: a 152k-row head streams at
another rate than a block, and prices the last stage on its own.

Prefill (the prompt) runs through the eager module (``prefill-<fmt>``, or the layout's
``prefill-tp<T>-pp<P>-<fmt>``: the blocks' FLOPs and the head's for each sequence's last
position, at the measured rate); a streamed plan also reads every offloaded block once more.

A per-layer mixed format (``deploy.mixed``) has no engine of its own: ``blend`` composes
each of its engines from its formats' measured ones.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from kiln.deploy.arch_rates import head_engine
from kiln.deploy.architecture import Architecture
from kiln.deploy.kernel_rates import Cost, Rates, rate_at
from kiln.deploy.mixed import Shares
from kiln.deploy.rank_rates import layout_engine, logits_broadcast_s


@dataclass(frozen=True)
class CpuRun:
    """What the CPU cost model needs of a layout, besides the architecture."""

    fmt: str
    tp: int
    pp: int
    batch: int
    prompt_len: int
    context: int
    offload: str
    act_bytes: int
    stages: list[int]  # layers per pipeline stage
    layer_w: float  # bytes of one block, all ranks together
    head_w: float  # bytes the head reads per step (a tied head: the embedding table)

    @property
    def ranks(self) -> int:
        return self.tp * self.pp


def threads_per_rank(cores: int, ranks: int) -> int:
    return max(1, cores // ranks)


def decode_engine(run: CpuRun) -> str:
    if run.offload != "none":
        return f"offload-{run.fmt}"
    return f"fast-{run.fmt}" if run.ranks == 1 else f"eager-{run.fmt}"


def _layout_cost(rates: Rates, run: CpuRun, rows: int, prefill: bool) -> Cost | None:
    """The layout's own measured engine, for several resident ranks (None otherwise)."""
    if run.ranks == 1 or run.offload != "none":
        return None
    return rate_at(rates, layout_engine(run.tp, run.pp, run.fmt, prefill), rows)


def decode_ms(arch: Architecture, run: CpuRun, rates: Rates) -> float | None:
    """One decode step of the whole batch (None when the engine was not measured)."""
    kv_heads = math.ceil(arch.n_kv_heads / run.tp)  # a rank's own (replicated below tp)
    kv_row = 2 * kv_heads * arch.head_dim * run.act_bytes  # one position, one layer, one rank
    stage_bytes = [
        layers * (run.layer_w / run.tp + run.batch * run.context * kv_row) for layers in run.stages
    ]
    logits_s = logits_broadcast_s(rate_at(rates, "gloo", 2), run.batch, arch.vocab_size)
    layout = _layout_cost(rates, run, run.batch, prefill=False)
    engine = layout_engine(run.tp, run.pp, run.fmt) if layout is not None else decode_engine(run)
    # every rank of the last stage computes the whole head: at its own measured cost where
    # the model's engines were timed (``arch_rates``), else as more bytes of the stage
    head = rate_at(rates, head_engine(engine), run.batch)
    head_s = head.seconds(run.head_w) if head is not None else 0.0
    if head is None:
        stage_bytes[-1] += run.head_w
    if layout is not None:  # the stages in turn, as timed
        return (layout.seconds(sum(stage_bytes), sum(run.stages)) + head_s + logits_s) * 1e3
    cost = rate_at(rates, engine, run.batch)
    if cost is None:
        return None
    hidden_msg = run.batch * arch.hidden_size * run.act_bytes
    seconds = 0.0  # one sequence of micro-batches: the stages run one after another
    for layers, nbytes in zip(run.stages, stage_bytes, strict=True):
        seconds += cost.seconds(nbytes, layers) + 2 * layers * _message_s(rates, hidden_msg, run.tp)
    seconds += (run.pp - 1) * _message_s(rates, hidden_msg, 2) + head_s
    if run.ranks > 1:  # the last stage's logits go to every rank
        seconds += logits_s
    return seconds * 1e3


def prefill_ms(arch: Architecture, run: CpuRun, rates: Rates) -> float | None:
    """The prompt of every sequence, to the first token's logits (None when not measured)."""
    rows = run.batch * run.prompt_len
    attn = 2 * 2 * arch.n_heads * arch.head_dim * run.prompt_len**2 / 2  # causal q.k and p.v
    flops_layer = 2 * rows * arch.params_per_layer + run.batch * attn
    head_flops = 2 * run.batch * arch.hidden_size * arch.vocab_size  # the last row's logits
    layers = sum(run.stages)
    layout = _layout_cost(rates, run, rows, prefill=True)
    engine = (layout_engine(run.tp, run.pp, run.fmt, prefill=True) if layout is not None
              else f"prefill-{run.fmt}")  # fmt: skip
    head = rate_at(rates, head_engine(engine), rows)  # the head at its own cost, if timed
    head_s = head.seconds(head_flops) if head is not None else 0.0
    block_flops = layers * flops_layer / run.tp + (0.0 if head is not None else head_flops)
    if layout is not None:
        gloo = rate_at(rates, "gloo", 2)
        seconds = layout.seconds(block_flops, layers) + head_s
        return (seconds + logits_broadcast_s(gloo, run.batch, arch.vocab_size)) * 1e3
    cost = rate_at(rates, engine, rows)
    if cost is None:
        return None
    act_msg = rows * arch.hidden_size * run.act_bytes
    seconds = cost.seconds(block_flops, layers) + head_s
    seconds += 2 * layers * _message_s(rates, act_msg, run.tp)
    seconds += (run.pp - 1) * _message_s(rates, act_msg, 2)
    if run.offload != "none":  # every streamed block is read once more, as a step reads it
        step, resident = (
            rate_at(rates, f"offload-{run.fmt}", 1),
            rate_at(rates, f"eager-{run.fmt}", 1),
        )
        if step is not None and resident is not None:
            nbytes = layers * run.layer_w
            seconds += max(0.0, _streamed_s(step, nbytes) - _streamed_s(resident, nbytes))
    return seconds * 1e3


def _streamed_s(cost: Cost, nbytes: float) -> float:
    return nbytes / (cost.rate * 1e9)


def _message_s(rates: Rates, nbytes: float, ranks: int) -> float:
    """A gloo collective of ``nbytes`` among ``ranks`` ranks (0 for one rank)."""
    if ranks <= 1:
        return 0.0
    cost = rate_at(rates, "gloo", ranks)
    return cost.seconds(nbytes) if cost is not None else 0.0


def tables_for(rates: Mapping[int, Rates] | None, cores: int, ranks: int) -> Rates | None:
    """The measured table at the thread count each of ``ranks`` ranks runs with."""
    if not rates:
        return None
    return rates.get(threads_per_rank(cores, ranks))


def blend(rates: Rates, name: str, mix: Shares) -> dict[str, dict[int, Cost]]:
    """Engines for mixed format ``name`` composed from its formats' measured ones: a step
    streams each format's share of the bytes at that format's rate, and pays each format's
    fixed cost per block in proportion to its share of the parameters (the kernels it
    launches). A prefill's FLOPs divide like the parameters. Only engines every part has
    measured, at the row counts all of them measured."""
    first = mix.parts[0][0]
    out: dict[str, dict[int, Cost]] = {}
    for engine in rates:
        for suffix in (f"-{first}", f"-{first}+head"):
            if not engine.endswith(suffix):
                continue
            stem, tail = engine[: -len(suffix)], suffix[len(first) + 1 :]
            parts = [rates.get(f"{stem}-{fmt}{tail}") for fmt, _, _ in mix.parts]
            if any(not p for p in parts):
                continue
            rows = set.intersection(*(set(p) for p in parts if p))
            flops = stem.startswith("prefill")
            costs: dict[int, Cost] = {}
            for r in sorted(rows):
                per_unit, fixed = 0.0, 0.0
                for (_, byte_share, param_share), part in zip(mix.parts, parts, strict=True):
                    assert part is not None
                    cost = part[r]
                    per_unit += (param_share if flops else byte_share) / cost.rate
                    fixed += param_share * cost.layer_s
                costs[r] = Cost(1.0 / per_unit, fixed)
            out[f"{stem}-{name}{tail}"] = costs
    return out
