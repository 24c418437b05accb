"""Megatron-style tensor parallelism as module surgery on kiln's ``Transformer``.

Each rank of a tensor-parallel group keeps a slice of every block:

* attention: q, k, v column-sharded (their output rows sliced) by key/value-head groups —
  a rank owns whole kv heads and the query heads that read them (grouped-query attention
  stays local); o row-sharded (its input columns sliced to the rank's query heads) and
  followed by one all-reduce. Head counts that do not divide are split unevenly (9 query
  / 3 kv heads on 2 ranks: 6+3 query, 2+1 kv); with fewer kv heads than ranks each kv
  head is replicated on the ranks that share its query heads.
* MLP: gate and up column-sharded, down row-sharded, one all-reduce after down.
* embeddings, norms and the head stay replicated; a row-parallel bias is added once,
  after the all-reduce.

Slicing goes through one interface: anything with ``slice_rows(start, stop)`` and
``slice_cols(start, stop)`` (kiln's compressed layers provide both, each in its own format);
a dense ``nn.Linear`` gets them from ``DenseSlicer``. Nothing here looks at compressed
types. Each rank's KV cache holds only its own kv heads (``local_kv_heads``).

Two ways to a rank's shard: ``shard_tensor_parallel`` cuts a model already in memory;
a streaming load (``kiln.models.load``) reads only the rows / columns ``block_slices``
names and ``finish_block`` (its per-block hook) wraps the row-parallel layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, cast, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from kiln.models.config import ModelConfig
from kiln.models.parts import LinearSlice
from kiln.models.transformer import Block, Transformer

ProcessGroup = dist.ProcessGroup

# MLP shards are cut at multiples of the largest of these that still gives every rank a
# piece: the block formats of compressed layers (INT4 groups, 2:4 bytes) cut cleanly there.
MLP_UNITS = (128, 64, 32, 16, 8, 4, 2, 1)


@runtime_checkable
class Sliceable(Protocol):
    """A linear layer that can hand out a slice of itself as a new layer."""

    in_features: int
    out_features: int

    def slice_rows(self, start: int, stop: int) -> nn.Module:
        """Output features [start, stop) only (column-parallel)."""
        ...

    def slice_cols(self, start: int, stop: int) -> nn.Module:
        """Input features [start, stop) only, bias kept whole (row-parallel)."""
        ...


class DenseSlicer:
    """``slice_rows``/``slice_cols`` for a plain ``nn.Linear``: new Linears holding copies."""

    def __init__(self, layer: nn.Linear) -> None:
        self.layer = layer
        self.in_features, self.out_features = layer.in_features, layer.out_features

    def slice_rows(self, start: int, stop: int) -> nn.Linear:
        w = self.layer.weight.detach()[start:stop]  # (stop - start, K)
        b = None if self.layer.bias is None else self.layer.bias.detach()[start:stop]
        return self._linear(w, b)

    def slice_cols(self, start: int, stop: int) -> nn.Linear:
        w = self.layer.weight.detach()[:, start:stop]  # (N, stop - start)
        b = None if self.layer.bias is None else self.layer.bias.detach()
        return self._linear(w, b)

    @staticmethod
    def _linear(w: Tensor, b: Tensor | None) -> nn.Linear:
        out = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device="meta")
        out.weight = nn.Parameter(w.clone(), requires_grad=False)
        if b is not None:
            out.bias = nn.Parameter(b.clone(), requires_grad=False)
        return out


def sliceable(layer: nn.Module) -> Sliceable:
    """The slicing interface of ``layer``: the layer itself when it has one, a
    ``DenseSlicer`` for a plain ``nn.Linear``; anything else is refused by name."""
    if isinstance(layer, Sliceable):
        return layer
    if isinstance(layer, nn.Linear):
        return DenseSlicer(layer)
    raise TypeError(
        f"{type(layer).__name__} cannot be sharded: it is neither nn.Linear nor has "
        "slice_rows/slice_cols"
    )


class RowParallel(nn.Module):
    """A row-sharded linear layer: this rank's partial product, summed over the group by
    one all-reduce, then the bias (once). x (..., K_local) -> (..., N)."""

    def __init__(self, part: nn.Module, bias: Tensor | None, group: ProcessGroup | None) -> None:
        super().__init__()
        self.part: nn.Module = part
        self.group = group
        self.register_buffer("bias", bias)

    def forward(self, x: Tensor) -> Tensor:
        y = self.part(x)  # (..., N) partial sum over this rank's inputs
        dist.all_reduce(y, group=self.group)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y


def slice_linear(layer: nn.Module, part: LinearSlice) -> nn.Module:
    """``layer`` cut to ``part``: its output rows, or its input columns (bias kept whole)."""
    s = sliceable(layer)
    if part.axis == "rows":
        return s.slice_rows(part.start, part.stop)
    return s.slice_cols(part.start, part.stop)


def _row_parallel_of(part: nn.Module, group: ProcessGroup | None) -> RowParallel:
    """A layer already cut to this rank's input columns, as ``RowParallel``: its bias is
    taken out and added once, after the all-reduce."""
    bias = getattr(part, "bias", None)
    if bias is not None:
        bias = bias.detach().clone()
        cast(Any, part).bias = None  # nn.Linear and compressed layers both skip a None bias
    return RowParallel(part, bias, group)


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank owns: kv heads [kv_start, kv_stop) and query heads
    [q_start, q_stop) (query head h reads kv head h // (n_heads // n_kv_heads))."""

    kv_start: int
    kv_stop: int
    q_start: int
    q_stop: int


