"""INT8 / INT4 weight-only GEMM kernels against an independent float64 dequantize + matmul.

Without a GPU the kernels run through Triton's interpreter (conftest.py), so shapes stay small.
Weights are quantized here by plain round-to-nearest, independently of kiln.compress.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from tests.support.compare import assert_close_to_reference

pytest.importorskip("triton")
from kiln.core.compare import sqnr_db  # noqa: E402
from kiln.kernels.gpu import woq_triton as woq  # noqa: E402  (after the importorskip)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ----------------------------------------------------------------------------------------------
# Round-to-nearest quantizers and a float64 reference, written apart from the kernels' file
# ----------------------------------------------------------------------------------------------


def rtn_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """(N, K) -> int8 codes (N, K), float32 scale (N,); symmetric per row."""
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale.float()


def rtn_int4(w: Tensor, g: int, symmetric: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(N, K) -> packed uint8 (N, K // 2), fp16 scale and offset (N, K // g)."""
    n, k = w.shape
    wg = w.reshape(n, k // g, g)
    if symmetric:  # codes 0..15 stand for -8..7 steps
        scale = (wg.abs().amax(dim=-1) / 7).clamp_min(1e-6).half()
        offset = -8 * scale  # exact in fp16: a power-of-two multiple
    else:  # codes 0..15 span [min, max]
        lo = wg.amin(dim=-1)
        scale = ((wg.amax(dim=-1) - lo) / 15).clamp_min(1e-6).half()
        offset = lo.half()
    codes = torch.round((wg - offset.float()[..., None]) / scale.float()[..., None]).clamp(0, 15)
    q = codes.to(torch.int64).reshape(n, k)
    packed = (q[:, 0::2] + 16 * q[:, 1::2]).to(torch.uint8)
    return packed, scale, offset


def ref_int8(x: Tensor, q: Tensor, scale: Tensor) -> Tensor:
    w = q.double() * scale.double()[:, None]  # (N, K)
    return x.double() @ w.T


def ref_int4(
    x: Tensor,
    packed: Tensor,
    scale: Tensor,
    offset: Tensor,
    g: int,
    w_dtype: torch.dtype | None = None,
) -> Tensor:
    """float64 ``x @ W.T``; W rounded through ``w_dtype`` first when given."""
    n, k = packed.shape[0], 2 * packed.shape[1]
    codes = torch.empty(n, k, dtype=torch.float64, device=packed.device)
    codes[:, 0::2] = (packed.long() % 16).double()
    codes[:, 1::2] = (packed.long() // 16).double()
    group = torch.arange(k, device=packed.device) // g  # (K,) group of each column
    w = codes * scale.double()[:, group] + offset.double()[:, group]  # (N, K)
    if w_dtype is not None:
        w = w.to(w_dtype).double()
    return x.double() @ w.T


def weights(n: int, k: int, device: torch.device, seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen).to(device)


# ----------------------------------------------------------------------------------------------
# Values against the reference
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [32, 48])
@pytest.mark.parametrize("k", [64, 128])
@pytest.mark.parametrize("m", [1, 3, 8, 17])
def test_int8_matches_reference(m: int, k: int, n: int, device: torch.device) -> None:
    q, scale = rtn_int8(weights(n, k, device, seed=m + k + n))
    x = torch.randn(m, k, device=device)
    y = woq.int8_matmul(x, q, scale)
    assert_close_to_reference(y, ref_int8(x, q, scale).float())


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("g", [32, 64])
@pytest.mark.parametrize("n", [32, 48])
@pytest.mark.parametrize("k", [64, 128])
@pytest.mark.parametrize("m", [1, 3, 8, 17])
def test_int4_matches_reference(
    m: int, k: int, n: int, g: int, symmetric: bool, device: torch.device
) -> None:
    packed, scale, offset = rtn_int4(weights(n, k, device, seed=m + k + n + g), g, symmetric)
    x = torch.randn(m, k, device=device)
    y = woq.int4_matmul(x, packed, scale, offset, g)
    assert_close_to_reference(y, ref_int4(x, packed, scale, offset, g).float())


def test_int8_sqnr_on_gaussian_weights(device: torch.device) -> None:
    w = weights(64, 256, device, seed=1)
    x = torch.randn(16, 256, device=device)
    q, scale = rtn_int8(w)
    assert sqnr_db(x.double() @ w.double().T, woq.int8_matmul(x, q, scale)) > 35.0


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_int4_g32_sqnr_on_gaussian_weights(symmetric: bool, device: torch.device) -> None:
    w = weights(64, 256, device, seed=2)
    x = torch.randn(16, 256, device=device)
    packed, scale, offset = rtn_int4(w, 32, symmetric)
    y = woq.int4_matmul(x, packed, scale, offset, 32)
    assert sqnr_db(x.double() @ w.double().T, y) > 18.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_activations_keep_their_dtype(dtype: torch.dtype, device: torch.device) -> None:
    # bf16 takes the reference on the CPU (the interpreter cannot run bf16 dots); GPU: kernel.
    w = weights(48, 128, device, seed=3)
    x = torch.randn(5, 128, device=device).to(dtype)
    q, scale = rtn_int8(w)
    packed, s4, o4 = rtn_int4(w, 32, symmetric=False)
    assert_close_to_reference(woq.int8_matmul(x, q, scale), ref_int8(x, q, scale).to(dtype))
    # INT4 dots the weight rounded to x's dtype, like a dense weight of that dtype would.
    assert_close_to_reference(
        woq.int4_matmul(x, packed, s4, o4, 32), ref_int4(x, packed, s4, o4, 32, dtype).to(dtype)
    )


def test_leading_dims_and_strided_activations(device: torch.device) -> None:
    w = weights(32, 64, device, seed=4)
    q, scale = rtn_int8(w)
    packed, s4, o4 = rtn_int4(w, 64, symmetric=True)
    x = torch.randn(2, 3, 64, device=device)
    xt = torch.randn(64, 5, device=device).T  # (5, 64), column-major
    assert_close_to_reference(woq.int8_matmul(x, q, scale), ref_int8(x, q, scale).float())
    assert_close_to_reference(woq.int8_matmul(xt, q, scale), ref_int8(xt, q, scale).float())
    assert_close_to_reference(
        woq.int4_matmul(xt, packed, s4, o4, 64),
        ref_int4(xt, packed, s4, o4, 64).float(),
    )
    assert woq.int4_matmul(x, packed, s4, o4, 64).shape == (2, 3, 32)


def test_no_rows(device: torch.device) -> None:
    q, scale = rtn_int8(weights(32, 64, device, seed=5))
    y = woq.int8_matmul(torch.empty(0, 64, device=device), q, scale)
    assert y.shape == (0, 32)


@pytest.mark.parametrize(
    "tiles", [woq.Tiles(16, 16, 32), woq.Tiles(32, 16, 64), woq.Tiles(16, 32, 128)], ids=str
)
def test_tilings_cover_tails(tiles: woq.Tiles, device: torch.device) -> None:
    """Several N and M tiles; a K that is no multiple of block_k (INT8) or of the groups per tile
    (INT4: 6 groups of 32 in tiles of 1, 2 or 4 groups)."""
    m, k, n = 19, 200, 40
    w = weights(n, k, device, seed=6)
    x = torch.randn(m, k, device=device)
    q, scale = rtn_int8(w)
    y = torch.full((m, n), float("nan"), device=device)  # every entry must be written
    woq.launch_int8(x, q, scale, y, tiles)
    assert_close_to_reference(y, ref_int8(x, q, scale).float())
    packed, s4, o4 = rtn_int4(w[:, :192], 32, symmetric=False)
    y4 = torch.full((m, n), float("nan"), device=device)
    woq.launch_int4(x[:, :192], packed, s4, o4, 32, y4, tiles)
    assert_close_to_reference(y4, ref_int4(x[:, :192], packed, s4, o4, 32).float())


def test_cpu_fallback_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    w = weights(32, 64, torch.device("cpu"), seed=7)
    x = torch.randn(3, 64)
    q, scale = rtn_int8(w)
    packed, s4, o4 = rtn_int4(w, 32, symmetric=False)
    assert torch.equal(woq.int8_matmul(x, q, scale), woq.int8_matmul_reference(x, q, scale))
    assert torch.equal(
        woq.int4_matmul(x, packed, s4, o4, 32), woq.int4_matmul_reference(x, packed, s4, o4, 32)
    )


def test_reference_dequantizers_follow_the_contract() -> None:
    w = weights(16, 64, torch.device("cpu"), seed=8)
    q, scale = rtn_int8(w)
    assert torch.equal(woq.dequantize_int8(q, scale), q.float() * scale[:, None])
    packed, s4, o4 = rtn_int4(w, 32, symmetric=True)
    eye = torch.eye(64, dtype=torch.float64)
    assert_close_to_reference(
        woq.dequantize_int4(packed, s4, o4, 32).double(), ref_int4(eye, packed, s4, o4, 32).T
    )


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------


def test_int8_rejects_bad_operands() -> None:
    q, scale = rtn_int8(weights(32, 64, torch.device("cpu"), seed=9))
    x = torch.randn(2, 64)
    bad = [
        (x, q.float(), scale, "qweight must be a 2-D int8"),
        (x, q, scale.half(), "scale must be float32"),
        (x, q, scale[:-1], "scale must be float32"),
        (torch.randn(2, 63), q, scale, "x must be"),
        (x.to(torch.int32), q, scale, "x must be float32"),
        (x.to("meta"), q, scale, "is on cpu but x is on meta"),
    ]
    for args in bad:
        with pytest.raises(ValueError, match=args[-1]):
            woq.int8_matmul(*args[:-1])


def test_int4_rejects_bad_operands() -> None:
    packed, s4, o4 = rtn_int4(weights(32, 64, torch.device("cpu"), seed=10), 32, symmetric=True)
    x = torch.randn(2, 64)
    bad = [
        (x, packed, s4, o4, 16, "group_size must be one of"),
        (x, packed, s4, o4, 128, "not a multiple of group_size"),
        (x, packed.to(torch.int8), s4, o4, 32, "packed must be a 2-D uint8"),
        (x, packed, s4.float(), o4, 32, "scale must be float16"),
        (x, packed, s4, o4[:, :1], 32, "offset must be float16"),
        (torch.randn(2, 32), packed, s4, o4, 32, "x must be"),
    ]
    for args in bad:
        with pytest.raises(ValueError, match=args[-1]):
            woq.int4_matmul(*args[:-1])


def test_tiles_must_fit_the_kernels() -> None:
    with pytest.raises(ValueError, match="power of two"):
        woq.Tiles(16, 24, 32)
    with pytest.raises(ValueError, match="power of two"):
        woq.Tiles(8, 16, 32)
    packed, s4, o4 = rtn_int4(weights(32, 128, torch.device("cpu"), seed=11), 64, symmetric=True)
    x, y = torch.randn(2, 128), torch.empty(2, 32)
    with pytest.raises(ValueError, match="not a multiple of 64"):
        woq.launch_int4(x, packed, s4, o4, 64, y, woq.Tiles(16, 16, 32))


@pytest.mark.parametrize("m", [1, 16, 17, 200])
@pytest.mark.parametrize("g", [None, 32, 64, 128])
def test_chosen_tiles_suit_the_kernels(m: int, g: int | None) -> None:
    for k in (64, 128, 576, 4096):
        tiles = woq.choose_tiles(m, k, g)
        assert tiles.block_m >= min(m, 64) or tiles.block_m == 64
        assert g is None or tiles.block_k % g == 0


# ----------------------------------------------------------------------------------------------
# GPU only: the real kernels at SmolLM2 shapes, fp16 / bf16, decode and prefill rows
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 16, 100])
@pytest.mark.parametrize(("k", "n"), [(576, 1536), (1536, 576), (576, 192)])
def test_gpu_smollm_shapes(k: int, n: int, m: int, dtype: torch.dtype) -> None:
    device = torch.device("cuda")
    w = weights(n, k, device, seed=k + n + m) * 0.02
    x = torch.randn(m, k, device=device).to(dtype)
    q, scale = rtn_int8(w)
    assert_close_to_reference(woq.int8_matmul(x, q, scale), ref_int8(x, q, scale).to(dtype))
    for g in (gs for gs in (32, 64, 128) if k % gs == 0):  # 576 = 4.5 x 128
        packed, s4, o4 = rtn_int4(w, g, symmetric=g != 64)
        assert_close_to_reference(
            woq.int4_matmul(x, packed, s4, o4, g), ref_int4(x, packed, s4, o4, g, dtype).to(dtype)
        )
