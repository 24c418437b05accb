"""What the checkpoint readers share: their error type and the lazily read tensor record.

A reader (``hf.py``, ``gguf.py``, ``compressed.py``) never builds a model. It translates a
checkpoint into a ``ModelConfig`` and a mapping ``kiln parameter name -> LazyTensor``: where
the tensor comes from (for messages), the shape it will have once read and converted (from
the file's header, so every name and shape is checked before any data is touched), and how
to read it. ``kiln.models.fill`` checks that mapping against the model and reads one tensor
at a time, so a checkpoint is never held twice in memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from kiln.compress.modules import CompressedLinear
from kiln.models.config import ConfigError

__all__ = ["ConfigError", "LazyTensor", "LoadError"]


class LoadError(ValueError):
    """A checkpoint kiln cannot read: missing or truncated file, missing, extra or
    mis-shaped tensor. The message names the file and the tensor."""


@dataclass(frozen=True)
class LazyTensor:
    """One parameter of the model, not read yet.

    ``origin`` says where it lives ("model.layers.0.mlp.up_proj.weight in
    model-00001-of-00002.safetensors"); ``shape`` is the shape ``read`` returns (for a
    compressed linear layer, its logical (out, in) weight shape). ``read_rows(start,
    stop)`` returns rows [start, stop) of the value (a 1-D tensor's elements; a compressed
    layer's output features) in new memory, read with explicit reads of only those bytes
    where the format allows: a float tensor, or a compressed linear layer that replaces
    the ``nn.Linear`` owning the weight. ``view``, where the stored tensor is the value as
    it is (no dequantizing, reordering or transposing), returns it as a zero-copy view of
    the memory-mapped file instead (pages it touches count as this process's memory while
    the file is mapped). ``compressed``: ``read`` gives a ``CompressedLinear`` (a packed
    layer replacing the ``nn.Linear``), not a tensor.
    """

    origin: str
    shape: tuple[int, ...]
    read_rows: Callable[[int, int], Tensor | CompressedLinear]
    view: Callable[[], Tensor] | None = None
    compressed: bool = False

    def read(self) -> Tensor | CompressedLinear:
        """The whole value, in new memory."""
        return self.read_rows(0, self.shape[0])
