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

A CPU with 16-bit dot-product instructions keeps torch's own 16-bit matmul
(``native_half_matmul``): on AMD EPYC Zen 4 (AVX-512 BF16, 2 threads) bf16 ``F.linear``
was 3-11x faster than the upcast — (64, 1536) x (8960, 1536) 9 ms against 70 ms, the
(1, 1536) x (151936, 1536) head 40 ms against 460 ms — where the upcast's fp32 copies of
the weights had been 44% of a Qwen2-1.5B bf16 prefill.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kiln.core.native import cpu_flags

HALF = (torch.bfloat16, torch.float16)
# CPU flags (/proc/cpuinfo) of instructions that multiply each 16-bit type natively
NATIVE_FLAGS = {torch.bfloat16: {"avx512_bf16", "amx_bf16"},
                torch.float16: {"avx512_fp16", "amx_fp16"}}  # fmt: skip


def native_half_matmul(dtype: torch.dtype) -> bool:
    """Whether this CPU has dot-product instructions for ``dtype`` (bf16: AVX-512 BF16 or
    AMX-BF16; fp16: AVX512-FP16 or AMX-FP16), so torch's 16-bit matmul is fast."""
    return bool(NATIVE_FLAGS.get(dtype, set()) & set(cpu_flags()))


def _fp32_forward(mod: nn.Linear, x: Tensor) -> Tensor:
    bias = None if mod.bias is None else mod.bias.float()
    return F.linear(x.float(), mod.weight.float(), bias).to(x.dtype)


@contextmanager
def fp32_linears(model: nn.Module) -> Iterator[int]:
    """Within the block, ``model``'s CPU ``nn.Linear`` layers with 16-bit weights compute
    in fp32 (see the module doc) unless this CPU multiplies their dtype natively; yields how
    many layers that is. Other layers (fp32, compressed) are untouched; on exit every
    layer's own forward is back."""
    slow = {dtype for dtype in HALF if not native_half_matmul(dtype)}
    patched = [
        mod for mod in model.modules()
        if type(mod) is nn.Linear and mod.weight.dtype in slow and mod.weight.device.type == "cpu"
    ]  # fmt: skip
    for mod in patched:
        mod.forward = partial(_fp32_forward, mod)  # type: ignore[method-assign]
    try:
        yield len(patched)
    finally:
        for mod in patched:
            del mod.forward
