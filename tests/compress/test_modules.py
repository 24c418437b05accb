"""Compressed layers: forward = dense weight, row slicing, byte counts, group fallback."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.compress.configs import Int4WeightOnly, Int8WeightOnly, LowRank, SemiStructured24
from kiln.compress.layer import compress_linear
from kiln.compress.methods import effective_group_size
from kiln.compress.modules import Sparse24Linear
from tests.support.compare import assert_close_to_reference

CONFIGS = [Int8WeightOnly(), Int4WeightOnly(group_size=64), SemiStructured24(), LowRank(rank=8)]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_forward_matches_dense_weight(config, rows: int) -> None:
    torch.manual_seed(rows)
    layer = nn.Linear(128, 96)
    q = compress_linear(layer, config)
    x = torch.randn(rows, 128)
    expected = x @ q.dense_weight().T + layer.bias.detach()
    with torch.no_grad():
        assert_close_to_reference(q(x), expected, rtol_to_max=2e-5)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_slice_rows(config) -> None:
    torch.manual_seed(0)
    q = compress_linear(nn.Linear(128, 96), config)
    part = q.slice_rows(16, 48)
    assert part.out_features == 32 and part.in_features == 128
    assert torch.equal(part.dense_weight(), q.dense_weight()[16:48])
    assert part.bias is not None and q.bias is not None
    assert torch.equal(part.bias, q.bias[16:48])
    whole = {t.untyped_storage().data_ptr() for t in q.buffers()}
    assert not whole & {t.untyped_storage().data_ptr() for t in part.buffers()}  # own storage


def test_group_size_falls_back_to_a_divisor() -> None:
    assert effective_group_size(576, 128) == 64  # SmolLM2's hidden size: 4.5 x 128
    assert effective_group_size(1536, 128) == 128
    assert effective_group_size(96, 128) == 32
    with pytest.raises(ValueError):
        effective_group_size(48, 128)
    q = compress_linear(nn.Linear(576, 8), Int4WeightOnly(group_size=128))
    assert q.meta()["group_size"] == 64


def test_sparse24_storage_and_pattern() -> None:
    w = torch.tensor([[0.0, 2.0, 0.0, -1.0, 3.0, 0.0, 0.0, 0.0]])
    layer = Sparse24Linear.from_dense(w, None)
    assert torch.equal(layer.dense_weight(), w)
    assert layer.nbytes() == 4 * 4 + 1  # 4 kept fp32 values, 2 groups' positions in 1 byte
    with pytest.raises(ValueError, match="not 2:4 sparse"):
        Sparse24Linear.from_dense(torch.ones(1, 8), None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_cuda_forward_matches_cpu(config, rows: int) -> None:
    """Moved to a GPU, a compressed layer runs its CUDA kernel (Triton for INT8/INT4) and
    must agree with the CPU result."""
    torch.manual_seed(rows)
    q = compress_linear(nn.Linear(256, 192), config)
    x = torch.randn(rows, 256)
    with torch.no_grad():
        expected = q(x)
        q_gpu = q.to("cuda")
        assert_close_to_reference(q_gpu(x.cuda()).cpu(), expected, rtol_to_max=1e-4)
