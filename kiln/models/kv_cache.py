"""The preallocated key/value cache, written in place.

One (B, Hkv, S, D) key and value tensor per layer, allocated once for the longest sequence
the generation will reach; a step writes its T new positions with a slice copy and attends
over the filled prefix. The cache is keyed by global layer index, so a pipeline stage holds
only the layers it runs, and it can be created on any device (the offload tier keeps it in
CPU memory).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from kiln.models.config import ModelConfig


@dataclass
class KVCache:
    """Keys and values of every cached position, per layer."""

    keys: dict[int, Tensor]  # layer -> (B, Hkv, S, D)
    values: dict[int, Tensor]
    max_len: int
    # static: positions arrive as a device tensor and attention reads all max_len slots
    # behind a mask, so a step has fixed shapes and no host sync (CUDA-graph capturable)
    static: bool = False

    @classmethod
    def empty(
        cls,
        cfg: ModelConfig,
        layers: Iterable[int],
        batch: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_heads: int | None = None,
    ) -> KVCache:
        """Zeroed cache for ``layers``; ``kv_heads`` overrides the head count (a tensor-parallel
        rank caches only its own heads)."""
        heads = cfg.n_kv_heads if kv_heads is None else kv_heads
        shape = (batch, heads, max_len, cfg.head_dim)
        layers = list(layers)
        keys = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        values = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        return cls(keys, values, max_len)

    def write(self, layer: int, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v (B, Hkv, T, D) at positions start..start+T-1; return the filled
        prefix (B, Hkv, start+T, D) of keys and values as views."""
        stop = start + k.shape[2]
        if stop > self.max_len:
            raise ValueError(f"position {stop - 1} is past the cache's {self.max_len} slots")
        keys, values = self.keys[layer], self.values[layer]
        keys[:, :, start:stop].copy_(k)
        values[:, :, start:stop].copy_(v)
        return keys[:, :, :stop], values[:, :, :stop]

    def write_at(
        self, layer: int, positions: Tensor, k: Tensor, v: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Store k, v (B, Hkv, T, D) at the slots ``positions`` (T,), a device tensor (no
        host sync); return all ``max_len`` slots of keys and values."""
        keys, values = self.keys[layer], self.values[layer]
        keys.index_copy_(2, positions, k)
        values.index_copy_(2, positions, v)
        return keys, values

    def nbytes(self) -> int:
        tensors = [*self.keys.values(), *self.values.values()]
        return sum(t.numel() * t.element_size() for t in tensors)
