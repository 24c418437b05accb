"""kiln.kernels.cpu.packed_gemm: the prefill GEMM on packed weights (INT4 panels, INT8
panels, GGUF blocks), AVX-512 and AVX2 builds, against ``x @ dequant(W).T`` at fp32
tolerance (``kiln.core.compare.compare``) with ragged M / N / K; thread-count independence,
the k passes of a wide K, argument checks and the layers' dispatch to it."""

from __future__ import annotations

import gguf
import pytest
import torch
import torch.nn.functional as F

from kiln.compress.modules import Int4Linear, Int8Linear
from kiln.core import native
from kiln.core.compare import compare
from kiln.kernels.cpu import gguf_blocks as gb
from kiln.kernels.cpu import packed_gemm as pg
from kiln.kernels.formats import dequantize_int4, dequantize_int8
from tests.support.compare import assert_close_to_reference
from tests.support.gguf_quants import q8_reference, random_blocks
from tests.support.threads import at_one_and_many_threads

Q = gguf.GGMLQuantizationType
ISAS = ["avx512", "avx2"] if native.isa() == "avx512" else ["avx2"]
RTOL = 2e-5  # another summation order than MKL's: a few fp32 ulps of the largest output
# One row, a partial micro-kernel, a whole one (6 / 12) plus change, more than a block of
# rows on both ISAs (96 / 192 rows).
ROWS = (1, 7, 29, 197)
# The 8-bit GEMM against the float64 product of the same int8 activations: its fp32 sums
# of exact per-block integer dots (measured <= 3e-7 of the largest output).
RTOL_Q8 = 2e-6
GGUF_TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    verdict = compare(y, F.linear(x, w), RTOL)
    assert verdict.ok, verdict.detail


