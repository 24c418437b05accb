"""Time on this CPU: kiln's own engines, priced by what they were measured to do.

On a CPU the devices of a layout are *processes of one host*: ``tp x pp`` ranks share its
cores (each runs ``cores // ranks`` threads, as ``kiln.parallel.launch`` starts them), its
memory bandwidth and its RAM. Which engine runs decides the cost, so each part of a step
is priced with that engine's measured ``Cost`` (``kernel_rates``: a fixed time per block
plus weight bytes or FLOPs at a measured rate, at the thread count a rank has):

* one process, weights resident: kiln's C++ decode step (``fast-<fmt>``);
* blocks streamed from disk: the eager module over the offload store (``offload-<fmt>``);
* tensor- or pipeline-parallel ranks: each rank's stage through the eager module
  (``eager-<fmt>``), two all-reduces per block under TP, a send per stage boundary and a
  broadcast of the last position's logits (gloo, ``gloo``'s measured latency and rate).
  kiln's ranks hold the whole embedding and head (only blocks are sharded), so the last
  stage reads the whole head on every rank.

Prefill (the prompt) runs through the eager module (``prefill-<fmt>``: the blocks' and the
head's FLOPs, logits of every prompt row included, at the measured rate); a streamed plan
also reads every offloaded block once more.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from kiln.deploy.architecture import Architecture
from kiln.deploy.kernel_rates import Cost, Rates, rate_at


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


def decode_ms(arch: Architecture, run: CpuRun, rates: Rates) -> float | None:
    """One decode step of the whole batch (None when the engine was not measured)."""
    cost = rate_at(rates, decode_engine(run), run.batch)
    if cost is None:
        return None
    kv_heads = math.ceil(arch.n_kv_heads / run.tp)  # a rank's own (replicated below tp)
    kv_row = 2 * kv_heads * arch.head_dim * run.act_bytes  # one position, one layer, one rank
    stage_s = []
    for s, layers in enumerate(run.stages):
        nbytes = layers * (run.layer_w / run.tp + run.batch * run.context * kv_row)
        if s == len(run.stages) - 1:
            nbytes += run.head_w  # every rank of the last stage computes the whole head
        t = cost.seconds(nbytes, layers)
        t += 2 * layers * _message_s(rates, run.batch * arch.hidden_size * run.act_bytes, run.tp)
        stage_s.append(t)
    seconds = sum(stage_s)  # one sequence of micro-batches: the stages run one after another
    hidden_msg = run.batch * arch.hidden_size * run.act_bytes
    seconds += (run.pp - 1) * _message_s(rates, hidden_msg, 2)
    if run.ranks > 1:  # the last stage's logits go to every rank
        seconds += _message_s(rates, run.batch * arch.vocab_size * 4, 2)
    return seconds * 1e3


def prefill_ms(arch: Architecture, run: CpuRun, rates: Rates) -> float | None:
    """The prompt of every sequence, to the first token's logits (None when not measured)."""
    rows = run.batch * run.prompt_len
    cost = rate_at(rates, f"prefill-{run.fmt}", rows)
    if cost is None:
        return None
    attn = 2 * 2 * arch.n_heads * arch.head_dim * run.prompt_len**2 / 2  # causal q.k and p.v
    flops_layer = 2 * rows * arch.params_per_layer + run.batch * attn
    seconds = 0.0
    for layers in run.stages:
        seconds += cost.seconds(layers * flops_layer / run.tp, layers)
        seconds += 2 * layers * _message_s(rates, rows * arch.hidden_size * run.act_bytes, run.tp)
    seconds += cost.seconds(2 * rows * arch.hidden_size * arch.vocab_size, 0)  # every row's logits
    seconds += (run.pp - 1) * _message_s(rates, rows * arch.hidden_size * run.act_bytes, 2)
    if run.offload != "none":  # every streamed block is read once more, as a step reads it
        step, resident = (
            rate_at(rates, f"offload-{run.fmt}", 1),
            rate_at(rates, f"eager-{run.fmt}", 1),
        )
        if step is not None and resident is not None:
            nbytes = sum(run.stages) * run.layer_w
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
