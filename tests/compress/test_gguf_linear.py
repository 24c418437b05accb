"""GgufLinear: a GGUF tensor's blocks as a layer — its forward (kernel rows and tiles)
against the dequantized weight, dtype-keeping casts and moves, slices at block
boundaries, and a state_dict round trip through the layer-kind registry. The layers here
run the exact path (``activations="fp32"``); the default 8-bit activations are checked in
tests/kernels/cpu/test_gguf_blocks.py and tests/models/test_gguf_packed.py."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kiln.compress.gguf_linear import GgufLinear
from kiln.compress.modules import LAYER_KINDS
from kiln.kernels.cpu import gguf_blocks as gb
from tests.support.compare import assert_close_to_reference
from tests.support.gguf_quants import quantize

Q = gguf.GGMLQuantizationType
RTOL = 2e-5


def _layer(kind: Q, n: int = 40, k: int = 512, bias: bool = True) -> GgufLinear:
    w = np.random.default_rng(int(kind)).normal(0, 0.2, size=(n, k))
    b = torch.randn(n) if bias else None
    return GgufLinear(torch.from_numpy(quantize(w, kind)), int(kind), k, b, activations="fp32")


@pytest.mark.parametrize("kind", [Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_forward_matches_the_dequantized_weight(kind: Q) -> None:
    layer = _layer(kind)
    w = torch.from_numpy(gguf.quants.dequantize(layer.blocks.numpy(), kind))
    assert torch.equal(layer.dense_weight(), w)
    assert layer.nbytes() == layer.blocks.numel() + 4 * 40  # the file's bytes + fp32 bias
    for rows in (1, 3, gb.KILN_MAX_ROWS + 1):  # C++ kernel, then dequantized tiles
        x = torch.randn(2, rows, 512)
        assert_close_to_reference(layer(x), F.linear(x, w, layer.bias), rtol_to_max=RTOL)


def test_casts_keep_the_blocks_and_set_the_compute_dtype() -> None:
    layer = _layer(Q.Q5_K)
    blocks = layer.blocks.clone()
    x = torch.randn(3, 512)
    want = layer(x)
    for cast, dtype in (("half", torch.float16), ("bfloat16", torch.bfloat16),
                        ("double", torch.float64), ("float", torch.float32)):  # fmt: skip
        getattr(layer, cast)()
        assert layer.compute_dtype == dtype
        assert layer.blocks.dtype == torch.uint8 and torch.equal(layer.blocks, blocks)
        assert layer.bias is not None and layer.bias.dtype == torch.float32
        y = layer(x.to(dtype))
        assert y.dtype == dtype
        assert_close_to_reference(
            y.float(), want, rtol_to_max=1e-2 if dtype.itemsize == 2 else RTOL
        )
    layer.to("cpu", torch.float16)
    assert (layer.compute_dtype, layer.blocks.dtype) == (torch.float16, torch.uint8)


def test_slices_at_block_boundaries() -> None:
    layer = _layer(Q.Q4_K, n=24, k=768)
    w, x = layer.dense_weight(), torch.randn(2, 768)
    rows = layer.slice_rows(5, 17)
    assert_close_to_reference(rows(x), F.linear(x, w[5:17], layer.bias[5:17]), rtol_to_max=RTOL)
    cols = layer.slice_cols(256, 768)  # super-blocks are 256 columns wide
    assert_close_to_reference(cols(x[:, 256:]), F.linear(x[:, 256:], w[:, 256:], layer.bias),
                              rtol_to_max=RTOL)  # fmt: skip
    with pytest.raises(ValueError, match="Q4_K blocks are 256 columns wide"):
        layer.slice_cols(0, 300)


def test_state_dict_round_trip_through_the_registry() -> None:
    layer = _layer(Q.Q5_0, bias=False)
    assert LAYER_KINDS["gguf"] is GgufLinear
    empty = LAYER_KINDS["gguf"].empty(layer.meta(), has_bias=False)
    empty.load_state_dict(layer.state_dict())
    assert empty.activations == "int8"  # a runtime choice, not stored: the default
    empty.activations = layer.activations
    x = torch.randn(1, 512)
    assert torch.equal(empty(x), layer(x))
    assert "Q5_0" in repr(empty)


def test_malformed_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match=r"uint8 \(N, 34\)"):
        GgufLinear(torch.zeros(4, 33, dtype=torch.uint8), int(Q.Q8_0), 32, None)
    with pytest.raises(ValueError, match="no kiln block kernel"):
        GgufLinear(torch.zeros(4, 84, dtype=torch.uint8), int(Q.Q2_K), 256, None)
