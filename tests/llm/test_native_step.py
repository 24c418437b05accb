"""decode.cpp's linear layers and descriptor checks, against F.linear / the woq reference.

The whole-step tests (against the eager Transformer) are tests/llm/test_decode.py.
"""

from __future__ import annotations

import gguf
import pytest
import torch
import torch.nn.functional as F

from kiln.compress.quantizers import quantize_int4, quantize_int8
from kiln.core import native
from kiln.kernels.cpu.gguf_blocks import gguf_matmul, reference_dequantize
from kiln.kernels.formats import dequantize_int4, dequantize_int8, pack_int4
from kiln.llm.native import step as decode
from tests.support.compare import assert_close_to_reference
from tests.support.gguf_quants import random_blocks
from tests.support.native import quoted_includes

TOL = 1e-5  # fp32 dot products of <= 600 terms, summed in another order than MKL


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 11])
@pytest.mark.parametrize(("n", "k"), [(576, 576), (37, 44), (130, 1536), (5, 3)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_linear(m: int, n: int, k: int, bias: bool) -> None:
    w, x = torch.randn(n, k), torch.randn(m, k)
    b = torch.randn(n) if bias else None
    got = decode.linear(decode.dense_args(w, b), x)
    assert_close_to_reference(got, F.linear(x, w, b), rtol_to_max=TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 9])
@pytest.mark.parametrize(("n", "k"), [(576, 576), (37, 44), (5, 3)])
def test_16bit_linear(dtype: torch.dtype, m: int, n: int, k: int) -> None:
    """16-bit weights widened in the kernel: fp32 math on exactly the stored values."""
    w, x, b = torch.randn(n, k).to(dtype), torch.randn(m, k), torch.randn(n)
    got = decode.linear(decode.dense_args(w, b), x)
    assert_close_to_reference(got, F.linear(x, w.float(), b), rtol_to_max=TOL)


@pytest.mark.parametrize("m", [1, 2, 3, 8, 9])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear(m: int, bias: bool) -> None:
    w, x = torch.randn(200, 96), torch.randn(m, 96)
    q, scale = quantize_int8(w)
    b = torch.randn(200) if bias else None
    got = decode.linear(decode.int8_args(q, scale, b), x)
    assert_close_to_reference(got, F.linear(x, dequantize_int8(q, scale), b), rtol_to_max=TOL)


@pytest.mark.parametrize("m", [1, 2, 3, 8, 9])
@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_int4_linear(m: int, group: int, bias: bool) -> None:
    w, x = torch.randn(72, 192), torch.randn(m, 192)
    codes, scale, offset = quantize_int4(w, group, symmetric=False)
    packed = pack_int4(codes)
    b = torch.randn(72) if bias else None
    got = decode.linear(decode.int4_args(packed, scale, offset, group, b), x)
    ref = F.linear(x, dequantize_int4(packed, scale, offset, group), b)
    assert_close_to_reference(got, ref, rtol_to_max=TOL)


GGUF_KINDS = {"Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "Q5_0": 6, "Q5_1": 7, "Q4_0": 2,
              "Q4_1": 3}  # fmt: skip


@pytest.mark.parametrize("m", [1, 3, 9])
@pytest.mark.parametrize("kind", GGUF_KINDS.values(), ids=GGUF_KINDS.keys())
def test_gguf_linear(m: int, kind: int) -> None:
    """A GGUF tensor's blocks as stored (the record's group is the ggml type), with bias:
    fp32 activations against F.linear; 8-bit activations give the bits of the GgufLinear
    kernel (``gguf_blocks.gguf_matmul``): one kernel, one quantization, in both places."""
    raw = torch.from_numpy(random_blocks(gguf.GGMLQuantizationType(kind), 37, 512))
    x, b = torch.randn(m, 512), torch.randn(37)
    got = decode.linear(decode.gguf_args(raw, kind, 512, b, activations="fp32"), x)
    ref = F.linear(x, reference_dequantize(raw, kind, 512), b)
    assert_close_to_reference(got, ref, rtol_to_max=TOL)
    args = decode.gguf_args(raw, kind, 512, b)
    assert args.kind == decode.KIND_GGUF_Q8  # the default
    assert torch.equal(decode.linear(args, x), gguf_matmul(x, raw, kind) + b)


def test_threads_give_identical_results() -> None:
    """Each output is computed whole by one thread: the thread count changes nothing."""
    w, x = torch.randn(3000, 200), torch.randn(4, 200)
    for args in (decode.dense_args(w, None), decode.int8_args(*quantize_int8(w), None)):
        one = decode.linear(args, x, threads=1)
        for threads in (2, 3):
            assert torch.equal(decode.linear(args, x, threads=threads), one)


def test_dense_args_rejects_other_dtypes() -> None:
    for dtype in (torch.float64, torch.int8):
        with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
            decode.dense_args(torch.ones(4, 4, dtype=dtype), None)
    with pytest.raises(ValueError, match="2-D"):
        decode.dense_args(torch.randn(4), None)


def test_descriptor_magic_is_checked() -> None:
    bad = torch.zeros(64, dtype=torch.int64)
    with pytest.raises(ValueError, match="magic"):
        decode.load_extension().workspace_floats(bad.data_ptr(), 1)


def test_descriptor_floats_are_double_bits() -> None:
    d = decode.Descriptor()
    d.float(0.1)
    assert d.to_tensor().view(torch.float64).item() == 0.1


def test_cache_key_covers_every_included_header() -> None:
    # decode.cpp includes woq.h (never woq.cpp) from the kernels' folder.
    dirs = [*decode.INCLUDE_DIRS, native.INCLUDE]
    included = quoted_includes(decode.SOURCES[0], dirs)
    assert decode.SOURCES[0].name == "decode.cpp"
    assert included <= {p.resolve() for p in decode.SOURCES}
    assert {p.name for p in included} >= {"woq.h", "kiln_vec.h", "decode_gemv.h"}
    assert not any(p.suffix == ".cpp" for p in included)


def test_extension_key_tracks_flags_and_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    key = decode.extension_key()
    monkeypatch.setattr(decode, "FLAGS", (*decode.FLAGS, "-DKILN_TEST"))
    assert decode.extension_key() != key
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert decode.extension_key() != key
