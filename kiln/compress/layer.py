"""One linear layer + one config -> its compressed replacement.

The model-level verbs, the sensitivity analysis and the planner all go through
``compress_linear``, which asks the registry (``methods.py``) how the config's method
compresses a weight.
"""

from __future__ import annotations

from torch import Tensor, nn

from kiln.compress.configs import CompressionConfig
from kiln.compress.methods import method_of
from kiln.compress.modules import CompressedLinear
from kiln.compress.obs import Moment


def compress_linear(
    layer: nn.Linear, config: CompressionConfig, h: Moment | None = None
) -> CompressedLinear:
    """Compress ``layer``; ``h`` is its inputs' second moment (K, K), needed by the
    calibration-aware methods (GPTQ, SparseGPT, activation-aware low rank)."""
    method = method_of(config)
    if method.needs_calibration(config) and h is None:
        raise ValueError(f"{config.name} needs calibration data (the layer's input statistics)")
    w = layer.weight.detach().float().cpu()  # (N, K)
    bias = None if layer.bias is None else layer.bias.detach().float().cpu()
    out = method.compress(w, bias, config, h)
    return out.to(layer.weight.device)


def weight_error(layer: nn.Linear, compressed: CompressedLinear) -> Tensor:
    """Delta W = W_compressed - W: (N, K) fp32 on the CPU."""
    return compressed.dense_weight().cpu() - layer.weight.detach().float().cpu()
