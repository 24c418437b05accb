"""Checkpoint bytes read with explicit positional reads into fresh memory, not through a mapping.

A memory-mapped checkpoint gives zero-copy tensors, but every page of the mapping a read
touches counts in the process's resident memory (and its high-water mark) for as long as
the file stays mapped, whether or not the tensor is still used. A streaming load that
quantizes, shards or offloads each block and drops its float copy would keep the whole
file resident that way. The readers here copy exactly the bytes asked for (one tensor,
or a range of its rows) with ``os.preadv`` into a new buffer that is freed with the tensor:
the file's pages stay in the page cache, not in this process.

``SafetensorsLayout`` parses a safetensors header (8-byte little-endian length, then JSON:
name -> dtype, shape, [begin, end) of its bytes after the header) to know where each
tensor lies.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from kiln.models.readers import LoadError

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header


def read_bytes(path: Path, offset: int, nbytes: int) -> Tensor:
    """``nbytes`` bytes of ``path`` from ``offset`` as a new (nbytes,) uint8 tensor; a file
    that ends early raises ``LoadError`` naming it."""
    out = torch.empty(nbytes, dtype=torch.uint8)
    view = memoryview(out.numpy()).cast("B")  # type: ignore[arg-type]  # shares out's memory
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < nbytes:
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                raise LoadError(f"{path}: ends at byte {offset + done}, inside the {nbytes} "
                                f"bytes expected from byte {offset} (truncated?)")  # fmt: skip
            done += n
    finally:
        os.close(fd)
    return out


def read_rows(
    path: Path, offset: int, dtype: torch.dtype, shape: tuple[int, ...], start: int, stop: int
) -> Tensor:
    """Rows [start, stop) of the C-contiguous tensor (``shape``, ``dtype``) stored at byte
    ``offset`` of ``path``, read alone into new memory: (stop - start, *shape[1:]).
    A 1-D tensor's rows are its elements."""
    if not shape:
        raise ValueError(f"{path}: a 0-d tensor has no rows")
    if not 0 <= start <= stop <= shape[0]:
        raise ValueError(f"{path}: rows [{start}, {stop}) are outside the {shape[0]} rows")
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    raw = read_bytes(path, offset + start * row_bytes, (stop - start) * row_bytes)
    return raw.view(dtype).view(stop - start, *shape[1:])


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor of a safetensors file lies: dtype, shape and its first byte."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # from the file's start


class SafetensorsLayout:
    """The tensor table of one safetensors file, for explicit reads of whole tensors or
    row ranges (``read``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                if not 0 < size <= _MAX_HEADER:
                    raise ValueError(f"header length {size}")
                header = json.loads(f.read(size))
        except (OSError, ValueError, UnicodeDecodeError) as err:
            raise LoadError(f"{path}: unreadable safetensors header ({err})") from err
        start = 8 + size
        self.tensors: dict[str, StoredTensor] = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
            if dtype is None:
                raise LoadError(f"{path}: tensor {name} has dtype {entry['dtype']}, which kiln "
                                "does not read")  # fmt: skip
            begin, _ = entry["data_offsets"]
            self.tensors[name] = StoredTensor(dtype, tuple(entry["shape"]), start + begin)

    def read(self, name: str, rows: tuple[int, int] | None = None) -> Tensor:
        """Tensor ``name`` (or only its rows [start, stop)) read into new memory."""
        stored = self.tensors.get(name)
        if stored is None:
            raise LoadError(f"{self.path}: no tensor {name}")
        if not stored.shape:  # 0-d: its one element
            return read_bytes(self.path, stored.offset, stored.dtype.itemsize).view(stored.dtype)[0]
        start, stop = rows if rows is not None else (0, stored.shape[0])
        return read_rows(self.path, stored.offset, stored.dtype, stored.shape, start, stop)
