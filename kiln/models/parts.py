"""What part of a checkpoint a process loads, and what happens to each block once it is read.

A streaming load (``kiln.models.fill``) fills the model one block at a time. Its caller says

* which blocks (``layers``: a pipeline stage's range; the others are never read),
* which slice of each block's linear layers (``shard``: module name relative to the block,
  e.g. ``"attn.q"`` -> ``LinearSlice``, a tensor-parallel rank's rows or columns): only
  those rows are read from the file,
* what to do with a block as soon as it is filled (a ``BlockHook``: quantize it, finish its
  tensor-parallel surgery, write it to an offload store and release it), so at most one
  block's float copy is resident beyond what the process keeps.

Hooks for process groups and offload stores come from the layers above (``kiln.parallel``,
``kiln.llm``); this package only calls them. ``quantize_blocks`` is the one it provides.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from torch import nn

from kiln.compress.configs import Int4WeightOnly, Int8WeightOnly
from kiln.compress.verbs import quantize_
from kiln.models.transformer import Block

BlockHook = Callable[[int, Block], None]  # (global layer index, the block just filled)


@dataclass(frozen=True)
class LinearSlice:
    """A process's part of one linear layer (weight (N, K)): output features [start, stop)
    (``"rows"``: column-parallel; the bias is cut the same way) or input features [start,
    stop) (``"cols"``: row-parallel; the bias stays whole, for the caller to add once)."""

    axis: Literal["rows", "cols"]
    start: int
    stop: int

    def __post_init__(self) -> None:
        if self.axis not in ("rows", "cols") or not 0 <= self.start < self.stop:
            raise ValueError(f"not a slice of a linear layer: {self}")

    def shape(self, leaf: str, full: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the layer's ``leaf`` ("weight" or "bias", full shape ``full``)
        once sliced."""
        if self.axis == "rows":
            return (self.stop - self.start, *full[1:])
        return (full[0], self.stop - self.start) if leaf == "weight" else full


BlockShard = Mapping[str, LinearSlice]  # linear module name in a block -> its slice


def chain(*hooks: BlockHook | None) -> BlockHook | None:
    """One hook running ``hooks`` in order (None entries skipped); None when none is left."""
    live = [h for h in hooks if h is not None]
    if not live:
        return None
    if len(live) == 1:
        return live[0]

    def run(index: int, block: Block) -> None:
        for hook in live:
            hook(index, block)

    return run


def quantize_blocks(config: Int8WeightOnly | Int4WeightOnly) -> BlockHook:
    """A hook storing each block's linear layers as weight-only INT8 / INT4 as soon as the
    block is read: its float weights are dropped before the next block is read, so the
    float model never exists whole. Every linear of a block must suit ``config``."""

    def quantize(index: int, block: Block) -> None:
        quantize_(block, config, filter_fn=_every_linear)

    return quantize


def _every_linear(module: nn.Module, name: str) -> bool:
    return True
