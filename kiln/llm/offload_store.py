"""The on-disk (and pinned-memory) layout of offloaded transformer blocks.

A store is a folder with two files:

* ``blocks.bin`` — every block's tensors, raw bytes, one block after another. Each block
  starts on a 4096-byte boundary (page size: a block can be read with O_DIRECT or
  evicted from the page cache on its own), each tensor inside a block on a 64-byte
  boundary (so a uint8 staging buffer viewed at that offset is aligned for any dtype and
  for SIMD loads).
* ``manifest.json`` — per block: its file offset and byte size, and per tensor its
  ``state_dict`` name (relative to the block), dtype, shape and offset inside the block.
  It is written after the data, so a store whose writing was interrupted has no manifest
  and is refused.

A block is read with ``os.preadv`` into a caller-provided, preallocated buffer (never by
mmapping the file: touched mmap pages would count as resident memory), and its tensors
are then *views* into that buffer (``block_views``). The same flat layout is used for the
pinned host copies of the ``"cpu"`` tier (``pack_block``).

The sources move a block into a staging ``Slot``: ``DiskSource`` (a background reader
thread, host buffers) and ``PinnedSource`` (pinned host memory -> CUDA buffers on a side
stream, ordered by events). ``HostKVCache`` keeps the KV cache off the device.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import torch
from torch import Tensor, nn

from kiln.models.kv_cache import KVCache
from kiln.models.transformer import Transformer

DATA = "blocks.bin"
MANIFEST = "manifest.json"
FORMAT = "kiln-offload/1"
BLOCK_ALIGN = 4096  # bytes: page size
TENSOR_ALIGN = 64  # bytes: cache line, and any dtype's alignment


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in an offload manifest")
    return dtype


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a block: where its bytes lie inside the block."""

    name: str  # state_dict key relative to the block, e.g. "attn.q.weight"
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the block's start

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * self.dtype.itemsize


@dataclass(frozen=True)
class BlockSpec:
    """One block: its place in ``blocks.bin`` and its tensors."""

    index: int
    offset: int  # bytes from the file's start (a multiple of BLOCK_ALIGN)
    nbytes: int  # bytes a staging buffer needs for this block
    tensors: tuple[TensorSpec, ...]


def block_state(block: nn.Module) -> dict[str, Tensor]:
    """Every parameter and persistent buffer of ``block`` by ``state_dict`` name (compressed
    layers contribute their buffers — qweight, packed, scale, ... — like any other)."""
    return {name: t.detach() for name, t in block.state_dict(keep_vars=True).items()}


def plan_block(index: int, state: Mapping[str, Tensor], offset: int) -> BlockSpec:
    """Lay out ``state``'s tensors in one block starting at file ``offset``."""
    specs, pos = [], 0
    for name, t in state.items():
        if t.is_meta:
            raise ValueError(f"block {index} tensor {name} is on the meta device: no data")
        spec = TensorSpec(name, t.dtype, tuple(t.shape), pos)
        specs.append(spec)
        pos = _round_up(pos + spec.nbytes, TENSOR_ALIGN)
    return BlockSpec(index, offset, max(pos, TENSOR_ALIGN), tuple(specs))


def pack_block(spec: BlockSpec, state: Mapping[str, Tensor], out: Tensor) -> None:
    """Copy ``state``'s tensors into the flat uint8 buffer ``out`` (spec.nbytes,)."""
    for view, t in zip(block_views(spec, out).values(), state.values()):
        view.copy_(t)


def block_views(spec: BlockSpec, buf: Tensor) -> dict[str, Tensor]:
    """The block's tensors as views into the flat uint8 buffer ``buf`` (>= spec.nbytes)."""
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < spec.nbytes:
        raise ValueError(
            f"block {spec.index} needs a 1-D uint8 buffer of {spec.nbytes} bytes, got "
            f"{buf.dtype} {tuple(buf.shape)}"
        )
    out = {}
    for t in spec.tensors:
        raw = buf[t.offset : t.offset + t.nbytes]
        out[t.name] = raw.view(t.dtype).view(t.shape)
    return out


def check_state(spec: BlockSpec, state: Mapping[str, Tensor]) -> None:
    """Raise ValueError unless ``state`` has exactly the spec's tensor names, dtypes, shapes."""
    want = {t.name: t for t in spec.tensors}
    if set(want) != set(state):
        missing, extra = sorted(set(want) - set(state)), sorted(set(state) - set(want))
        raise ValueError(
            f"block {spec.index} does not match the offload store: missing {missing}, "
            f"unexpected {extra}"
        )
    for name, t in state.items():
        if (t.dtype, tuple(t.shape)) != (want[name].dtype, want[name].shape):
            raise ValueError(
                f"block {spec.index} tensor {name} is {t.dtype} {tuple(t.shape)}, the store "
                f"holds {want[name].dtype} {want[name].shape}"
            )


