"""Roofline floor per model: the time its FLOPs and minimal bytes take at peak.

FLOPs come from ``torch.utils.flop_counter.FlopCounterMode`` (matmuls, convs,
attention; pointwise work is not counted) plus a formula for the CPU LSTM
layer kernel (``aten.mkldnn_rnn_layer``), which the counter does not know. Minimal bytes = parameters + buffers +
inputs + outputs, each touched once. Peak numbers come from
``kiln.core.calibrate.load_profile()`` when that exists, else from docs/benchmarks.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from kiln.bench.contenders import flatten_outputs

# docs/benchmarks.md, "This CPU, measured": AVX-512 FMA ~255 GFLOP/s per core (510 for 2
# cores), AVX2 code half of that; ~68 GB/s read bandwidth with 2 threads.
FALLBACK_GFLOPS_AVX512 = 510.0
FALLBACK_GFLOPS_AVX2 = 255.0
FALLBACK_BW_GBS = 68.0


@dataclass(frozen=True)
class Peak:
    """Device peak: ``gflops`` (GFLOP/s), ``bw_gbs`` (GB/s) and where they came from."""

    gflops: float
    bw_gbs: float
    source: str


def device_peak(avx512: bool) -> Peak:
    """Peak from ``kiln.core.calibrate.load_profile()`` (fields ``peak_gflops`` and
    ``mem_bw_gbs``) if importable and usable, else docs/benchmarks.md's figures for
    2 cores with this host's vector width."""
    try:
        from kiln.core.calibrate import load_profile

        prof = load_profile()
        return Peak(
            float(prof.peak_gflops), float(prof.mem_bw_gbs), "kiln.core.calibrate.load_profile()"
        )
    except Exception as e:  # noqa: BLE001 - any failure means "no profile yet"
        why = f"{type(e).__name__}: {e}"[:200]
    gflops = FALLBACK_GFLOPS_AVX512 if avx512 else FALLBACK_GFLOPS_AVX2
    isa = "AVX-512" if avx512 else "AVX2 (half the AVX-512 peak)"
    return Peak(
        gflops, FALLBACK_BW_GBS, f"docs/benchmarks.md figures, {isa}; no kiln profile ({why})"
    )


def _rnn_layer_flops(*args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """2 * tokens * (W_ih + W_hh elements) for one ``aten.mkldnn_rnn_layer`` call.

    On CPU ``aten.lstm`` decomposes into one such call per layer and direction;
    the counter hands over shapes: args[0] is the input (T, B, in) or (B, T, in),
    args[1] and args[2] are W_ih (4H, in) and W_hh (4H, H).
    """
    inp, w_ih, w_hh = args[0], args[1], args[2]
    tokens = int(inp[0]) * int(inp[1])
    return 2 * tokens * (int(w_ih[0]) * int(w_ih[1]) + int(w_hh[0]) * int(w_hh[1]))


def count_flops(model: torch.nn.Module, inputs: tuple[Any, ...]) -> int:
    """FLOPs of one forward call (a multiply-add counts 2)."""
    counter = FlopCounterMode(
        display=False, custom_mapping={torch.ops.aten.mkldnn_rnn_layer: _rnn_layer_flops}
    )
    with counter, torch.inference_mode():
        model(*inputs)
    return int(counter.get_total_flops())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def min_bytes(model: torch.nn.Module, inputs: tuple[Any, ...], outputs: list[torch.Tensor]) -> int:
    """Parameters + buffers + tensor inputs + outputs, each counted once."""
    state = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    total = sum(_nbytes(t) for t in state.values())
    total += sum(_nbytes(t) for t in inputs if isinstance(t, torch.Tensor))
    return total + sum(_nbytes(t) for t in outputs)


def model_roofline(model: torch.nn.Module, inputs: tuple[Any, ...], peak: Peak) -> dict[str, Any]:
    """FLOPs, minimal bytes, output shapes and the floor in ms (max of the compute
    and memory times, i.e. perfect overlap), with which side binds."""
    with torch.inference_mode():
        outputs = flatten_outputs(model(*inputs))
    flops = count_flops(model, inputs)
    nbytes = min_bytes(model, inputs, outputs)
    t_flop = flops / (peak.gflops * 1e9)
    t_mem = nbytes / (peak.bw_gbs * 1e9)
    return {
        "flops": flops,
        "bytes": nbytes,
        "output_shapes": [list(o.shape) for o in outputs],
        "floor_ms": max(t_flop, t_mem) * 1e3,
        "bound": "compute" if t_flop >= t_mem else "memory",
    }
