"""kiln_gemm.h (kg::) and pack.py against torch: ragged shapes, bias + relu epilogue, packing."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from kiln.compiler.codegen.cpu import build, pack
from tests.support.compare import assert_close_to_reference

GEMM_SOURCE = r"""
#include "kiln_gemm.h"
using namespace kv;
// Test epilogue: C[row, col] = relu(acc + bias[col]) for the columns that exist (< N).
struct BiasRelu {
  const float* bias;
  float* C;
  int64_t N;
  void operator()(int64_t row, int64_t col0, V a0, V a1) const {
    float* c = C + row * N;
    for (int h = 0; h < 2; ++h) {
      const int64_t col = col0 + h * W, left = N - col;
      if (left <= 0) return;
      const V acc = h == 0 ? a0 : a1;
      if (left >= W) store(c + col, relu(acc + load(bias + col)));
      else storen(c + col, relu(acc + loadn(bias + col, int(left), 0.0f)), int(left));
    }
  }
};
// Serial stand-in for at::parallel_for with `g_threads` chunks (exercises the chunking).
static int g_threads = 1;
static void chunked_for(int64_t b, int64_t e, int64_t grain, kiln_task_fn fn, void* ctx) {
  int64_t chunk = (e - b + g_threads - 1) / g_threads;
  if (chunk < grain) chunk = grain;
  for (int64_t s = b; s < e; s += chunk) fn(ctx, s, s + chunk < e ? s + chunk : e);
}
extern "C" int t_nr() { return kg::NR; }
extern "C" int t_mr() { return kg::MR; }
extern "C" void t_pack(const float* B, int64_t sk, int64_t sn, int64_t K, int64_t N, float* Bp) {
  kg::pack_b(B, sk, sn, K, N, Bp);
}
extern "C" void t_gemm(const float* A, int64_t lda, int64_t M, const float* Bp, int64_t K,
                       int64_t N, const float* bias, float* C, int threads) {
  g_threads = threads;
  KilnRuntime rt{nullptr, chunked_for, nullptr, threads};
  kg::gemm(&rt, A, lda, M, Bp, K, N, BiasRelu{bias, C, N});
}
// Rows [m0, m1) of every panel through kg::gemm_panel directly.
extern "C" void t_gemm_rows(const float* A, int64_t lda, int64_t m0, int64_t m1,
                            const float* Bp, int64_t K, int64_t N, const float* bias, float* C) {
  for (int64_t p = 0; p < kg::num_panels(N); ++p)
    kg::gemm_panel(A, lda, Bp, K, m0, m1, p, BiasRelu{bias, C, N});
}
"""


@pytest.fixture(scope="module")
def lib(compile_lib: Callable[[str], ctypes.CDLL]) -> ctypes.CDLL:
    return compile_lib(GEMM_SOURCE)


def _p(t: Tensor) -> ctypes.c_void_p:
    """Data pointer of t (the caller keeps t alive across the call)."""
    return ctypes.c_void_p(t.data_ptr())


def _i(*xs: int) -> list[ctypes.c_int64]:
    return [ctypes.c_int64(x) for x in xs]


def reference(a: Tensor, b: Tensor, bias: Tensor) -> Tensor:
    return torch.relu(a.double() @ b.double() + bias.double()).float()


def _data(m: int, k: int, n: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g)
    b = torch.randn(k, n, generator=g)
    return a, b, torch.randn(n, generator=g)


# fp32 accumulation in another order than float64: errors grow like sqrt(K) * eps * |terms|
# (measured up to ~1e-6 of the largest |output|).
TOL = 1e-5


@pytest.mark.parametrize("m", [1, 3, 8, 13, 64])
@pytest.mark.parametrize("k", [1, 7, 64, 300])
@pytest.mark.parametrize("n", [1, 5, 16, 40, 300])
def test_gemm_ragged_shapes(lib: ctypes.CDLL, m: int, k: int, n: int) -> None:
    a, b, bias = _data(m, k, n, seed=m * 1000 + k * 10 + n)
    bp = pack.pack_b(b)
    c = torch.full((m + 1, n), 7.0)  # one canary row below C
    lib.t_gemm(_p(a), *_i(k, m), _p(bp), *_i(k, n), _p(bias), _p(c), 1)
    assert_close_to_reference(c[:m], reference(a, b, bias), rtol_to_max=TOL)
    assert torch.all(c[m:] == 7.0)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize(("m", "k", "n"), [(8, 256, 300), (64, 300, 40), (200, 64, 100)])
def test_gemm_parallel_chunks(lib: ctypes.CDLL, threads: int, m: int, k: int, n: int) -> None:
    a, b, bias = _data(m, k, n, seed=threads)
    c, bp = torch.empty(m, n), pack.pack_b(b)
    lib.t_gemm(_p(a), *_i(k, m), _p(bp), *_i(k, n), _p(bias), _p(c), threads)
    assert_close_to_reference(c, reference(a, b, bias), rtol_to_max=TOL)


def test_gemm_panel_row_range_and_lda(lib: ctypes.CDLL) -> None:
    # A is a column slice of a wider matrix (lda > K); only rows [5, 18) are computed.
    m, k, n, lda = 20, 37, 45, 50
    wide, b, bias = _data(m, lda, n, seed=7)[0], *_data(1, k, n, seed=8)[1:]
    a = wide[:, :k]
    c, bp = torch.full((m, n), 7.0), pack.pack_b(b)
    lib.t_gemm_rows(_p(wide), *_i(lda, 5, 18), _p(bp), *_i(k, n), _p(bias), _p(c))
    assert_close_to_reference(c[5:18], reference(a[5:18], b, bias), rtol_to_max=TOL)
    assert torch.all(c[:5] == 7.0) and torch.all(c[18:] == 7.0)


@pytest.mark.parametrize(("k", "n"), [(1, 1), (7, 5), (64, 40), (300, 300)])
@pytest.mark.parametrize("transposed", [False, True])
def test_pack_b_python_matches_cpp(lib: ctypes.CDLL, k: int, n: int, transposed: bool) -> None:
    g = torch.Generator().manual_seed(k + n)
    if transposed:  # a linear weight (N, K) used as B = W^T: strides (1, K)
        w = torch.randn(n, k, generator=g)
        b, sk, sn = w.t(), 1, k
    else:
        b = torch.randn(k, n, generator=g)
        w, sk, sn = b, n, 1
    expect = pack.pack_b(b)
    nr = pack.nr()
    assert expect.shape == (-(-n // nr), k, nr) and expect.is_contiguous()
    got = torch.full((expect.numel(),), 7.0)
    lib.t_pack(_p(w), *_i(sk, sn, k, n), _p(got))
    assert torch.equal(got, expect.reshape(-1))


def test_pack_layout_and_constants(lib: ctypes.CDLL) -> None:
    assert lib.t_nr() == pack.nr() == pack.nr(build.isa())
    assert pack.nr("avx2") == 16 and pack.nr("avx512") == 32
    assert lib.t_mr() == (12 if build.isa() == "avx512" else 6)
    b = torch.arange(3 * 40, dtype=torch.float32).reshape(3, 40)
    bp = pack.pack_b(b, isa="avx2")  # (P, K, NR) = (3, 3, 16)
    assert bp.shape == (3, 3, 16)
    flat = bp.reshape(-1)
    for p in range(3):
        for k in range(3):
            for j in range(16):
                col = p * 16 + j
                assert flat[p * 3 * 16 + k * 16 + j] == (b[k, col] if col < 40 else 0)
    with pytest.raises(ValueError, match="unknown ISA"):
        pack.nr("neon")