class StoreWriter:
    """Writes a store one block at a time: ``add`` appends a block's tensors to
    ``blocks.bin`` (so a loader can write each block as soon as it is read and release it),
    ``finish`` writes the manifest. A writer closed without ``finish`` (an error) leaves no
    manifest, so the half-written store is refused."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        (folder / MANIFEST).unlink(missing_ok=True)  # the store is invalid until written again
        self._file: BinaryIO | None = open(folder / DATA, "wb")  # noqa: SIM115 (closed in finish)
        self.specs: list[BlockSpec] = []
        self._offset = 0

    def add(self, state: Mapping[str, Tensor]) -> BlockSpec:
        """Append the next block (``state``: its tensors by ``state_dict`` name)."""
        if self._file is None:
            raise ValueError(f"the store writer of {self.folder} is closed")
        spec = plan_block(len(self.specs), state, self._offset)
        for t, tensor in zip(spec.tensors, state.values()):
            self._file.seek(spec.offset + t.offset)
            flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            self._file.write(memoryview(flat.numpy()))  # type: ignore[arg-type]
        self.specs.append(spec)
        self._offset = _round_up(spec.offset + spec.nbytes, BLOCK_ALIGN)
        return spec

    def finish(self) -> list[BlockSpec]:
        """Close ``blocks.bin`` and write the manifest; returns every block's layout."""
        if self._file is None:
            raise ValueError(f"the store writer of {self.folder} is closed")
        self._file.truncate(self._offset)
        self.close()
        blocks = [
            {
                "offset": s.offset,
                "nbytes": s.nbytes,
                "tensors": [
                    {
                        "name": t.name,
                        "dtype": str(t.dtype).removeprefix("torch."),
                        "shape": list(t.shape),
                        "offset": t.offset,
                    }
                    for t in s.tensors
                ],
            }  # fmt: skip
            for s in self.specs
        ]
        manifest = {"format": FORMAT, "file_bytes": self._offset, "blocks": blocks}
        (self.folder / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
        return self.specs

    def close(self) -> None:
        """Close ``blocks.bin`` (without a manifest unless ``finish`` wrote it)."""
        if self._file is not None:
            self._file.close()
            self._file = None


def write_store(folder: Path, states: Sequence[Mapping[str, Tensor]]) -> list[BlockSpec]:
    """Write every block's tensors to ``folder/blocks.bin`` and then the manifest."""
    writer = StoreWriter(folder)
    try:
        for state in states:
            writer.add(state)
        return writer.finish()
    finally:
        writer.close()


def read_store(folder: Path) -> list[BlockSpec]:
    """The block layout of an existing store; refuses a missing, foreign or truncated one."""
    path = folder / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {folder} is not a (completely written) store")
    manifest = json.loads(path.read_text(encoding="utf-8"))
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path} has format {manifest.get('format')!r}, expected {FORMAT!r}")
    size = (folder / DATA).stat().st_size
    if size < manifest["file_bytes"]:
        raise ValueError(
            f"{folder / DATA} is truncated: {size} bytes, the manifest says {manifest['file_bytes']}"
        )
    return [
        BlockSpec(
            i,
            b["offset"],
            b["nbytes"],
            tuple(
                TensorSpec(t["name"], _dtype(t["dtype"]), tuple(t["shape"]), t["offset"])
                for t in b["tensors"]
            ),
        )  # fmt: skip
        for i, b in enumerate(manifest["blocks"])
    ]


class BlockFile:
    """``blocks.bin`` opened for positional reads into preallocated host buffers.

    ``read`` may run on a background thread: ``os.preadv`` releases the GIL while the
    kernel copies. With ``evict`` the block's pages are dropped from the page cache after
    reading (POSIX_FADV_DONTNEED), so streaming a model larger than RAM does not grow the
    page cache and every read really comes from the disk.
    """

    def __init__(self, folder: Path, evict: bool = False) -> None:
        self.path = folder / DATA
        self.evict = evict
        self._fd: int | None = os.open(self.path, os.O_RDONLY)
        self.bytes_read = 0

    def read(self, spec: BlockSpec, buf: Tensor) -> None:
        """Fill ``buf[:spec.nbytes]`` (uint8, CPU) with block ``spec.index``'s bytes."""
        if self._fd is None:
            raise ValueError(f"{self.path} is closed")
        if buf.device.type != "cpu" or buf.dtype != torch.uint8 or buf.numel() < spec.nbytes:
            raise ValueError(
                f"block {spec.index} needs a CPU uint8 buffer of {spec.nbytes} bytes, got "
                f"{buf.device} {buf.dtype} {tuple(buf.shape)}"
            )
        array = buf.numpy()  # shares buf's memory
        view = memoryview(array).cast("B")[: spec.nbytes]  # type: ignore[arg-type]
        done = 0
        while done < spec.nbytes:
            n = os.preadv(self._fd, [view[done:]], spec.offset + done)
            if n == 0:
                raise ValueError(
                    f"{self.path} ended at byte {spec.offset + done} inside block {spec.index} "
                    f"(expected {spec.nbytes} bytes from {spec.offset})"
                )
            done += n
        if self.evict:
            os.posix_fadvise(self._fd, spec.offset, spec.nbytes, os.POSIX_FADV_DONTNEED)
        self.bytes_read += spec.nbytes

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclass
class Slot:
    """One staging buffer and its state in the pipeline."""

    buf: Tensor  # (max block bytes,) uint8 on the host (disk) or the device (cpu tier)
    bound: dict[int, list[Tensor]] = field(default_factory=dict)  # layer -> its views in buf
    pending: Future[None] | None = None  # disk: the read filling it
    ready: Any = None  # cpu tier: CUDA event, copy into buf done
    free: Any = None  # cpu tier: CUDA event, last compute reading buf done