def balanced(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` counts differing by at most one, larger first."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def partition_heads(n_heads: int, n_kv_heads: int, world: int) -> list[HeadShard]:
    """Every rank's heads. Ranks get whole kv-head groups when there are at least as many
    kv heads as ranks; otherwise each kv head is replicated on several ranks, which split
    its query heads."""
    group = n_heads // n_kv_heads  # query heads per kv head
    if n_heads < world:
        raise ValueError(f"{n_heads} query heads cannot be split over {world} ranks")
    shards: list[HeadShard] = []
    if n_kv_heads >= world:
        kv = 0
        for count in balanced(n_kv_heads, world):
            shards.append(HeadShard(kv, kv + count, kv * group, (kv + count) * group))
            kv += count
        return shards
    # ceil(world / n_kv_heads) <= group follows from n_heads >= world: every rank that
    # shares a kv head gets at least one of its query heads.
    for kv, ranks in enumerate(balanced(world, n_kv_heads)):
        q = kv * group
        for count in balanced(group, ranks):
            shards.append(HeadShard(kv, kv + 1, q, q + count))
            q += count
    return shards


def partition_features(size: int, world: int) -> list[tuple[int, int]]:
    """[start, stop) of each rank's MLP features: balanced, cut at multiples of the largest
    unit in ``MLP_UNITS`` that divides ``size`` into at least ``world`` pieces."""
    unit = next(u for u in MLP_UNITS if size % u == 0 and size // u >= world)
    if size // unit < world:
        raise ValueError(f"{size} MLP features cannot be split over {world} ranks")
    bounds, start = [], 0
    for count in balanced(size // unit, world):
        bounds.append((start, start + count * unit))
        start += count * unit
    return bounds


def block_slices(cfg: ModelConfig, rank: int, world: int) -> dict[str, LinearSlice]:
    """This rank's slice of every sharded linear of a block (name in the block -> rows or
    columns): q, k, v, gate and up by output rows, o and down by input columns. The same
    for every block; a streaming loader reads exactly these (``kiln.models.parts``)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a tensor-parallel group of {world}")
    d = cfg.head_dim
    heads = partition_heads(cfg.n_heads, cfg.n_kv_heads, world)[rank]
    f0, f1 = partition_features(cfg.intermediate_size, world)[rank]
    q0, q1 = heads.q_start * d, heads.q_stop * d  # this rank's query features
    kv0, kv1 = heads.kv_start * d, heads.kv_stop * d
    out = {
        "attn.q": LinearSlice("rows", q0, q1), "attn.k": LinearSlice("rows", kv0, kv1),
        "attn.v": LinearSlice("rows", kv0, kv1), "attn.o": LinearSlice("cols", q0, q1),
        "mlp.up": LinearSlice("rows", f0, f1), "mlp.down": LinearSlice("cols", f0, f1),
    }  # fmt: skip
    if cfg.gated_mlp:
        out["mlp.gate"] = LinearSlice("rows", f0, f1)
    return out


def finish_block(block: Block, group: ProcessGroup | None) -> None:
    """Make a block whose linears already hold this rank's slices (``block_slices``) run
    tensor-parallel, in place: o and down become ``RowParallel`` (one all-reduce each, the
    bias added after it), and attention counts the heads its q and k slices hold."""
    attn, mlp = block.attn, block.mlp
    attn.add_module("o", _row_parallel_of(attn.o, group))
    mlp.add_module("down", _row_parallel_of(mlp.down, group))
    attn.n_heads = int(attn.q.out_features) // attn.head_dim
    attn.n_kv_heads = int(attn.k.out_features) // attn.head_dim


def shard_tensor_parallel(
    model: Transformer, rank: int, world: int, group: ProcessGroup | None = None
) -> Transformer:
    """Replace ``model``'s blocks by this rank's shards, in place; returns ``model``.

    ``rank``/``world``: this rank's index and size within ``group`` (None: the default
    group). Every rank of the group must call this on identical models. Works on a model
    whose ``layers`` were already trimmed to a pipeline stage. (A streaming load reads the
    shards directly: ``block_slices`` + ``finish_block``.)
    """
    slices = block_slices(model.cfg, rank, world)
    with torch.no_grad():
        for module in model.layers:
            block = cast(Block, module)
            for name, part in slices.items():
                owner, _, attr = name.rpartition(".")
                parent = block.get_submodule(owner)
                # add_module replaces the declared nn.Linear attributes by shards of any kind
                parent.add_module(attr, slice_linear(getattr(parent, attr), part))
            finish_block(block, group)
    return model


def local_kv_heads(model: Transformer) -> int:
    """How many kv heads this rank's blocks compute (all of them when not sharded): the
    head count its KV cache needs (``KVCache.empty(..., kv_heads=)``)."""
    if len(model.layers) == 0:
        raise ValueError("the model has no layers, so no kv heads")
    k_proj = cast(Block, model.layers[0]).attn.k
    return int(k_proj.out_features) // model.cfg.head_dim
