"""kiln.kernels.registry: the public weight-only matmul API, its reference and its validation.

Every kernel is compared with ``F.linear(x, dequantize_...(...))`` in float32; the
dequantizers themselves are checked against a per-element reading of the format. Lossy
quality is judged by SQNR against the unquantized fp32 layer (round-to-nearest weights).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.core.compare import sqnr_db
from kiln.kernels.formats import dequantize_int4, dequantize_int8
from kiln.kernels.registry import int4_weight_only, int8_weight_only
from tests.support.compare import assert_close_to_reference

# The kernels sum K products in another order (and INT8 applies the channel scale after
# the sum), so they differ from F.linear by a few float32 ulps of the largest output.
RTOL = 2e-5
ROWS = range(1, 10)


def _int8_weights(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    return q, torch.rand(n, generator=gen) * 0.02 + 1e-3


def _int4_weights(
    n: int, k: int, g: int, symmetric: bool, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(n, k // g, generator=gen) * 0.02 + 1e-3).half()
    if symmetric:
        offset = (-8 * scale.float()).half()
    else:
        offset = (torch.randn(n, k // g, generator=gen) * 0.1).half()
    return packed, scale, offset


# ------------------------------------------------------------------ reference
def test_dequantize_int8_reads_the_format() -> None:
    q, s = _int8_weights(3, 5)
    w = dequantize_int8(q, s)
    for n in range(3):
        for k in range(5):
            assert w[n, k].item() == pytest.approx(int(q[n, k]) * float(s[n]), rel=1e-6)
    assert w.dtype == torch.float32


@pytest.mark.parametrize("symmetric", [True, False])
def test_dequantize_int4_reads_the_format(symmetric: bool) -> None:
    packed, scale, offset = _int4_weights(3, 64, 32, symmetric)
    w = dequantize_int4(packed, scale, offset, 32)
    assert w.shape == (3, 64) and w.dtype == torch.float32
    for n in range(3):
        for k in range(64):
            byte = int(packed[n, k // 2])
            code = byte & 15 if k % 2 == 0 else byte >> 4
            want = code * float(scale[n, k // 32]) + float(offset[n, k // 32])
            assert w[n, k].item() == pytest.approx(want, rel=1e-6, abs=1e-7)


# ------------------------------------------------------------------ kernels vs reference
@pytest.mark.parametrize("n,k", [(64, 96), (40, 37), (192, 576)])
def test_int8_kernel_matches_dequantize_linear(n: int, k: int) -> None:
    q, s = _int8_weights(n, k)
    kernel = int8_weight_only(q, s)
    w = dequantize_int8(q, s)
    for m in ROWS:
        x = torch.randn(m, k)
        assert_close_to_reference(kernel(x), F.linear(x, w), rtol_to_max=RTOL)


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("n,k", [(48, 256), (20, 384)])
def test_int4_kernel_matches_dequantize_linear(n: int, k: int, g: int, symmetric: bool) -> None:
    packed, scale, offset = _int4_weights(n, k, g, symmetric)
    kernel = int4_weight_only(packed, scale, offset, g)
    w = dequantize_int4(packed, scale, offset, g)
    for m in ROWS:
        x = torch.randn(m, k)
        assert_close_to_reference(kernel(x), F.linear(x, w), rtol_to_max=RTOL)


def test_leading_dims_and_strided_input() -> None:
    q, s = _int8_weights(24, 32)
    kernel = int8_weight_only(q, s)
    x = torch.randn(2, 3, 64)[..., ::2]  # (2, 3, 32), not contiguous
    assert_close_to_reference(kernel(x), F.linear(x, dequantize_int8(q, s)), rtol_to_max=RTOL)
    assert kernel(torch.randn(0, 32)).shape == (0, 24)


# ------------------------------------------------------------------ quality (SQNR)
def test_int8_sqnr_on_gaussian_weights() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(256, 576, generator=gen)
    scale = w.abs().amax(dim=1) / 127  # (N,)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    x = torch.randn(8, 576, generator=gen)
    assert sqnr_db(F.linear(x, w), int8_weight_only(q, scale)(x)) > 35


def test_int4_g32_sqnr_on_gaussian_weights() -> None:
    gen = torch.Generator().manual_seed(2)
    n, k, g = 256, 576, 32
    w = torch.randn(n, k, generator=gen)
    groups = w.view(n, k // g, g)
    lo, hi = groups.amin(dim=2), groups.amax(dim=2)  # (N, G)
    scale, offset = ((hi - lo) / 15).half(), lo.half()  # asymmetric: offset = group minimum
    codes = torch.round((groups - offset.float()[..., None]) / scale.float()[..., None])
    codes = codes.clamp(0, 15).to(torch.uint8).view(n, k)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # (N, K // 2)
    x = torch.randn(8, k, generator=gen)
    assert sqnr_db(F.linear(x, w), int4_weight_only(packed, scale, offset, g)(x)) > 18


# ------------------------------------------------------------------ validation
def test_int8_rejects_malformed_weights() -> None:
    q, s = _int8_weights(8, 16)
    with pytest.raises(ValueError, match="qweight must be a 2-D int8"):
        int8_weight_only(q.to(torch.int16), s)
    with pytest.raises(ValueError, match="qweight must be a 2-D int8"):
        int8_weight_only(q[0], s)
    with pytest.raises(ValueError, match="scale must be float32"):
        int8_weight_only(q, s.half())
    with pytest.raises(ValueError, match=r"scale must be float32 of shape \(8,\)"):
        int8_weight_only(q, s[:4])
    with pytest.raises(ValueError, match="non-empty"):
        int8_weight_only(q[:0], s[:0])
    with pytest.raises(ValueError, match="run on cpu or cuda"):
        int8_weight_only(q.to("meta"), s.to("meta"))
    with pytest.raises(ValueError, match="is on"):
        int8_weight_only(q, s.to("meta"))


def test_int4_rejects_malformed_weights() -> None:
    packed, scale, offset = _int4_weights(8, 64, 32, symmetric=False)
    with pytest.raises(ValueError, match="packed must be a 2-D uint8"):
        int4_weight_only(packed.to(torch.int8), scale, offset, 32)
    with pytest.raises(ValueError, match="group_size must be one of"):
        int4_weight_only(packed, scale, offset, 16)
    with pytest.raises(ValueError, match="group_size must be one of"):
        int4_weight_only(packed, scale, offset, 32.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        int4_weight_only(packed[:, :16], scale, offset, 64)  # K = 32
    with pytest.raises(ValueError, match="scale must be float16"):
        int4_weight_only(packed, scale.float(), offset, 32)
    with pytest.raises(ValueError, match="offset must be float16 of shape"):
        int4_weight_only(packed, scale, offset[:, :1], 32)
    with pytest.raises(ValueError, match="run on cpu or cuda"):
        int4_weight_only(packed.to("meta"), scale.to("meta"), offset.to("meta"), 32)


def test_kernel_rejects_bad_activations() -> None:
    q, s = _int8_weights(8, 16)
    kernel = int8_weight_only(q, s)
    with pytest.raises(ValueError, match="x must be float32"):
        kernel(torch.randn(2, 16).double())
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., 16\)"):
        kernel(torch.randn(2, 15))
    with pytest.raises(ValueError, match=r"x must have shape"):
        kernel(torch.tensor(1.0))
    with pytest.raises(ValueError, match="x is on meta"):
        kernel(torch.randn(2, 16, device="meta"))


# ------------------------------------------------------------------ CUDA dispatch
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 4, 9])
def test_cuda_weights_dispatch_to_the_gpu_kernels(m: int) -> None:
    pytest.importorskip("kiln.kernels.gpu.woq_triton")
    q, s = _int8_weights(64, 128)
    packed, scale, offset = _int4_weights(64, 128, 64, symmetric=False)
    x = torch.randn(m, 128)
    y8 = int8_weight_only(q.cuda(), s.cuda())(x.cuda())
    y4 = int4_weight_only(packed.cuda(), scale.cuda(), offset.cuda(), 64)(x.cuda())
    # fp32 products in the GPU kernels ("ieee" dots), summed in their own tile order and
    # per-group path: a few ulps of the largest output, as on the CPU.
    assert_close_to_reference(y8.cpu(), F.linear(x, dequantize_int8(q, s)), rtol_to_max=5e-5)
    want4 = F.linear(x, dequantize_int4(packed, scale, offset, 64))
    assert_close_to_reference(y4.cpu(), want4, rtol_to_max=5e-5)
