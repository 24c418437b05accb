"""A plan's weight format applied to a loaded model: the one place that does it.

``store_in_format(model, fmt)`` stores the blocks' linear weights as the planner's format
names them (``estimate.FORMATS``): fp32 as loaded, bf16, or kiln's INT8 / INT4
weight-only kernels, on a CPU the head then INT8 too (as ``kiln generate`` runs a
compressed model), or a per-layer mix of those kernels (``deploy.mixed``: a ``mixed:...``
spec). On a GPU the quantized formats run their Triton kernels on bf16 activations and
keep a bf16 head, as the planner prices them (``estimate``).
Execution (``execute``), ``kiln run PLAN.json`` (``generate_job``) and the engine timings the
planner prices plans with (``kernel_rates``) all go through it, so what is timed is what
runs.

A streaming load applies the format while it reads (``load_format``: the dtype to read in
and a per-block hook quantizing each block as soon as it is read), so the float model
never exists whole; ``store_in_format`` then leaves those blocks as they are (and blocks
a partial load never read, or an offloaded model's placeholders) and does the head.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from kiln.deploy.mixed import is_mixed, label, per_block
from kiln.models.transformer import Transformer

if TYPE_CHECKING:
    from kiln.compress.configs import Int4WeightOnly, Int8WeightOnly
    from kiln.models.parts import Block, BlockHook

FORMAT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def store_in_format(model: Transformer, fmt: str) -> Transformer:
    """Store ``model``'s block weights in the plan format ``fmt`` in place: bf16, or kiln's
    INT8 / INT4 kernels (then the head too is INT8, as ``kiln generate`` runs a compressed
    model); fp32 leaves it as it is."""
    from kiln.compress import Int8WeightOnly, quantize_
    from kiln.llm.fast_decoder import quantize_head_

    if fmt in FORMAT_DTYPES:
        return model.to(FORMAT_DTYPES[fmt])
    # float block linears with data: not those quantized while loading, nor meta ones
    blocks = lambda m, name: name.startswith("layers.") and not m.weight.is_meta  # noqa: E731
    if is_mixed(fmt):
        hook = _quantize_mixed(fmt)
        for index, block in enumerate(model.layers):
            hook(index, cast("Block", block))
    else:
        quantize_(model, quantization(fmt), filter_fn=blocks)
    if model.embed.weight.is_cuda:  # a GPU plan: bf16 activations into the Triton kernels
        return model.to(torch.bfloat16)
    head = model.lm_head
    # a float head with data: not one kept packed (a GGUF's Q8_0 table), nor a released one
    if isinstance(head, torch.nn.Linear) and head.weight.numel():
        quantize_head_(model, Int8WeightOnly())
    return model


def load_format(fmt: str, device: str = "cpu") -> tuple[torch.dtype, BlockHook | None]:
    """How a streaming load (``kiln.models.load``) onto ``device`` applies ``fmt``: the
    dtype to read the weights in (a quantized format's activations: fp32 on a CPU, bf16 on
    a GPU), and the per-block hook quantizing each block as soon as it is read (None for
    the float formats). ``store_in_format`` afterwards does the head."""
    if fmt in FORMAT_DTYPES:
        return FORMAT_DTYPES[fmt], None
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    if is_mixed(fmt):
        return dtype, _quantize_mixed(fmt)
    from kiln.models.parts import quantize_blocks

    return dtype, quantize_blocks(quantization(fmt))


def _quantize_mixed(spec: str) -> BlockHook:
    """A hook storing each linear of block ``index`` in its format of mixed ``spec``
    (``deploy.mixed``: one format per block linear, the blocks in order)."""
    from kiln.compress import quantize_
    from kiln.compress.modules import CompressedLinear

    def quantize(index: int, block: Block) -> None:
        # the block's linears in module order, float or already stored (a streamed load)
        names = [n for n, m in block.named_modules()
                 if isinstance(m, torch.nn.Linear | CompressedLinear)]  # fmt: skip
        blocks = per_block(spec, len(names))
        if index >= len(blocks):
            raise ValueError(f"mixed format {label(spec)} has {len(blocks)} blocks; "
                             f"block {index} was read")  # fmt: skip
        chosen = dict(zip(names, blocks[index], strict=True))
        for part in dict.fromkeys(chosen.values()):
            mine = lambda m, name, part=part: (  # noqa: E731
                chosen.get(name) == part and not m.weight.is_meta
            )
            quantize_(block, quantization(part), filter_fn=mine)

    return quantize


def quantization(fmt: str) -> Int8WeightOnly | Int4WeightOnly:
    """The weight-only config that stores a block linear in planner format ``fmt``."""
    from kiln.compress import Int4WeightOnly, Int8WeightOnly

    if fmt == "int8":
        return Int8WeightOnly()
    if fmt.startswith("int4-g"):
        return Int4WeightOnly(group_size=int(fmt[len("int4-g") :]))
    raise ValueError(f"kiln cannot store weights as {fmt!r}")
