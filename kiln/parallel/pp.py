"""Pipeline parallelism: layers split into stages, activations passed point to point.

A ``Stage`` is the ``Transformer`` trimmed to its layers: the first stage also embeds the
tokens, the last also runs the final norm and the head; tensors a stage never uses are
released. Its KV cache holds only its layers (the cache is keyed by global layer index).

``pipeline_generate`` runs greedy decoding on one rank of a pipeline. A batch of B
sequences is cut into m micro-batches, each with its own slice of the cache; every stage
takes micro-batch i from the previous stage (``recv``), runs its layers and passes the
activations (B_i, T, C) on (``isend``, so it moves on to micro-batch i + 1 at once). The
last stage picks each micro-batch's token and sends it back to the first stage, which
starts that micro-batch's next step while later micro-batches are still in flight: with
m >= stages, every stage has work at every moment of the steady state.

Ranks are global ranks of the default group; with tensor parallelism each tensor-parallel
rank j of a stage talks to rank j of the next stage (activations are replicated across a
tensor-parallel group after its all-reduce), see ``kiln.parallel.mesh``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from kiln.models.kv_cache import KVCache
from kiln.models.transformer import Transformer
from kiln.parallel.launch import progress
from kiln.parallel.tp import balanced, local_kv_heads


def split_stages(n_layers: int, split: Sequence[int]) -> list[range]:
    """Layer ranges of each stage from per-stage layer counts (``split``: the planner's
    choice, e.g. [16, 14] for 30 layers on 2 stages). Every stage needs >= 1 layer and the
    counts must add up to ``n_layers``."""
    if len(split) == 0:
        raise ValueError("split names no stage")
    if any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in split):
        raise ValueError(f"every stage needs a positive whole number of layers, got {list(split)}")
    if sum(split) != n_layers:
        raise ValueError(
            f"split {list(split)} covers {sum(split)} layers, the model has {n_layers}"
        )
    ranges, start = [], 0
    for count in split:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def even_split(n_layers: int, stages: int) -> list[int]:
    """Layer counts for ``stages`` stages as equal as they can be (earlier stages larger)."""
    if not 1 <= stages <= n_layers:
        raise ValueError(f"{n_layers} layers cannot fill {stages} pipeline stages")
    return balanced(n_layers, stages)


def _release(module: nn.Module) -> None:
    """Replace every tensor of ``module`` by an empty one: a stage that never runs it
    stops holding its memory (a tied head keeps the embedding it shares alive)."""
    for sub in module.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            setattr(sub, name, nn.Parameter(p.new_empty(0), requires_grad=False))
        for name, b in list(sub.named_buffers(recurse=False)):
            setattr(sub, name, b.new_empty(0))


class Stage(nn.Module):
    """One pipeline stage: ``layers`` of ``model`` (taken over, trimmed in place)."""

    def __init__(self, model: Transformer, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        if layers.start < 0 or layers.stop > len(model.layers) or len(layers) == 0:
            raise ValueError(f"layers {layers} are not a non-empty part of {len(model.layers)}")
        model.layers = nn.ModuleList(model.layers[i] for i in layers)
        if not first:
            _release(model.embed)
            if model.pos_embed is not None:
                _release(model.pos_embed)
        if not last:
            _release(model.lm_head)
            _release(model.final_norm)
        self.model, self.layer_ids = model, layers
        self.first, self.last = first, last

    def placement(self) -> tuple[torch.dtype, torch.device]:
        """dtype and device of this stage's activations (those of its first parameter:
        compressed projections keep buffers, but every block has norm weights)."""
        p = next(self.model.layers.parameters())
        return p.dtype, p.device

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """A cache for this stage's layers and this rank's kv heads only."""
        dtype, device = self.placement()
        return KVCache.empty(
            self.model.cfg, self.layer_ids, batch, max_len, dtype, device,
            kv_heads=local_kv_heads(self.model),
        )  # fmt: skip

    def forward(self, inp: Tensor, start: int, cache: KVCache) -> Tensor:
        """First stage: tokens (B, T); others: activations (B, T, C). Last stage returns
        logits (B, T, V) fp32, the others activations (B, T, C)."""
        positions = torch.arange(start, start + inp.shape[1], device=inp.device)
        x = self.model.embed_tokens(inp, positions) if self.first else inp
        for block in self.model.layers:
            x = block(x, positions, cache)
        return self.model.logits(x) if self.last else x


def cache_slice(cache: KVCache, b0: int, b1: int) -> KVCache:
    """Sequences [b0, b1) of ``cache`` as views: a micro-batch writes its own rows."""
    keys = {i: k[b0:b1] for i, k in cache.keys.items()}
    values = {i: v[b0:b1] for i, v in cache.values.items()}
    return KVCache(keys, values, cache.max_len)


@dataclass(frozen=True)
class PipeRanks:
    """Global ranks this stage talks to: ``prev``/``next`` stage (None at the ends) and
    the pipeline's ``first``/``last`` stage (the token goes from last to first)."""

    prev: int | None
    next: int | None
    first: int
    last: int


