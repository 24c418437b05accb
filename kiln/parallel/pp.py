"""Pipeline parallelism: layers split into stages, activations passed point to point.

A ``Stage`` is the ``Transformer`` trimmed to its layers: the first stage also embeds the
tokens, the last also runs the final norm and the head; tensors a stage never uses are
released. Its KV cache holds only its layers (the cache is keyed by global layer index).

``PipelineDecoder`` is one rank's stage behind the ``Decoder`` protocol, so the one loop
(``kiln.llm.generate.generate``) runs pipeline-parallel decoding with every ``Sampling``
option. A batch of B sequences is cut into m micro-batches, each with its own slice of the
cache; within a step every stage takes micro-batch i from the previous stage (``recv``),
runs its layers and passes the activations (B_i, T, C) on (``isend``, so it moves on to
micro-batch i + 1 at once). The last stage's logits (B, V) are broadcast to every rank,
which all choose the same tokens (same values, same seeded stream): the loop's choice
happens between steps, so each step starts with a bubble of (stages - 1) micro-batches.

Ranks are global ranks of the default group; with tensor parallelism each tensor-parallel
rank j of a stage talks to rank j of the next stage (activations are replicated across a
tensor-parallel group after its all-reduce), see ``kiln.parallel.mesh``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
    stops holding its memory (a tied head keeps the embedding it shares alive). A tensor
    a partial load never read (meta) becomes an empty CPU one, so the stage can move."""
    for sub in module.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            setattr(sub, name, nn.Parameter(_empty(p), requires_grad=False))
        for name, b in list(sub.named_buffers(recurse=False)):
            setattr(sub, name, _empty(b))


def _empty(t: Tensor) -> Tensor:
    return torch.empty(0, dtype=t.dtype, device="cpu" if t.is_meta else t.device)


def _tensor_bytes(module: nn.Module) -> int:
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers())}  # shared: once
    return sum(t.numel() * t.element_size() for t in tensors.values())


class Stage(nn.Module):
    """One pipeline stage: ``layers`` of ``model`` (taken over, trimmed in place). ``model``
    may be a partial load holding only those layers (the others, and the embedding or head
    a stage does not run, left on the meta device): they are dropped or emptied alike."""

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

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step of this stage reads: its blocks, and on the
        last stage the final norm and the head (a tied head is the whole embedding table;
        the first stage's embedding lookup reads one row a token)."""
        out = sum(_tensor_bytes(block) for block in self.model.layers)
        if self.last:
            out += _tensor_bytes(self.model.final_norm) + _tensor_bytes(self.model.lm_head)
        return out

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
        the last position's logits (B, 1, V) fp32, the others activations (B, T, C)."""
        positions = torch.arange(start, start + inp.shape[1], device=inp.device)
        x = self.model.embed_tokens(inp, positions) if self.first else inp
        for block in self.model.layers:
            x = block(x, positions, cache)
        return self.model.logits(x[:, -1:]) if self.last else x  # the last position: (B, 1, V)


def cache_slice(cache: KVCache, b0: int, b1: int) -> KVCache:
    """Sequences [b0, b1) of ``cache`` as views: a micro-batch writes its own rows."""
    keys = {i: k[b0:b1] for i, k in cache.keys.items()}
    values = {i: v[b0:b1] for i, v in cache.values.items()}
    return KVCache(keys, values, cache.max_len)


@dataclass(frozen=True)
class PipeRanks:
    """Global ranks this stage talks to: ``prev``/``next`` stage (None at the ends), and
    ``source``, the one rank of the last stage whose logits every rank of the job takes."""

    prev: int | None
    next: int | None
    source: int


def microbatch_bounds(batch: int, microbatches: int) -> list[tuple[int, int]]:
    """[b0, b1) of each micro-batch: ``batch`` rows split as evenly as possible."""
    if not 1 <= microbatches <= batch:
        raise ValueError(f"{microbatches} micro-batches do not fit a batch of {batch}")
    bounds, b0 = [], 0
    for count in balanced(batch, microbatches):
        bounds.append((b0, b0 + count))
        b0 += count
    return bounds


class PipelineDecoder:
    """This rank's stage of a pipeline as a ``Decoder`` (``kiln.llm.generate``).

    Every rank of the job runs ``generate`` over its own ``PipelineDecoder`` with the same
    prompt and ``Sampling``. A call runs the stage on each micro-batch in turn; the last
    stage gathers the logits of the last position (B, V) and ``source`` broadcasts them to
    all ranks, so every rank returns the same logits (fp32, on the CPU), chooses the same
    tokens (the same seeded stream on the same values) and the first stage embeds them at
    the next step. ``prefill`` returns the last position only (B, 1, V).
    """

    def __init__(
        self, stage: Stage, ranks: PipeRanks, batch: int, max_len: int, microbatches: int = 1
    ) -> None:
        self.stage, self.ranks = stage, ranks
        self.dtype, self.device = stage.placement()
        self.bounds = microbatch_bounds(batch, microbatches)
        cache = stage.new_cache(batch, max_len)
        self.caches = [cache_slice(cache, b0, b1) for b0, b1 in self.bounds]
        self.batch = batch

    def prefill(self, tokens: Tensor) -> Tensor:
        return self._run(tokens, 0)[:, None]  # (B, 1, V)

    def step(self, tokens: Tensor, pos: int) -> Tensor:
        return self._run(tokens[:, None], pos)

    @torch.no_grad()
    def _run(self, tokens: Tensor, start: int) -> Tensor:
        """Tokens (B, T) at positions start.. through the pipeline: the logits (B, V) of
        the last position. The first stage reads ``tokens``; the others receive activations
        (B_i, T, C) per micro-batch and pass theirs on without waiting (``isend``), so stage
        s runs micro-batch i while stage s + 1 runs micro-batch i - 1."""
        stage, ranks = self.stage, self.ranks
        b, t = tokens.shape
        if b != self.batch:
            raise ValueError(f"this decoder runs {self.batch} sequences, got {b}")
        vocab = stage.model.cfg.vocab_size
        logits = torch.zeros(b, vocab, dtype=torch.float32, device=self.device)
        sent: list[tuple[dist.Work, Tensor]] = []  # sends in flight, with their buffers
        for (b0, b1), cache in zip(self.bounds, self.caches, strict=True):
            if stage.first:
                inp = tokens[b0:b1].to(self.device)  # (B_i, T)
            else:
                c = stage.model.cfg.hidden_size
                inp = torch.empty(b1 - b0, t, c, dtype=self.dtype, device=self.device)
                dist.recv(inp, src=ranks.prev)  # (B_i, T, C)
            out = stage(inp, start, cache)
            if stage.last:
                logits[b0:b1] = out[:, -1]
            else:
                assert ranks.next is not None
                msg = out.contiguous()  # (B_i, T, C)
                sent.append((_isend(msg, ranks.next), msg))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(logits, src=ranks.source)
        for work, _ in sent:
            work.wait()  # received before the last stage could broadcast
        progress()
        return logits.cpu()


def _isend(tensor: Tensor, dst: int) -> dist.Work:
    work = dist.isend(tensor, dst=dst)
    if work is None:
        raise RuntimeError(f"isend to rank {dst} returned no work handle")
    return work