class Source(Protocol):
    """Fills staging slots with blocks; ``load`` returns a block in a fresh buffer."""

    def new_buffer(self, nbytes: int) -> Tensor: ...
    def start(self, spec: BlockSpec, slot: Slot) -> None: ...
    def wait(self, slot: Slot) -> None: ...
    def release(self, slot: Slot) -> None: ...
    def load(self, spec: BlockSpec) -> Tensor: ...
    def close(self) -> None: ...


class DiskSource:
    """Blocks read from the store by one background thread into host staging buffers."""

    def __init__(self, folder: Path, evict: bool) -> None:
        self.file = BlockFile(folder, evict)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-offload-read")

    def new_buffer(self, nbytes: int) -> Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def start(self, spec: BlockSpec, slot: Slot) -> None:
        slot.pending = self.pool.submit(self.file.read, spec, slot.buf)

    def wait(self, slot: Slot) -> None:
        pending, slot.pending = slot.pending, None
        if pending is not None:
            pending.result()  # re-raises the reader's error (truncated file, I/O error)

    def release(self, slot: Slot) -> None:
        return None

    def load(self, spec: BlockSpec) -> Tensor:
        buf = self.new_buffer(spec.nbytes)
        self.file.read(spec, buf)
        return buf

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.file.close()


class PinnedSource:
    """Blocks in pinned host memory, copied to device staging buffers on a side stream."""

    def __init__(self, host: list[Tensor], device: torch.device) -> None:
        self.host, self.device = host, device  # host[i]: (block i bytes,) uint8, pinned
        self.stream = torch.cuda.Stream(device)

    def new_buffer(self, nbytes: int) -> Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def start(self, spec: BlockSpec, slot: Slot) -> None:
        with torch.cuda.stream(self.stream):
            if slot.free is not None:  # compute still reading the buffer's previous block
                self.stream.wait_event(slot.free)
            else:  # first use: the buffer was allocated on the compute stream
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
            slot.buf[: spec.nbytes].copy_(self.host[spec.index], non_blocking=True)
            slot.ready = torch.cuda.Event()
            slot.ready.record(self.stream)

    def wait(self, slot: Slot) -> None:
        torch.cuda.current_stream(self.device).wait_event(slot.ready)

    def release(self, slot: Slot) -> None:
        slot.free = torch.cuda.Event()
        slot.free.record(torch.cuda.current_stream(self.device))

    def load(self, spec: BlockSpec) -> Tensor:
        return self.host[spec.index].to(self.device)

    def close(self) -> None:
        self.stream.synchronize()


class HostKVCache(KVCache):
    """A KV cache kept in host memory (pinned when CUDA is present) while attention runs on
    the device: ``write`` stores the new positions on the host and returns the filled prefix
    copied to the keys' device. Host layout per layer: (S, B, Hkv, D), so a prefix is one
    contiguous range (one copy)."""

    @classmethod
    def for_model(cls, model: Transformer, batch: int, max_len: int) -> HostKVCache:
        cfg, dtype = model.cfg, model.embed.weight.dtype
        shape = (max_len, batch, cfg.n_kv_heads, cfg.head_dim)  # (S, B, Hkv, D)
        pin = torch.cuda.is_available()
        layers = range(cfg.n_layers)
        keys = {i: torch.zeros(shape, dtype=dtype, pin_memory=pin) for i in layers}
        values = {i: torch.zeros(shape, dtype=dtype, pin_memory=pin) for i in layers}
        return cls(keys, values, max_len)

    def write(self, layer: int, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        stop = start + k.shape[2]  # k, v (B, Hkv, T, D) on the compute device
        if stop > self.max_len:
            raise ValueError(f"position {stop - 1} is past the cache's {self.max_len} slots")
        out = []
        for host, new in ((self.keys[layer], k), (self.values[layer], v)):
            host[start:stop].copy_(new.permute(2, 0, 1, 3))  # (T, B, Hkv, D), synchronous
            prefix = host[:stop].to(new.device, non_blocking=True)  # (S, B, Hkv, D)
            out.append(prefix.permute(1, 2, 0, 3))  # (B, Hkv, S, D)
        return out[0], out[1]
