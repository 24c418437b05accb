"""``GgufLinear``: a linear layer whose weight is a GGUF tensor's quantized blocks, as stored.

A GGUF file stores a quantized weight row after row as blocks (Q8_0: fp16 scale + 32 int8;
Q4_K / Q5_K / Q6_K: 256-element super-blocks with 6- or 8-bit sub-block scales; ...;
``kiln.kernels.cpu.gguf_blocks`` lists them). The layer keeps exactly those bytes, one
uint8 buffer ``blocks`` (N, K / elems * bytes), plus the ggml type; nothing is converted,
so the values are the file's to the bit and the bytes are the file's size. Its kernel
(``kiln.kernels.registry.gguf_weight_only``) decodes the blocks in registers for a few
rows (decode) and multiplies them with kiln's prefill GEMM for more (prefill).

``activations`` picks the arithmetic (``ACTIVATIONS``), here and in the C++ decode step
(``kiln.llm.fast_decoder``), which reads it from the layer:

* ``"int8"``, the default: x is quantized to 8-bit blocks of 32 (int8 values and one fp32
  scale, max|x| / 127, per block) once per call and each weight block is multiplied by
  integer dot products, scaled in fp32 — llama.cpp's own arithmetic on these files, about
  twice as fast at decode; prefill (more than 16 rows) runs the same arithmetic as a GEMM
  where the CPU has AVX-512 VNNI (``kiln.kernels.cpu.packed_gemm``, 2-2.8x the fp32
  GEMM), in fp32 elsewhere. Each activation moves by at most max|x| / 254 of its block, less
  than the weights' own quantization error; logits differ from the dequantized model's by
  about a percent of their range (the tests state the bounds).
* ``"fp32"``: exact: the weights decoded to fp32 in registers, FMAed with fp32 activations:
  the dequantized model's results up to fp32 rounding.

``set_activations_(model, ...)`` sets every GGUF layer of a model (``kiln generate
--gguf-activations``).

As every ``CompressedLinear``, ``.half()`` / ``.float()`` / ``.to(dtype)`` set the compute
dtype and leave the uint8 blocks (and the fp32 bias) as they are; on the CPU the kernel
takes float32 activations (the output is cast back to the input's dtype).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from kiln.compress.modules import LAYER_KINDS, CompressedLinear, Kernel
from kiln.kernels.cpu.gguf_blocks import (
    ACTIVATIONS,
    BLOCKS,
    DEFAULT_ACTIVATIONS,
    block_shape,
    check_activations,
    check_blocks,
    row_bytes,
)
from kiln.kernels.registry import gguf_dequantize, gguf_weight_only


class GgufLinear(CompressedLinear):
    """A GGUF tensor's blocks: ``blocks`` uint8 (N, K / elems * bytes), ``ggml_type`` the
    ggml type id (``gguf.GGMLQuantizationType``), optional fp32 bias (N,); ``activations``
    the arithmetic (module doc; a runtime choice, not stored in checkpoints)."""

    kind = "gguf"
    blocks: Tensor

    def __init__(
        self, blocks: Tensor, ggml_type: int, in_features: int, bias: Tensor | None,
        activations: str = DEFAULT_ACTIVATIONS,
    ) -> None:  # fmt: skip
        n = check_blocks(blocks, int(ggml_type), in_features)
        super().__init__(in_features, n, bias)
        self.ggml_type = int(ggml_type)
        self._activations = check_activations(activations)
        self.register_buffer("blocks", blocks.contiguous())

    @property
    def activations(self) -> str:
        """``"int8"`` (8-bit activation blocks, the default) or ``"fp32"`` (exact)."""
        return self._activations

    @activations.setter
    def activations(self, value: str) -> None:
        self._activations = check_activations(value)
        self._kernel = None  # built again for the new arithmetic

    @property
    def type_name(self) -> str:
        """The ggml type's name ("Q8_0", "Q6_K", ...)."""
        return BLOCKS[self.ggml_type][0]

    @property
    def block(self) -> int:
        """Elements per block (32, or 256 for the K-quants): ``slice_cols``' granularity."""
        return block_shape(self.ggml_type)[0]

    def meta(self) -> dict[str, Any]:
        return {**super().meta(), "ggml_type": self.ggml_type}

    @classmethod
    def empty(cls, meta: dict[str, Any], has_bias: bool) -> GgufLinear:
        n, k, t = meta["out_features"], meta["in_features"], meta["ggml_type"]
        bias = torch.zeros(n) if has_bias else None
        return cls(torch.zeros(n, row_bytes(t, k), dtype=torch.uint8), t, k, bias)

    def dense_weight(self) -> Tensor:
        return gguf_dequantize(self.blocks, self.ggml_type, self.in_features)  # (N, K)

    def slice_rows(self, start: int, stop: int) -> GgufLinear:
        blocks = self.blocks[start:stop].clone()  # rows are independent runs of blocks
        bias = self._bias_rows(start, stop)
        return self._sliced(
            GgufLinear(blocks, self.ggml_type, self.in_features, bias, self.activations)
        )

    def slice_cols(self, start: int, stop: int) -> GgufLinear:
        elems, nbytes = block_shape(self.ggml_type)
        self._check_cols(start, stop, elems, f"{self.type_name} blocks are {elems} columns wide")
        blocks = self.blocks[:, start // elems * nbytes : stop // elems * nbytes].clone()
        return self._sliced(
            GgufLinear(blocks, self.ggml_type, stop - start, self._bias_all(), self.activations)
        )

    def _kernel_dtype(self) -> torch.dtype:
        # kiln's CPU kernels take float32; elsewhere the dequantized tiles use the compute dtype
        return torch.float32 if self.blocks.is_cpu else self.compute_dtype

    def _build_kernel(self) -> Kernel:
        return gguf_weight_only(self.blocks, self.ggml_type, self.in_features,
                                self._kernel_dtype(), self.activations)  # fmt: skip

    def extra_repr(self) -> str:
        return f"{self.type_name}, {super().extra_repr()}, activations={self.activations}"


def set_activations_(model: nn.Module, activations: str) -> int:
    """Set every ``GgufLinear`` of ``model`` to ``activations`` (``ACTIVATIONS``), in place;
    returns how many layers there are. Build a ``FastDecoder`` after this: it reads the
    choice when it is made."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    layers = [m for m in model.modules() if isinstance(m, GgufLinear)]
    for layer in layers:
        layer.activations = activations
    return len(layers)


LAYER_KINDS[GgufLinear.kind] = GgufLinear  # kiln.compress's __init__ imports this module