def _int4(n: int, k: int, g: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(n, k // g, generator=gen) * 0.02 + 1e-3).half()
    offset = (torch.randn(n, k // g, generator=gen) * 0.1).half()
    return packed, scale, offset


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n,k,g", [(37, 96, 32), (72, 128, 64), (13, 256, 128)])
def test_int4_matches_dequantized_weight(isa: str, n: int, k: int, g: int) -> None:
    packed, scale, offset = _int4(n, k, g, seed=n)
    kernel = pg.Int4Gemm(packed, scale, offset, g, isa=isa)
    w = dequantize_int4(packed, scale, offset, g)
    for m in ROWS:
        x = torch.randn(m, k)
        _check(kernel(x), x, w)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n,k", [(37, 45), (50, 64)])
def test_int8_matches_dequantized_weight(isa: str, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    s = torch.rand(n, generator=gen) * 0.02 + 1e-3
    kernel = pg.Int8Gemm(q, s, isa=isa)
    w = dequantize_int8(q, s)
    for m in ROWS:
        x = torch.randn(m, k)
        _check(kernel(x), x, w)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", GGUF_TYPES, ids=lambda t: t.name)
def test_gguf_matches_dequantized_weight(isa: str, kind: Q) -> None:
    k = 512 if gguf.GGML_QUANT_SIZES[kind][0] == 256 else 96
    raw = torch.from_numpy(random_blocks(kind, 37, k, seed=int(kind)))  # ragged N
    kernel = pg.GgufGemm(raw, int(kind), k, isa=isa)
    w = gb.reference_dequantize(raw, int(kind), k)
    for m in (1, 7, 29):
        x = torch.randn(m, k)
        _check(kernel(x), x, w)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", GGUF_TYPES, ids=lambda t: t.name)
def test_gguf_int8_matches_the_8bit_reference(isa: str, kind: Q) -> None:
    """activations="int8": x quantized to 8-bit blocks, integer dots (VNNI, or maddubs:
    Q8_0's signed codes through the sign trick) against the codes, the offsets / mins /
    sub-block scales of every type; ragged N over two tiles and a partial one, M across
    partial micro-kernels and blocks of rows."""
    k = 512 if gguf.GGML_QUANT_SIZES[kind][0] == 256 else 96
    raw = torch.from_numpy(random_blocks(kind, 70, k, seed=int(kind)))
    kernel = pg.GgufGemm(raw, int(kind), k, isa=isa, activations="int8")
    assert kernel.activations == "int8"
    w = gb.reference_dequantize(raw, int(kind), k)
    for m in ROWS:
        x = torch.randn(m, k) * torch.rand(m, 1) * 4  # rows of different scales
        want = torch.from_numpy(q8_reference(x.numpy(), w.numpy())[0])
        assert_close_to_reference(kernel(x).double(), want, rtol_to_max=RTOL_Q8)


def test_gguf_int8_agrees_with_the_decode_kernels_and_thread_counts() -> None:
    """The prefill GEMM and the decode kernels compute one arithmetic (fp32 rounding apart);
    one thread and two give the same bits."""
    raw = torch.from_numpy(random_blocks(Q.Q4_0, 576, 576, seed=5))
    kernel = pg.GgufGemm(raw, int(Q.Q4_0), 576, activations="int8")
    x = torch.randn(40, 576)
    decode = gb.gguf_matmul(x, raw, int(Q.Q4_0), activations="int8")
    assert_close_to_reference(kernel(x), decode, rtol_to_max=RTOL_Q8)
    one, many = at_one_and_many_threads(lambda: kernel(x))
    assert torch.equal(one, many)


@pytest.mark.parametrize("isa", ISAS)
def test_wide_k_runs_in_passes_and_leading_dims_are_kept(isa: str) -> None:
    """K = 2560 > kBlockK (2048): the second pass continues the sum from y."""
    packed, scale, offset = _int4(40, 2560, 32)
    kernel = pg.Int4Gemm(packed, scale, offset, 32, isa=isa)
    x = torch.randn(2, 7, 2560)
    _check(kernel(x), x, dequantize_int4(packed, scale, offset, 32))
    assert kernel(torch.randn(0, 2560)).shape == (0, 40)


def test_results_do_not_depend_on_the_thread_count() -> None:
    packed, scale, offset = _int4(576, 576, 32)
    kernel = pg.Int4Gemm(packed, scale, offset, 32)
    x = torch.randn(40, 576)
    one, many = at_one_and_many_threads(lambda: kernel(x))
    assert torch.equal(one, many)  # each output summed by one thread in a fixed order


def test_arguments_are_checked() -> None:
    raw = torch.from_numpy(random_blocks(Q.Q8_0, 4, 64))
    with pytest.raises(ValueError, match="no kiln block kernel"):
        pg.GgufGemm(raw, 1, 64)  # F16: not a block type
    with pytest.raises(ValueError, match=r"\(N, K / 32 \* 34\)"):
        pg.GgufGemm(raw[:, :34], int(Q.Q8_0), 64)
    with pytest.raises(ValueError, match="activations"):
        pg.GgufGemm(raw, int(Q.Q8_0), 64, activations="int4")
    packed, scale, offset = _int4(8, 64, 32)
    kernel = pg.Int4Gemm(packed, scale, offset, 32)
    with pytest.raises(ValueError, match="float32 CPU tensor"):
        kernel(torch.randn(3, 63))
    with pytest.raises(ValueError, match="isa"):
        pg.load_extension("sse2")


def test_layers_use_it_for_prefill_rows() -> None:
    """Int4Linear / Int8Linear forward: the decode kernel up to KILN_MAX_ROWS rows, the GEMM
    above; both match the dense weight."""
    packed, scale, offset = _int4(48, 128, 32)
    bias = torch.randn(48)
    layers = [Int4Linear(packed, scale, offset, 32, bias),
              Int8Linear(torch.randint(-127, 128, (48, 128), dtype=torch.int8),
                         torch.rand(48) * 0.01, bias)]  # fmt: skip
    for layer in layers:
        x = torch.randn(1, pg.GEMM_MIN_ROWS + 3, 128)
        want = F.linear(x, layer.dense_weight(), bias)
        verdict = compare(layer(x), want, RTOL)
        assert verdict.ok, verdict.detail
        assert layer._kernel is not None
        assert layer._kernel.backend(pg.GEMM_MIN_ROWS) == "gemm"  # type: ignore[attr-defined]
        assert layer._kernel.backend(pg.GEMM_MIN_ROWS - 1) == "kiln"  # type: ignore[attr-defined]