@dataclass
class GenerationOutput:
    """Greedy decoding's result: tokens (B, T + new) and each new token's logits
    (B, new, V), as far as this rank knows them (``None`` where it does not)."""

    tokens: Tensor | None
    logits: Tensor | None
    step_end_s: list[float] = field(default_factory=list)  # last stage: when each token was known


def microbatch_bounds(batch: int, microbatches: int) -> list[tuple[int, int]]:
    """[b0, b1) of each micro-batch: ``batch`` rows split as evenly as possible."""
    if not 1 <= microbatches <= batch:
        raise ValueError(f"{microbatches} micro-batches do not fit a batch of {batch}")
    bounds, b0 = [], 0
    for count in balanced(batch, microbatches):
        bounds.append((b0, b0 + count))
        b0 += count
    return bounds


def pipeline_generate(
    stage: Stage, prompt: Tensor, max_new_tokens: int, ranks: PipeRanks, microbatches: int = 1
) -> GenerationOutput:
    """Greedy decoding of ``prompt`` (B, T) int64 for ``max_new_tokens`` tokens on this
    rank's stage. The first stage returns the tokens, the last the tokens and logits."""
    b, t0 = prompt.shape
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    dtype, device = stage.placement()
    prompt = prompt.to(device)
    cache = stage.new_cache(b, t0 + max_new_tokens)
    mbs = microbatch_bounds(b, microbatches)
    caches = [cache_slice(cache, b0, b1) for b0, b1 in mbs]
    new_tokens = torch.zeros(b, max_new_tokens, dtype=torch.long, device=device)
    vocab = stage.model.cfg.vocab_size
    logits = torch.zeros(b, max_new_tokens, vocab, device=device) if stage.last else None
    pending: list[tuple[dist.Work, Tensor]] = []  # sends in flight, with their buffers
    ends: list[float] = []
    t_start = time.perf_counter()
    for step in range(max_new_tokens):
        start, length = (0, t0) if step == 0 else (t0 + step - 1, 1)
        sent: list[tuple[dist.Work, Tensor]] = []
        for i, (b0, b1) in enumerate(mbs):
            if stage.first and step == 0:
                inp = prompt[b0:b1]  # (B_i, T0)
            elif stage.first and stage.last:
                inp = new_tokens[b0:b1, step - 1 : step]  # (B_i, 1)
            elif stage.first:
                inp = torch.empty(b1 - b0, 1, dtype=torch.long, device=device)
                dist.recv(inp, src=ranks.last)
                new_tokens[b0:b1, step - 1] = inp[:, 0]
            else:
                c = stage.model.cfg.hidden_size
                inp = torch.empty(b1 - b0, length, c, dtype=dtype, device=device)
                dist.recv(inp, src=ranks.prev)  # (B_i, T, C)
            out = stage(inp, start, caches[i])
            if stage.last:
                assert logits is not None
                last_logits = out[:, -1]  # (B_i, V)
                logits[b0:b1, step] = last_logits
                token = last_logits.argmax(-1)  # (B_i,)
                new_tokens[b0:b1, step] = token
                if not stage.first:
                    msg = token[:, None].contiguous()  # (B_i, 1)
                    sent.append((_isend(msg, ranks.first), msg))
            else:
                assert ranks.next is not None
                msg = out.contiguous()  # (B_i, T, C)
                sent.append((_isend(msg, ranks.next), msg))
        for work, _ in pending:
            work.wait()  # the previous step's sends: long received by now
        pending = sent
        ends.append(time.perf_counter() - t_start)
        progress()
    if stage.first and not stage.last:  # the last step's tokens come back too
        for b0, b1 in mbs:
            inp = torch.empty(b1 - b0, 1, dtype=torch.long, device=device)
            dist.recv(inp, src=ranks.last)
            new_tokens[b0:b1, max_new_tokens - 1] = inp[:, 0]
    for work, _ in pending:
        work.wait()
    if not (stage.first or stage.last):
        return GenerationOutput(None, None)
    times = ends if stage.last else []
    return GenerationOutput(torch.cat((prompt, new_tokens), dim=1), logits, times)


def _isend(tensor: Tensor, dst: int) -> dist.Work:
    work = dist.isend(tensor, dst=dst)
    if work is None:
        raise RuntimeError(f"isend to rank {dst} returned no work handle")
    return work
