"""kiln.kernels.cpu.woq: each CPU backend against dequantize + F.linear, the repacked
layouts, the row-count dispatch and the on-disk build cache of the C++ extension."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.core import native
from kiln.core.cache import cache_dir
from kiln.kernels.cpu import panels as kp
from kiln.kernels.cpu import woq as cw
from kiln.kernels.formats import dequantize_int4, dequantize_int8
from tests.support.compare import assert_close_to_reference
from tests.support.native import quoted_includes
from tests.support.threads import at_one_and_many_threads

# Another summation order than F.linear (and INT8's scale applied after the sum): a few
# float32 ulps of the largest output.
RTOL = 2e-5
# 1..9 covers every register block (1-8 rows) and a second chunk; 17 and 70 cross more
# chunk boundaries.
ROWS = (*range(1, 10), 17, 70)


def _int8(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(n * 1000 + k)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    return q, torch.rand(n, generator=gen) * 0.02 + 1e-3


def _int4(
    n: int, k: int, g: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(n * 1000 + k + g)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(n, k // g, generator=gen) * 0.02 + 1e-3).half()
    offset = (-8 * scale.float()).half() if symmetric else torch.randn(n, k // g).half() * 0.1
    return packed, scale, offset


@pytest.fixture(scope="module")
def lanes() -> int:
    return int(cw.load_extension().lanes())


# ------------------------------------------------------------------ backends vs reference
@pytest.mark.parametrize("backend", ["kiln", "gemm", "torch", "dequant", "auto"])
@pytest.mark.parametrize("n,k", [(576, 576), (13, 64), (40, 37)])
def test_int8_backends_match_reference(backend: cw.Backend, n: int, k: int) -> None:
    q, s = _int8(n, k)
    kernel = cw.cpu_int8_kernel(q, s, backend)
    w = dequantize_int8(q, s)
    for m in ROWS:
        x = torch.randn(m, k)
        assert_close_to_reference(kernel(x), F.linear(x, w), rtol_to_max=RTOL)


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("n,k", [(192, 1536), (13, 384)])
def test_kiln_int4_matches_reference(n: int, k: int, g: int, symmetric: bool) -> None:
    packed, scale, offset = _int4(n, k, g, symmetric)
    kernel = cw.cpu_int4_kernel(packed, scale, offset, g, "kiln")
    w = dequantize_int4(packed, scale, offset, g)
    for m in ROWS:
        x = torch.randn(m, k)
        assert_close_to_reference(kernel(x), F.linear(x, w), rtol_to_max=RTOL)


@pytest.mark.parametrize("backend", ["gemm", "torch", "dequant", "auto"])
def test_other_int4_backends_match_reference(backend: cw.Backend) -> None:
    packed, scale, offset = _int4(48, 256, 64, symmetric=False)  # torch's kernel: N % 16 == 0
    kernel = cw.cpu_int4_kernel(packed, scale, offset, 64, backend)
    w = dequantize_int4(packed, scale, offset, 64)
    for m in ROWS:
        x = torch.randn(m, 256)
        assert_close_to_reference(kernel(x), F.linear(x, w), rtol_to_max=RTOL)


def test_auto_picks_kiln_for_decode_rows_and_gemm_for_prefill() -> None:
    q, s = _int8(32, 64)
    kernel = cw.cpu_int8_kernel(q, s)
    assert [kernel.backend(m) for m in (1, 8, cw.KILN_MAX_ROWS)] == ["kiln"] * 3
    assert kernel.backend(cw.KILN_MAX_ROWS + 1) == "gemm"
    x = torch.randn(cw.KILN_MAX_ROWS + 1, 64)
    assert_close_to_reference(kernel(x), F.linear(x, dequantize_int8(q, s)), rtol_to_max=RTOL)
    assert cw.cpu_int8_kernel(q, s, "torch").backend(1) == "torch"


def test_auto_falls_back_to_torch_without_a_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> None:
        raise native.KilnCompileError("no compiler here")

    monkeypatch.setattr(cw, "load_extension", broken)
    q, s = _int8(16, 32)
    with pytest.warns(RuntimeWarning, match="using torch's kernels"):
        kernel = cw.cpu_int8_kernel(q, s)
    assert kernel.backend(1) == "torch"
    x = torch.randn(3, 32)
    assert_close_to_reference(kernel(x), F.linear(x, dequantize_int8(q, s)), rtol_to_max=RTOL)


def test_torch_int4_backend_rejects_unsupported_shape_but_auto_works() -> None:
    packed, scale, offset = _int4(13, 64, 32, symmetric=True)
    with pytest.raises(ValueError, match="N % 16"):
        cw.cpu_int4_kernel(packed, scale, offset, 32, "torch")
    assert cw.cpu_int4_kernel(packed, scale, offset, 32).backend(1) == "kiln"


def test_results_do_not_depend_on_the_thread_count() -> None:
    q, s = _int8(1536, 576)  # large enough for the kernel to use every thread
    kernel = cw.cpu_int8_kernel(q, s, "kiln")
    x = torch.randn(5, 576)
    one, many = at_one_and_many_threads(lambda: kernel(x))
    assert torch.equal(one, many)  # each output is computed by one thread in a fixed order


# ------------------------------------------------------------------ layouts
def test_int8_panels_layout(lanes: int) -> None:
    q, _ = _int8(lanes + 3, 5)
    out = kp.panels_int8(q, lanes)
    assert out.shape == (2, 5, lanes)
    for n in range(lanes + 3):
        assert torch.equal(out[n // lanes, :, n % lanes], q[n])
    assert not out[1, :, 3:].any()  # zero padding past N


def test_int4_records_layout(lanes: int) -> None:
    n, k, g = lanes + 1, 128, 64
    packed, scale, offset = _int4(n, k, g, symmetric=False)
    rec = kp.panels_int4(packed, scale, offset, g, lanes)
    assert rec.shape == (2, k // g, 4 * lanes + g // 2 * lanes)
    for row in range(n):
        p, lane = divmod(row, lanes)
        for gi in range(k // g):
            r = rec[p, gi]
            assert r[: 2 * lanes].view(torch.float16)[lane] == scale[row, gi]
            assert r[2 * lanes : 4 * lanes].view(torch.float16)[lane] == offset[row, gi]
            nib = r[4 * lanes :].view(g // 2, lanes)[:, lane]
            assert torch.equal(nib, packed[row, gi * g // 2 : (gi + 1) * g // 2])


# ------------------------------------------------------------------ build cache
def test_extension_is_built_once_and_cached_on_disk() -> None:
    ext = cw.load_extension()
    assert cw.load_extension() is ext
    so = cache_dir() / "woq" / f"kiln_woq_{cw.extension_key()[:24]}.so"
    assert so.exists()
    assert ext.lanes() == (16 if native.isa() == "avx512" else 8)


def test_cache_key_covers_every_included_header() -> None:
    sources = [p.resolve() for p in cw.SOURCES]
    assert cw.SOURCES[0].name == "woq.cpp"
    assert quoted_includes(cw.SOURCES[0], [native.INCLUDE]) <= set(sources)
    assert {p.name for p in sources} >= {"woq.h", "kiln_vec.h", "kiln_vec_pow.h"}


def test_extension_rejects_wrong_arguments() -> None:
    with pytest.raises(TypeError, match="expects 7 integer arguments"):
        cw.load_extension().int8_mm(1, 2)
    with pytest.raises(TypeError):
        cw.load_extension().int4_mm(*(["x"] * 7))


def test_backend_name_and_device_are_checked() -> None:
    q, s = _int8(8, 16)
    with pytest.raises(ValueError, match="backend must be"):
        cw.cpu_int8_kernel(q, s, "fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs CPU tensors"):
        cw.cpu_int8_kernel(q.to("meta"), s.to("meta"))
