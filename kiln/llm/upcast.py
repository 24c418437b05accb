"""16-bit linear layers computed as fp32 matmuls: fast prefill of bf16 / fp16 models on a CPU.

On a CPU without bf16/fp16 matrix instructions (AVX2 here) torch's bf16 ``mm`` is slow:
a SmolLM2 bf16 prefill of 21 tokens spends 92% of its 450 ms in it, and one (21, 576) x
(576, 1536) product takes 2.5 ms against 0.7 ms for upcasting both operands, multiplying
in fp32 and rounding the product back. ``fp32_linears(model)`` makes every 16-bit
``nn.Linear`` of ``model`` do the latter while the block runs. The rounding points stay
the same: the native kernel accumulates in fp32 too and rounds each output once.
The weights are upcast per call (a layer's fp32 copy lives only during its product),
so the model's memory does not grow. Meant for prefill, where a product has many rows;
at one row per step the upcast costs more than it saves.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

HALF = (torch.bfloat16, torch.float16)


def _fp32_forward(mod: nn.Linear, x: Tensor) -> Tensor:
    bias = None if mod.bias is None else mod.bias.float()
    return F.linear(x.float(), mod.weight.float(), bias).to(x.dtype)


@contextmanager
def fp32_linears(model: nn.Module) -> Iterator[int]:
    """Within the block, ``model``'s CPU ``nn.Linear`` layers with 16-bit weights compute
    in fp32 (see the module doc); yields how many layers that is. Other layers (fp32,
    compressed) are untouched; on exit every layer's own forward is back."""
    patched = [
        mod for mod in model.modules()
        if type(mod) is nn.Linear and mod.weight.dtype in HALF and mod.weight.device.type == "cpu"
    ]  # fmt: skip
    for mod in patched:
        mod.forward = partial(_fp32_forward, mod)  # type: ignore[method-assign]
    try:
        yield len(patched)
    finally:
        for mod in patched:
            del mod.forward
