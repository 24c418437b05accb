"""Filling kiln's ``Transformer`` from a checkpoint's lazy tensors, one block at a time.

``build_model`` checks every name and shape of the checkpoint against the model before
reading anything — a missing tensor, an unexpected one or a wrong shape is a ``LoadError``
naming it, the file, and both shapes — then builds the model on the meta device (no
random initialisation) and reads into it, in order: the embedding (first pipeline stage),
each requested block, calling the caller's ``on_block`` hook as soon as the block is
filled, then the final norm and the head (last stage; a tied head is the embedding, unless
the checkpoint gives it as a packed layer of the stored table: then it is that layer).
Blocks outside ``layers`` stay on the meta device and their tensors are never read.

Where a tensor's memory comes from:

* a zero-copy view of the memory-mapped file, when the tensor is kept exactly as stored:
  no hook, no shard, already in the requested dtype (``LazyTensor.view``);
* otherwise new memory holding just what is needed, read explicitly (``read_rows``): a
  row slice reads only its rows; a column slice reads the tensor and copies its columns
  out. What a hook then replaces or releases leaves the process's memory with it, which a
  touched page of a mapping would not.

Each tensor moves to ``device`` as soon as it is read, so the host holds at most one
block on its way there. Packed / compressed layers (a GGUF's quantized layers, ``kiln
compress`` checkpoints) replace their ``nn.Linear``; weights are read before biases, because
a bias may belong to such a layer. A GGUF layer whose column slice (tensor-parallel rows of
the input) would cut its blocks is kept as float columns instead.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import cast

import torch
from torch import Tensor, nn

from kiln.compress.gguf_linear import GgufLinear
from kiln.compress.modules import CompressedLinear
from kiln.core.memory import trim_heap
from kiln.models.config import ModelConfig
from kiln.models.parts import BlockHook, BlockShard, LinearSlice
from kiln.models.readers import LazyTensor, LoadError
from kiln.models.transformer import Block, Transformer

_BLOCK = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)")
_FIRST = ("embed.", "pos_embed.")  # what only the first pipeline stage reads
_LAST = ("final_norm.", "lm_head.")  # and only the last


def build_model(
    cfg: ModelConfig,
    tensors: Mapping[str, LazyTensor],
    dtype: torch.dtype,
    where: str,
    *,
    layers: range | None = None,
    shard: BlockShard | None = None,
    on_block: BlockHook | None = None,
    device: torch.device | str = "cpu",
) -> Transformer:
    """A ``Transformer(cfg)`` holding ``tensors`` (kiln names), checked before reading.

    ``layers``: the blocks to read (default all); the embedding is read when they start
    at block 0, the final norm and head when they end at the last block. ``shard``: the
    slice of each block linear to read (module name in the block -> ``LinearSlice``);
    the layers then hold only that slice. ``on_block(i, block)``: called once block ``i``
    is filled and on ``device``, in order; it may replace or release the block's tensors.
    """
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}  # tied: once
    tensors = _untied(cfg, tensors)
    # A tied head the checkpoint stores packed (a GGUF's Q8_0 table) is read as its own layer.
    packed_head = cfg.tie_embeddings and "lm_head.weight" in tensors
    if packed_head:
        expected["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    _check(expected, tensors, where)
    wanted = _wanted(cfg, layers)
    first, last = wanted.start == 0, wanted.stop == cfg.n_layers
    per_block: dict[int, list[str]] = {i: [] for i in wanted}
    top: list[str] = []
    for name in tensors:
        m = _BLOCK.fullmatch(name)
        if m is None:
            top.append(name)
        elif int(m[1]) in per_block:
            per_block[int(m[1])].append(name)
    # A hook or a shard may drop what is read: then own memory, never the file's pages.
    private = shard is not None or on_block is not None
    filler = _Filler(model, tensors, expected, dtype, where, torch.device(device), private)
    if first:
        filler.fill(n for n in top if n.startswith(_FIRST))
    for i in wanted:
        filler.fill(per_block[i], shard)
        block = cast(Block, model.layers[i])
        _no_meta_left(block, f"layers.{i}.", where)
        if on_block is not None:
            on_block(i, block)
            trim_heap()  # what the hook freed goes back to the OS, not to a fragmented heap
    if last:
        filler.fill(n for n in top if n.startswith(_LAST))
        if cfg.tie_embeddings and not packed_head:
            if not first:
                filler.fill(["embed.weight"])  # the tied head is the embedding table
            model.lm_head.weight = model.embed.weight
    for prefix, module in (("embed.", model.embed), ("pos_embed.", model.pos_embed)):
        if first and module is not None:
            _no_meta_left(module, prefix, where)
    if last:
        _no_meta_left(model.final_norm, "final_norm.", where)
        _no_meta_left(model.lm_head, "lm_head.", where)
    return model.eval()


class _Filler:
    """Reads tensors by kiln name into the meta-built model (see the module doc)."""

    def __init__(
        self, model: Transformer, tensors: Mapping[str, LazyTensor],
        expected: Mapping[str, tuple[int, ...]], dtype: torch.dtype, where: str,
        device: torch.device, private: bool,
    ) -> None:  # fmt: skip
        self.model, self.tensors, self.expected = model, tensors, expected
        self.dtype, self.where, self.device, self.private = dtype, where, device, private

    def fill(self, names: Iterable[str], shard: BlockShard | None = None) -> None:
        # Weights before biases: a bias may belong to a layer just replaced by a packed one.
        for name in sorted(names, key=lambda n: n.endswith(".bias")):
            owner, leaf = name.rsplit(".", 1)
            part = None if shard is None else shard.get(owner.split(".", 2)[-1])
            want = self.expected[name] if part is None else part.shape(leaf, self.expected[name])
            self._set(name, owner, leaf, self._read(self.tensors[name], part, leaf), want)

    def _read(
        self, lazy: LazyTensor, part: LinearSlice | None, leaf: str
    ) -> Tensor | CompressedLinear:
        if part is None:
            if not self.private and lazy.view is not None:
                view = lazy.view()  # no page is touched until the data is used
                if view.dtype == self.dtype:
                    return view
            return lazy.read()
        if part.axis == "rows":
            return lazy.read_rows(part.start, part.stop)
        value = lazy.read()  # columns: the whole tensor, then its columns copied out
        if leaf == "bias":
            return value
        if isinstance(value, GgufLinear) and (part.start % value.block or part.stop % value.block):
            value = value.dense_weight()  # a GGUF's blocks cut mid-block: its float columns
        if isinstance(value, CompressedLinear):
            return value.slice_cols(part.start, part.stop)
        return value[:, part.start : part.stop].contiguous()

    def _set(
        self, name: str, owner: str, leaf: str, value: Tensor | CompressedLinear,
        want: tuple[int, ...],
    ) -> None:  # fmt: skip
        origin = self.tensors[name].origin
        got = (
            (value.out_features, value.in_features)
            if isinstance(value, CompressedLinear)
            else tuple(value.shape)
        )
        if got != want:
            raise LoadError(f"{self.where}: tensor {origin} read as {got}, "
                            f"but {name} must be {want}")  # fmt: skip
        module = self.model.get_submodule(owner)
        if isinstance(value, CompressedLinear):
            parent, _, attr = owner.rpartition(".")  # "" for the top-level lm_head
            setattr(self.model.get_submodule(parent), attr, value.to(self.device))
        elif isinstance(module, CompressedLinear):  # the bias of a packed layer: fp32 buffer
            module.bias = value.to(self.device, torch.float32).contiguous()
        else:
            weight = value.to(self.device, self.dtype, memory_format=torch.contiguous_format)
            setattr(module, leaf, nn.Parameter(weight, requires_grad=False))
            if isinstance(module, nn.Linear) and leaf == "weight":  # a slice: its own size
                module.out_features, module.in_features = weight.shape


def _untied(cfg: ModelConfig, tensors: Mapping[str, LazyTensor]) -> dict[str, LazyTensor]:
    """Some tied checkpoints repeat the head; it is the embedding (kept under its name).
    A head read as a packed layer (``LazyTensor.compressed``: a GGUF's tied table kept as
    stored) stays: it replaces the ``nn.Linear`` and is not re-tied."""
    out = dict(tensors)
    if cfg.tie_embeddings:
        if "lm_head.weight" in out and out["lm_head.weight"].compressed:
            return out
        head = out.pop("lm_head.weight", None)
        if "embed.weight" not in out and head is not None:
            out["embed.weight"] = head  # safetensors kept the shared tensor's other name
    return out


def _wanted(cfg: ModelConfig, layers: range | None) -> range:
    """The blocks to read: ``layers``, checked to be a non-empty run of the model's."""
    if layers is None:
        return range(cfg.n_layers)
    if layers.step != 1 or not 0 <= layers.start < layers.stop <= cfg.n_layers:
        raise ValueError(
            f"layers {layers} are not a non-empty run of the model's {cfg.n_layers} blocks"
        )
    return layers


def _check(
    expected: Mapping[str, tuple[int, ...]], tensors: Mapping[str, LazyTensor], where: str
) -> None:
    """Every parameter present once, with its shape; nothing left over."""
    missing = [name for name in expected if name not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise LoadError(f"{where}: missing tensor {missing[0]}{more}; kiln's model needs it")
    for name, lazy in tensors.items():
        if name not in expected:
            raise LoadError(f"{where}: unexpected tensor {lazy.origin} (kiln name {name}); "
                            "the config describes no such parameter")  # fmt: skip
        if tuple(lazy.shape) != expected[name]:
            raise LoadError(f"{where}: tensor {lazy.origin} has shape {tuple(lazy.shape)}, "
                            f"but {name} must be {expected[name]}")  # fmt: skip


def _no_meta_left(module: nn.Module, prefix: str, where: str) -> None:
    left: list[tuple[str, Tensor]] = [*module.named_parameters(), *module.named_buffers()]
    for name, t in left:
        if t.is_meta:
            raise LoadError(f"{where}: {prefix}{name} was not filled (a loader bug, please report)")
