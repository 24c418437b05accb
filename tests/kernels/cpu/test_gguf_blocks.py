"""kiln.kernels.cpu.gguf_blocks: the C++ block kernels (AVX-512 and AVX2 builds) and the
pure-torch reference dequantizer against the gguf package's ``dequantize``, per type, on
random valid blocks and on blocks quantized from real-valued weights: the exact kernels
(fp32 activations) against F.linear; the 8-bit-activation kernels (integer dot products:
VNNI in the AVX-512 build on a CPU with it, maddubs in the AVX2 build) against a NumPy
reference that quantizes x the same way and multiplies in float64, and against the
analytic bound of their deviation from the exact product; the row dispatch (kernel /
prefill GEMM / tiles), the fallback without a compiler, argument checks and the build
cache. (The prefill GEMM itself: test_packed_gemm.py.)"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kiln.core import native
from kiln.kernels.cpu import gguf_blocks as gb
from kiln.kernels.cpu import packed_gemm as pg
from tests.support.compare import assert_close_to_reference
from tests.support.gguf_quants import q8_activations, q8_reference, quantize, random_blocks
from tests.support.native import quoted_includes
from tests.support.threads import at_one_and_many_threads

Q = gguf.GGMLQuantizationType
TYPES = [Q.Q8_0, Q.Q6_K, Q.Q4_K, Q.Q5_K, Q.Q5_0, Q.Q5_1, Q.Q4_0, Q.Q4_1]
# Both vector paths: this CPU's, and AVX2 built with -mno-avx512f on an AVX-512 CPU.
ISAS = ["avx512", "avx2"] if native.isa() == "avx512" else ["avx2"]
RTOL = 2e-5  # fp32 sums in another order than MKL's: a few ulps of the largest output
# 8-bit path vs the float64 reference on the same int8 activations: the kernel's fp32
# products and sums (measured <= 4e-7 of the largest output)
RTOL_Q8 = 2e-6
ROWS = (1, 3, 17)  # one row, a partial register block, more than two chunks of 8


def _gguf_values(raw: np.ndarray, kind: Q) -> torch.Tensor:
    """The independent reference: the gguf package's dequantizer, float32 (N, K)."""
    return torch.from_numpy(gguf.quants.dequantize(raw, kind).astype(np.float32))


def _k(kind: Q) -> int:
    return 512 if gguf.GGML_QUANT_SIZES[kind][0] == 256 else 96  # 2 super-blocks / 3 blocks


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
def test_kernel_matches_reference_on_random_blocks(kind: Q, isa: str) -> None:
    """Both arithmetics: fp32 activations against F.linear on the same values; 8-bit
    activations against the reference quantizing x the same way (tight), and within the
    analytic bound of the exact product."""
    n, k = 37, _k(kind)  # ragged N: no multiple of any block height
    raw = random_blocks(kind, n, k, seed=int(kind))
    w = _gguf_values(raw, kind)
    blocks = torch.from_numpy(raw)
    gen = torch.Generator().manual_seed(0)
    for m in ROWS:
        x = torch.randn(m, k, generator=gen)
        exact = F.linear(x, w)
        got = gb.gguf_matmul(x, blocks, int(kind), isa, activations="fp32")
        assert_close_to_reference(got, exact, rtol_to_max=RTOL)
        want, bound = q8_reference(x.numpy(), w.numpy())
        got = gb.gguf_matmul(x, blocks, int(kind), isa, activations="int8")
        assert_close_to_reference(got.double(), torch.from_numpy(want), rtol_to_max=RTOL_Q8)
        slack = RTOL_Q8 * float(np.abs(want).max())
        assert bool(((got - exact).abs().double() <= torch.from_numpy(bound) + slack).all())
    assert torch.equal(gb.dequantize_rows(blocks, int(kind), k, isa), w)  # same values exactly


