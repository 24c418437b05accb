"""2:4 semi-structured sparse linear: pattern validation, the dense path, and (GPU) the kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.sparse import SparseSemiStructuredTensor

from kiln.kernels.gpu.sparse24 import is_sparse24, sparse24_linear, sparse24_supported, to_sparse24
from tests.support.compare import assert_close_to_reference

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def pruned(n: int, k: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Tensor:
    """A random (N, K) weight with exactly 2 nonzeros per group of 4 along K, at random spots."""
    w = torch.randn(n, k // 4, 4)
    keep = torch.rand(n, k // 4, 4).argsort(dim=-1) < 2  # 2 random positions per group
    return (w * keep).reshape(n, k).to(device=device, dtype=dtype)


def test_pattern_accepts_two_of_four_or_fewer() -> None:
    w = pruned(8, 32)
    assert is_sparse24(w)
    w[:, :4] = 0  # fewer nonzeros is still 2:4
    assert is_sparse24(w)
    assert is_sparse24(torch.zeros(4, 8))


def test_pattern_rejects_three_of_four() -> None:
    w = pruned(8, 32)
    w[3, 20:23] = 1.0  # 3 nonzeros in group 5 of row 3
    assert not is_sparse24(w)
    with pytest.raises(ValueError, match=r"row 3, columns 20\.\.23"):
        to_sparse24(w)


def test_pattern_needs_2d_and_k_multiple_of_4() -> None:
    assert not is_sparse24(torch.zeros(8, 6))
    with pytest.raises(ValueError, match="K % 4 == 0"):
        to_sparse24(torch.zeros(8, 6))
    with pytest.raises(ValueError, match="K % 4 == 0"):
        to_sparse24(torch.zeros(16))


def test_not_supported_off_the_gpu() -> None:
    assert not sparse24_supported(torch.device("cpu"), torch.float16)
    if not torch.cuda.is_available():
        assert not sparse24_supported(torch.device("cuda"), torch.float16)


def test_cpu_weight_stays_dense() -> None:
    w = pruned(16, 64)
    ws = to_sparse24(w)
    assert not isinstance(ws, SparseSemiStructuredTensor)
    assert torch.equal(ws, w)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("lead", [(5,), (2, 3), ()])
def test_dense_path_equals_linear(lead: tuple[int, ...], bias: bool) -> None:
    w = to_sparse24(pruned(24, 32))
    b = torch.randn(24) if bias else None
    x = torch.randn(*lead, 32)
    assert torch.equal(sparse24_linear(x, w, b), F.linear(x, w, b))


def test_dense_path_computes_in_the_weight_dtype() -> None:
    w = pruned(16, 32, torch.bfloat16)
    x = torch.randn(3, 32)
    y = sparse24_linear(x, w)
    assert y.dtype == torch.float32
    assert torch.equal(y, F.linear(x.bfloat16(), w).float())


def test_linear_rejects_bad_operands() -> None:
    w = pruned(16, 32)
    with pytest.raises(ValueError, match=r"x must be \(\.\.\., 32\)"):
        sparse24_linear(torch.randn(2, 16), w)
    with pytest.raises(ValueError, match="bias must be"):
        sparse24_linear(torch.randn(2, 32), w, torch.randn(8))
    with pytest.raises(ValueError, match="weight must be"):
        sparse24_linear(torch.randn(2, 32), w[0])
    with pytest.raises(ValueError, match="on meta but the weight is on cpu"):
        sparse24_linear(torch.randn(2, 32, device="meta"), w)


# ----------------------------------------------------------------------------------------------
# GPU only: torch's semi-structured kernel
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5, 16, 33])
@pytest.mark.parametrize(("n", "k"), [(576, 576), (192, 576), (576, 1536)])
def test_gpu_semi_structured_matches_dense(n: int, k: int, m: int, dtype: torch.dtype) -> None:
    device = torch.device("cuda")
    if not sparse24_supported(device, dtype):
        pytest.skip(f"no semi-structured sparse kernel for {dtype} on this GPU / torch")
    w = pruned(n, k, dtype, "cuda")
    ws = to_sparse24(w)
    assert isinstance(ws, SparseSemiStructuredTensor)
    b = torch.randn(n, device=device)
    for x in (torch.randn(m, k, device=device, dtype=dtype), torch.randn(2, m, k, device=device)):
        expected = F.linear(x.to(dtype), w, b.to(dtype)).to(x.dtype)
        assert_close_to_reference(sparse24_linear(x, ws, b), expected, rtol_to_max=2e-3)


@pytest.mark.gpu
@gpu
def test_gpu_unsupported_shape_stays_dense() -> None:
    w = pruned(8, 16, torch.float16, "cuda")  # below every backend's minimum block
    assert not sparse24_supported(w.device, w.dtype, (8, 16))
    ws = to_sparse24(w)
    assert not isinstance(ws, SparseSemiStructuredTensor)
    x = torch.randn(3, 16, device="cuda", dtype=torch.float16)
    assert torch.equal(sparse24_linear(x, ws), F.linear(x, w))
