"""A plan's weight format applied to a loaded model: the one place that does it.

``store_in_format(model, fmt)`` stores the blocks' linear weights as the planner's format
names them (``estimate.FORMATS`` on a CPU): fp32 as loaded, bf16, or kiln's INT8 / INT4
weight-only kernels, the head then INT8 too (as ``kiln generate`` runs a compressed model).
Execution (``execute``), ``kiln run PLAN.json`` (``generate_job``) and the engine timings the
planner prices plans with (``kernel_rates``) all go through it, so what is timed is what
runs.
"""

from __future__ import annotations

import torch

from kiln.models.transformer import Transformer

FORMAT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def store_in_format(model: Transformer, fmt: str) -> Transformer:
    """Store ``model``'s block weights in the plan format ``fmt`` in place: bf16, or kiln's
    INT8 / INT4 kernels (then the head too is INT8, as ``kiln generate`` runs a compressed
    model); fp32 leaves it as it is."""
    from kiln.compress import Int4WeightOnly, Int8WeightOnly, quantize_
    from kiln.llm.fast_decoder import quantize_head_

    if fmt in FORMAT_DTYPES:
        return model.to(FORMAT_DTYPES[fmt])
    blocks = lambda _m, name: name.startswith("layers.")  # noqa: E731
    if fmt == "int8":
        quantize_(model, Int8WeightOnly(), filter_fn=blocks)
    elif fmt.startswith("int4-g"):
        quantize_(model, Int4WeightOnly(group_size=int(fmt[len("int4-g") :])), filter_fn=blocks)
    else:
        raise ValueError(f"kiln cannot store weights as {fmt!r}")
    quantize_head_(model, Int8WeightOnly())
    return model