@pytest.mark.parametrize("isa", ISAS)
def test_activation_blocks_follow_their_definition(isa: str) -> None:
    """The C++ quantizer gives ``q8_activations``' int8 values and scales to the bit: random
    rows, values at the half steps (ties round to even), an all-zero block, a block whose
    max is negative; a block holding inf or NaN gets a NaN scale, so its row's outputs are
    NaN (as the exact path's), the other rows untouched."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, 128, generator=gen) * torch.tensor([1e-3, 1.0, 30.0, 1e4, 1.0])[:, None]
    x[1, :32] = torch.arange(32) - 15.5  # max 16.5: steps of 16.5 / 127
    x[2, 32:64] = 0.0
    x[3, 64:96] = -x[3, 64:96].abs()
    q, d = gb.quantize_activations(x, isa)
    want_q, want_d = q8_activations(x.numpy())
    assert np.array_equal(q.numpy(), want_q) and np.array_equal(d.numpy(), want_d)
    assert int(q[2, 32:64].abs().sum()) == 0 and float(d[2, 1]) == 0.0
    raw = torch.from_numpy(random_blocks(Q.Q4_K, 8, 256))
    bad = torch.randn(3, 256, generator=gen)
    bad[1, 40] = float("inf")
    y = gb.gguf_matmul(bad, raw, int(Q.Q4_K), isa, activations="int8")
    assert bool(y[1].isnan().all()) and bool(y[[0, 2]].isfinite().all())
    assert gb.load_extension(isa).dot_isa() in ("avx512_vnni", "avx_vnni", "avx2")


@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
def test_reference_dequantizer_is_exact(kind: Q) -> None:
    """From random blocks and from blocks quantized from weights (the gguf package's
    quantizer where it has one): the torch reference gives gguf's values to the bit."""
    k = _k(kind)
    weights = np.random.default_rng(1).normal(0, 0.2, size=(5, k)).astype(np.float32)
    for raw in (random_blocks(kind, 7, k, seed=3), quantize(weights, kind)):
        got = gb.reference_dequantize(torch.from_numpy(raw), int(kind), k)
        assert torch.equal(got, _gguf_values(raw, kind))


@pytest.mark.parametrize("activations", gb.ACTIVATIONS)
@pytest.mark.parametrize("kind", [Q.Q8_0, Q.Q6_K], ids=lambda t: t.name)
def test_kernel_on_quantized_weights(kind: Q, activations: str) -> None:
    """Realistic blocks (quantized from N(0, 0.2) weights), one thread and two."""
    raw = quantize(np.random.default_rng(2).normal(0, 0.2, size=(300, 512)), kind)
    w, blocks = _gguf_values(raw, kind), torch.from_numpy(raw)
    x = torch.randn(3, 512)
    one, two = at_one_and_many_threads(
        lambda: gb.gguf_matmul(x, blocks, int(kind), activations=activations)
    )
    assert torch.equal(one, two)  # each output summed by one thread in a fixed order
    if activations == "fp32":
        assert_close_to_reference(one, F.linear(x, w), rtol_to_max=RTOL)
    else:
        want = torch.from_numpy(q8_reference(x.numpy(), w.numpy())[0])
        assert_close_to_reference(one.double(), want, rtol_to_max=RTOL_Q8)


@pytest.mark.parametrize("gemm", [True, False], ids=["gemm", "tiles"])
def test_kernel_dispatch_by_rows(monkeypatch: pytest.MonkeyPatch, gemm: bool) -> None:
    """The decode kernel up to KILN_MAX_ROWS, then the prefill GEMM, or (when it cannot be
    built, with a warning) dequantized tiles."""
    monkeypatch.setattr(gb, "TILE_ROWS", 16)  # several tiles, the last one partial
    kind, n, k = Q.Q4_K, 40, 256
    raw = random_blocks(kind, n, k)
    w, blocks = _gguf_values(raw, kind), torch.from_numpy(raw)
    if gemm:
        kernel = gb.GgufKernel(blocks, int(kind), k, activations="fp32")
    else:

        def broken(isa: str | None = None) -> None:
            raise native.KilnCompileError("no compiler here")

        monkeypatch.setattr(pg, "load_extension", broken)
        with pytest.warns(RuntimeWarning, match="dequantizing tiles for many rows"):
            kernel = gb.GgufKernel(blocks, int(kind), k, activations="fp32")
    assert (kernel.backend(gb.KILN_MAX_ROWS), kernel.backend(gb.KILN_MAX_ROWS + 1)) == (
        "kiln", "gemm" if gemm else "tiles",
    )  # fmt: skip
    for shape in ((1, k), (2, 9, k), (gb.KILN_MAX_ROWS + 1, k), (3, 40, k), (0, k)):
        x = torch.randn(shape)
        assert_close_to_reference(kernel(x), F.linear(x, w), rtol_to_max=RTOL)


