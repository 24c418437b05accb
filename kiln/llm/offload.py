"""Weight offloading: transformer blocks fetched just in time, one or more layers ahead.

    handle = offload_(model, Path("/tmp/store"), tier="disk", prefetch=1)
    model(tokens, start, cache)          # forward unchanged; blocks stream from disk
    handle.close(restore=True)           # optional: weights back in memory, hooks removed

``offload_`` moves every parameter and persistent buffer of each ``model.layers[i]`` (its
``state_dict``, so compressed layers' qweight/packed/scale/offset buffers go too, with no
special cases) out of the model and leaves meta-device placeholders: nothing of a block
stays resident. The embeddings, final norm and head stay resident (moved to ``device``).
Forward hooks on each block bind its tensors just before its forward and unbind them after:

* tier ``"disk"`` (CPU compute): the blocks are written once into a store folder
  (``offload_store``: flat, page-aligned). ``prefetch + 1`` staging buffers of the largest
  block's size are allocated once; a background thread reads the next ``prefetch`` blocks
  with ``os.preadv`` (GIL released) while the current block computes, and the block's
  tensors are views into its staging buffer during its forward. Peak resident memory is
  therefore the resident modules + ``prefetch + 1`` blocks, not the model. With
  ``evict_page_cache`` the read pages are dropped from the page cache too.
* tier ``"cpu"`` (CUDA compute only): the blocks live in pinned host memory and are copied
  into device staging buffers on a side CUDA stream; events order copy -> compute (ready)
  and compute -> next copy into the same buffer (free), so the copy of block i+1 overlaps
  block i's compute.

``load_offloaded`` streams a checkpoint straight into a store: each block is written as
soon as the loader has read it (``StreamToStore``, the loader's per-block hook) and
released, so the model's blocks never are all in memory, not even while loading: peak
memory is the resident modules + about one block, for a model larger than RAM too.

Prefetching wraps around: the last block prefetches block 0 of the next forward, so decode
steps overlap too. Modules that derive state from their tensors (compressed layers cache a
repacked kernel) override ``nn.Module._apply``; they get an identity ``_apply`` — the same
notification ``.to()`` gives them — whenever their tensors are bound or unbound, so no
derived copy outlives the block's forward (it is rebuilt every forward: a cost of
offloading compressed layers). ``HostKVCache`` keeps the KV cache in (pinned) host memory
while attention runs on the device. ``kiln/bench/offload_memory.py`` measures peak memory and
tokens/s on the real model.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, cast

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from kiln.llm.offload_store import (
    BlockFile,
    BlockSpec,
    DiskSource,
    HostKVCache,
    PinnedSource,
    Slot,
    Source,
    StoreWriter,
    block_state,
    block_views,
    check_state,
    pack_block,
    plan_block,
    read_store,
    write_store,
)
from kiln.models.load import LoadedModel, load_model
from kiln.models.parts import BlockHook, chain
from kiln.models.transformer import Block, Transformer

Tier = Literal["disk", "cpu"]
__all__ = ["HostKVCache", "Offloaded", "StreamToStore", "load_offloaded", "offload_"]


def _same(t: Tensor) -> Tensor:
    return t


class _Binding:
    """Where each tensor of one block lives in its module tree; swaps them in and out."""

    def __init__(self, block: nn.Module, spec: BlockSpec) -> None:
        self.sites: list[tuple[nn.Module, str, bool]] = []  # (module, attribute, is_param)
        self.placeholders: list[Tensor] = []
        for t in spec.tensors:
            prefix, _, attr = t.name.rpartition(".")
            module = block.get_submodule(prefix)
            is_param = attr in module._parameters
            if not is_param and attr not in module._buffers:
                raise ValueError(f"block {spec.index} has no parameter or buffer {t.name}")
            meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
            self.placeholders.append(nn.Parameter(meta, requires_grad=False) if is_param else meta)
            self.sites.append((module, attr, is_param))
        self.notify = [m for m in block.modules() if type(m)._apply is not nn.Module._apply]

    def wrap(self, views: Sequence[Tensor]) -> list[Tensor]:
        """``views`` as the tensors to bind: parameters where the sites hold parameters."""
        return [
            nn.Parameter(v, requires_grad=False) if site[2] else v
            for site, v in zip(self.sites, views)
        ]

    def bind(self, tensors: Sequence[Tensor]) -> None:
        for (module, attr, is_param), t in zip(self.sites, tensors):
            if is_param:
                module._parameters[attr] = cast(nn.Parameter, t)  # wrap() made it one
            else:
                module._buffers[attr] = t
        for m in self.notify:
            m._apply(_same, recurse=False)

    def unbind(self) -> None:
        self.bind(self.placeholders)


_OFFLOADED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # models with live hooks


class Offloaded:
    """The live offloading of one model: hooks, staging buffers, counters."""

    def __init__(
        self, model: Transformer, specs: list[BlockSpec], source: Source, prefetch: int
    ) -> None:
        self.model, self.specs, self.source, self.prefetch = model, specs, source, prefetch
        blocks = list(model.layers)
        self._bindings = [_Binding(b, s) for b, s in zip(blocks, specs)]
        for binding in self._bindings:
            binding.unbind()  # drops the model's references to the original tensors
        size = max(s.nbytes for s in specs)
        with torch.no_grad():
            self._slots = [Slot(source.new_buffer(size)) for _ in range(prefetch + 1)]
            for slot in self._slots:
                for s, b in zip(specs, self._bindings):
                    slot.bound[s.index] = b.wrap(list(block_views(s, slot.buf).values()))
        self._free = list(self._slots)
        self._pending: dict[int, Slot] = {}
        self._active: dict[int, Slot] = {}
        self.wait_s = 0.0  # time forward spent blocked on a block not yet fetched
        self.fetches = 0
        self._hooks: list[RemovableHandle] = []
        for i, block in enumerate(blocks):
            before = functools.partial(self._before, i)  # called as (module, args)
            after = functools.partial(self._after, i)  # (module, args, output); also on error
            self._hooks.append(block.register_forward_pre_hook(before))
            self._hooks.append(block.register_forward_hook(after, always_call=True))
        _OFFLOADED.add(model)

    @property
    def staging_bytes(self) -> int:
        return sum(s.buf.numel() for s in self._slots)

    def _start(self, i: int) -> None:
        if not self._free:
            raise RuntimeError(
                f"no free staging buffer for block {i}: {len(self._active)} blocks are running "
                "at once (offloaded blocks must run one at a time)"
            )
        slot = self._free.pop()
        self.source.start(self.specs[i], slot)
        self._pending[i] = slot
        self.fetches += 1

    def _drain(self) -> None:
        while self._pending:
            _, slot = self._pending.popitem()
            self._free.append(slot)
            self.source.wait(slot)

    def _before(self, i: int, *hook_args: Any) -> None:
        if i in self._active:
            raise RuntimeError(f"offloaded block {i} was called again inside its own forward")
        if i not in self._pending:  # not prefetched (first call, or blocks run out of order)
            self._drain()
            self._start(i)
        slot = self._pending.pop(i)
        t0 = time.perf_counter()
        try:
            self.source.wait(slot)
        except BaseException:
            self._free.append(slot)
            raise
        self.wait_s += time.perf_counter() - t0
        self._active[i] = slot
        self._bindings[i].bind(slot.bound[i])
        n = len(self.specs)
        for d in range(1, self.prefetch + 1):
            j = (i + d) % n
            if j not in self._pending and j not in self._active:
                self._start(j)

    def _after(self, i: int, *hook_args: Any) -> None:
        self._bindings[i].unbind()
        slot = self._active.pop(i)
        self.source.release(slot)
        self._free.append(slot)

    def close(self, restore: bool = False) -> None:
        """Remove the hooks and free the staging buffers. With ``restore`` every block's
        tensors are loaded back into (fresh) memory on the device, so the model runs as
        before; without it the blocks keep their meta placeholders."""
        if self._active:
            raise RuntimeError(f"blocks {sorted(self._active)} are running: cannot close")
        self._drain()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if restore:
            with torch.no_grad():
                for spec, binding in zip(self.specs, self._bindings):
                    views = block_views(spec, self.source.load(spec))
                    binding.bind(binding.wrap(list(views.values())))
        self.source.close()  # waits for the reader thread / the copy stream
        self._slots.clear()
        self._free.clear()
        _OFFLOADED.discard(self.model)


def offload_(
    model: Transformer,
    store: Path | str | None = None,
    tier: Tier = "disk",
    device: torch.device | str = "cpu",
    prefetch: int = 1,
    *,
    write: bool = True,
    evict_page_cache: bool = False,
) -> Offloaded:
    """Offload every block of ``model.layers`` (see the module doc); returns the handle.

    ``store``: folder of the disk store (required for ``"disk"``; for ``"cpu"`` optional: the
    pinned copies are then read from it with ``write=False``, or it is also written).
    ``write=False`` reuses an existing store without writing it (the blocks may then be on the
    meta device: a model too large to build in memory); names, dtypes and shapes must match.
    ``prefetch``: blocks fetched ahead (>= 0; 0 = fetch on demand, no overlap).
    """
    dev = torch.device(device)
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    if tier == "disk" and (store is None or dev.type != "cpu"):
        raise ValueError(
            f"tier 'disk' needs a store folder and device 'cpu' (got store={store}, "
            f"device={dev}); for a CUDA device use tier 'cpu'"
        )
    if tier == "cpu" and (dev.type != "cuda" or not torch.cuda.is_available()):
        raise ValueError(
            f"tier 'cpu' streams pinned host memory to a CUDA device; got device={dev} "
            f"(CUDA available: {torch.cuda.is_available()}). On a CPU-only machine use 'disk'."
        )
    if tier not in ("disk", "cpu"):
        raise ValueError(f"tier must be 'disk' or 'cpu', got {tier!r}")
    if model in _OFFLOADED:
        raise ValueError("this model is already offloaded; close() its handle first")
    if len(model.layers) == 0:
        raise ValueError("the model has no blocks to offload")
    folder = None if store is None else Path(store)
    states = [block_state(b) for b in model.layers]
    if not write:
        if folder is None:
            raise ValueError("write=False reuses a store: pass its folder")
        specs = read_store(folder)
        if len(specs) != len(states):
            raise ValueError(f"{folder} holds {len(specs)} blocks, the model has {len(states)}")
        for spec, state in zip(specs, states):
            check_state(spec, state)
    elif folder is not None:
        specs = write_store(folder, states)
    else:
        specs = [plan_block(i, s, 0) for i, s in enumerate(states)]
    for child in model.children():
        if child is not model.layers:
            child.to(dev)  # resident: embeddings, final norm, head
    source: Source
    if tier == "disk":
        assert folder is not None
        source = DiskSource(folder, evict_page_cache)
    else:
        host = [torch.empty(s.nbytes, dtype=torch.uint8, pin_memory=True) for s in specs]
        if write:
            for spec, state, buf in zip(specs, states, host):
                pack_block(spec, state, buf)
        else:
            assert folder is not None
            reader = BlockFile(folder)
            for spec, buf in zip(specs, host):
                reader.read(spec, buf)
            reader.close()
        source = PinnedSource(host, dev)
    del states
    return Offloaded(model, specs, source, prefetch)


class StreamToStore:
    """The loader's per-block hook (``kiln.models.parts.BlockHook``) that writes each block
    to a disk offload store as soon as it is filled and leaves meta placeholders in its
    place: its tensors are freed before the next block is read. Blocks must come in order
    0, 1, ...; ``finish`` writes the manifest, after which ``offload_(model, store,
    write=False)`` streams them back per forward."""

    def __init__(self, store: Path) -> None:
        self.writer = StoreWriter(store)

    def __call__(self, index: int, block: Block) -> None:
        if index != len(self.writer.specs):
            raise ValueError(
                f"block {index} came after {len(self.writer.specs)} blocks: an offload store "
                "holds every block of the model, in order"
            )
        state = block_state(block)
        self.writer.add(state)
        for name, t in state.items():
            prefix, _, attr = name.rpartition(".")
            module = block.get_submodule(prefix)
            meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
            if attr in module._parameters:
                module._parameters[attr] = nn.Parameter(meta, requires_grad=False)
            else:
                module._buffers[attr] = meta

    def finish(self) -> None:
        self.writer.finish()

    def close(self) -> None:
        self.writer.close()


def load_offloaded(
    path: str | Path,
    store: str | Path,
    dtype: torch.dtype = torch.float32,
    packed: bool = True,
    *,
    prefetch: int = 1,
    evict_page_cache: bool = False,
    with_tokenizer: bool = True,
    on_block: BlockHook | None = None,
) -> tuple[LoadedModel, Offloaded]:
    """Load checkpoint ``path`` (``kiln.models.load.load_model``) with every block streamed
    straight into the disk store ``store`` and offloaded from there (CPU compute; see the
    module doc): the loaded model's blocks are meta placeholders. ``on_block`` runs on each
    block before it is stored (e.g. ``kiln.models.parts.quantize_blocks``)."""
    folder = Path(store)
    sink = StreamToStore(folder)
    try:
        loaded = load_model(
            path, dtype, packed, with_tokenizer=with_tokenizer, on_block=chain(on_block, sink)
        )
        sink.finish()
    finally:
        sink.close()
    handle = offload_(
        loaded.model, folder, tier="disk", prefetch=prefetch, write=False,
        evict_page_cache=evict_page_cache,
    )  # fmt: skip
    return loaded, handle