def test_default_kernel_quantizes_every_row() -> None:
    """``GgufKernel``'s default: the 8-bit kernel up to KILN_MAX_ROWS rows (the same bits as
    ``gguf_matmul``'s), then the 8-bit prefill GEMM."""
    kind, n, k = Q.Q5_0, 40, 256
    raw = random_blocks(kind, n, k)
    w, blocks = _gguf_values(raw, kind), torch.from_numpy(raw)
    kernel = gb.GgufKernel(blocks, int(kind), k)
    assert kernel.activations == gb.DEFAULT_ACTIVATIONS == "int8"
    x = torch.randn(gb.KILN_MAX_ROWS + 1, k)
    few = x[: gb.KILN_MAX_ROWS]
    assert torch.equal(kernel(few), gb.gguf_matmul(few, blocks, int(kind)))
    assert kernel.backend(len(x)) == "gemm-int8"
    want = torch.from_numpy(q8_reference(x.numpy(), w.numpy())[0])
    assert_close_to_reference(kernel(x).double(), want, rtol_to_max=RTOL_Q8)


def test_without_a_compiler_the_reference_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(isa: str | None = None) -> None:
        raise native.KilnCompileError("no compiler here")

    monkeypatch.setattr(gb, "load_extension", broken)
    raw = random_blocks(Q.Q5_1, 6, 64)
    with pytest.warns(RuntimeWarning, match="dequantizing tiles in torch"):
        kernel = gb.gguf_kernel(torch.from_numpy(raw), int(Q.Q5_1), 64)
    x = torch.randn(2, 64)
    assert_close_to_reference(kernel(x), F.linear(x, _gguf_values(raw, Q.Q5_1)), rtol_to_max=RTOL)


def test_arguments_are_checked() -> None:
    raw = torch.from_numpy(random_blocks(Q.Q8_0, 4, 64))
    with pytest.raises(ValueError, match=r"uint8 \(N, 68\)"):
        gb.gguf_matmul(torch.randn(1, 64), raw[:, :34], int(Q.Q8_0))
    with pytest.raises(ValueError, match="not a multiple"):
        gb.check_blocks(raw, int(Q.Q8_0), 48)
    with pytest.raises(ValueError, match="no kiln block kernel"):
        gb.check_blocks(raw, int(Q.Q2_K), 256)
    with pytest.raises(ValueError, match="float32 CPU tensor"):
        gb.gguf_matmul(torch.randn(1, 64).double(), raw, int(Q.Q8_0))
    with pytest.raises(ValueError, match="has no kiln block kernel"):
        gb.load_extension().mm(int(Q.Q2_K), 0, 0, 0, 0, 0, 0)  # the C++ side checks too
    with pytest.raises(ValueError, match="isa must be"):
        gb.load_extension("sse2")
    with pytest.raises(ValueError, match="activations must be one of"):
        gb.gguf_matmul(torch.randn(1, 64), raw, int(Q.Q8_0), activations="int4")
    with pytest.raises(ValueError, match="multiple of 32"):
        gb.quantize_activations(torch.randn(2, 48))


def test_isa_builds_and_cache_key() -> None:
    lanes = {"avx512": 16, "avx2": 8}
    for isa in ISAS:
        assert gb.load_extension(isa).lanes() == lanes[isa]
    assert gb.load_extension().lanes() == lanes[native.isa()]
    if len(ISAS) == 2:
        assert gb.extension_key("avx2") != gb.extension_key("avx512")
    assert gb.SOURCES[0].name == "gguf_blocks.cpp"
    included = quoted_includes(gb.SOURCES[0], [native.INCLUDE])
    assert included <= {p.resolve() for p in gb.SOURCES}
    assert {p.name for p in included} >= {"gguf_blocks.h", "gguf_q8.h", "gguf_qdot.h",
                                          "kiln_vec.h", "kiln_py.h"}  # fmt: skip
