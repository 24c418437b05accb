// kiln_gemm.h — register-blocked fp32 GEMM for small M (namespace kg).
//
// C (M x N) = A (M x K, row-major, row stride lda, unit stride along K) * B (K x N).
//
// Packing. B (the weight, usually known at compile time) is stored as column panels of
// NR = 2 * kv::W columns, zero-padded to a multiple of NR. Panel p is contiguous and
// k-major:
//     Bp[p * K * NR + k * NR + j] = B[k][p * NR + j]      (0 <= j < NR)
// so for each k the micro-kernel reads NR consecutive floats: two vector loads.
//
// Blocking. gemm_panel computes an R x NR block of C (R <= MR) entirely in registers:
// 2R accumulators (two vectors per row), and per k it loads two B vectors and broadcasts
// one A element per row, issuing 2R FMAs. MR is chosen so that 2 MR accumulators + 2 B
// vectors + 1 broadcast fit the register file:
//     AVX2     16 ymm:  MR = 6  -> 12 + 2 + 1 = 15
//     AVX-512  32 zmm:  MR = 12 -> 24 + 2 + 1 = 27
// Rows of a panel are split into ceil(rows / MR) blocks of near-equal size (8 rows on AVX2
// are 4 + 4, not 6 + 2), so every block keeps enough independent FMAs in flight to hide
// the FMA latency. A finished row goes to the caller's epilogue as two vectors, which adds
// bias / activation / residual and stores (handling the N tail).
#pragma once
#include <algorithm>
#include <cstdint>

#include "kiln_rt.h"
#include "kiln_vec.h"

namespace kg {

constexpr int NR = 2 * kv::W;  // panel width (columns)
#if KV_BYTES == 64
constexpr int MR = 12;  // rows per register block
#else
constexpr int MR = 6;
#endif
#define KG_INLINE_LAMBDA __attribute__((always_inline))
// Software prefetch distance (k steps) for the B panel: weights larger than L2 stream from
// L3, and prefetching 16 steps ahead measured +15-20% there on Sapphire Rapids (neutral on
// Zen 3 and for cache-resident panels). 0 disables it.
#ifndef KG_PREFETCH
#define KG_PREFETCH 16
#endif

// Number of panels for N columns.
constexpr int64_t num_panels(int64_t N) { return (N + NR - 1) / NR; }

// Independent accumulator chains for short blocks: with R rows there are only 2R
// accumulators, too few to cover the FMA latency (~4 cycles x 2 FMA/cycle = 8 in flight)
// when R < 4, so consecutive k steps go to S separate accumulator sets, summed at the end.
template <int R>
constexpr int kChains = R == 1 ? 4 : R <= 3 ? 2 : 1;

// R rows [row0, row0 + R) of panel `panel` (its first float), K steps, then the epilogue.
template <int R, class Epi>
KV_INLINE void micro_kernel(const float* A, int64_t lda, const float* panel, int64_t K,
                            int64_t row0, int64_t col0, Epi& epi) {
  constexpr int S = kChains<R>;
  kv::V c0[S][R], c1[S][R];
#pragma GCC unroll 16
  for (int s = 0; s < S; ++s) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) c0[s][r] = c1[s][r] = kv::splat(0.0f);
  }
  const float* a = A + row0 * lda;
  // One k step into accumulator set s: two B vectors, R broadcasts, 2R FMAs.
  auto step = [&](int s, int64_t k) KG_INLINE_LAMBDA {
#if KG_PREFETCH > 0
    // (hints only: prefetching past the end of the panel is harmless)
    __builtin_prefetch(panel + (k + KG_PREFETCH) * NR, 0, 3);
    if constexpr (NR * 4 > 64) __builtin_prefetch(panel + (k + KG_PREFETCH) * NR + 16, 0, 3);
#endif
    const kv::V b0 = kv::load(panel + k * NR);
    const kv::V b1 = kv::load(panel + k * NR + kv::W);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const kv::V ar = kv::splat(a[r * lda + k]);
      c0[s][r] = kv::fma(ar, b0, c0[s][r]);
      c1[s][r] = kv::fma(ar, b1, c1[s][r]);
    }
  };
  int64_t k = 0;
#pragma GCC unroll 2
  for (; k + S <= K; k += S) {
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) step(s, k + s);
  }
  for (; k < K; ++k) step(0, k);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int s = 1; s < S; ++s) {
      c0[0][r] += c0[s][r];
      c1[0][r] += c1[s][r];
    }
    epi(row0 + r, col0, c0[0][r], c1[0][r]);
  }
}

namespace detail {
// Calls micro_kernel<R> for a runtime R in [1, MR] (a chain of compile-time instances).
template <int R, class Epi>
KV_INLINE void dispatch_rows(int64_t rows, const float* A, int64_t lda, const float* panel,
                             int64_t K, int64_t row0, int64_t col0, Epi& epi) {
  if constexpr (R > 1) {
    if (rows < R) {
      dispatch_rows<R - 1>(rows, A, lda, panel, K, row0, col0, epi);
      return;
    }
  }
  micro_kernel<R>(A, lda, panel, K, row0, col0, epi);
}
}  // namespace detail

// Rows [m0, m1) of panel p. For each finished row calls
//     epi(int64_t row, int64_t col0, kv::V acc0, kv::V acc1)
// with col0 = p * NR: acc0 holds columns col0 .. col0 + W - 1, acc1 the next W. Columns
// at or past N (panel padding) hold zeros; the epilogue must not store them.
template <class Epi>
inline void gemm_panel(const float* A, int64_t lda, const float* Bp, int64_t K, int64_t m0,
                       int64_t m1, int64_t p, Epi&& epi) {
  const float* panel = Bp + p * K * NR;
  const int64_t col0 = p * NR;
  int64_t blocks = (m1 - m0 + MR - 1) / MR;
  for (int64_t row = m0; row < m1; --blocks) {
    const int64_t rows = (m1 - row + blocks - 1) / blocks;  // balanced block heights
    detail::dispatch_rows<MR>(rows, A, lda, panel, K, row, col0, epi);
    row += rows;
  }
}

// Below this much work a parallel chunk costs more in thread wake-up than it saves.
// Work is counted in flop-equivalents: with few rows a GEMM is bound by streaming B
// from memory, and one byte costs about as long as kFlopsPerByte flops at peak.
constexpr int64_t kMinChunkFlops = int64_t{1} << 19;
constexpr int64_t kFlopsPerByte = 6;
// Row blocks of at most this many rows are parallel units for large M (panel reuse per
// unit stays high, A block stays in L2).
constexpr int64_t kRowsPerUnit = 8 * MR;

// The whole GEMM, parallel over (row block, panel) units through the runtime's thread pool.
// Units are numbered panel-major, so one thread's contiguous range shares B panels. `epi`
// is called concurrently from several threads (for distinct rows / panels).
template <class Epi>
inline void gemm(const KilnRuntime* rt, const float* A, int64_t lda, int64_t M, const float* Bp,
                 int64_t K, int64_t N, Epi&& epi) {
  if (M <= 0 || N <= 0) return;
  const int64_t panels = num_panels(N);
  const int64_t mb = M < kRowsPerUnit ? M : kRowsPerUnit;
  const int64_t row_blocks = (M + mb - 1) / mb;
  const int64_t kk = K > 0 ? K : 1;
  const int64_t unit_flops = 2 * mb * kk * NR;
  const int64_t unit_bytes = int64_t{sizeof(float)} * kk * NR;  // one B panel
  const int64_t unit_work = std::max(unit_flops, unit_bytes * kFlopsPerByte);
  const int64_t grain = (kMinChunkFlops + unit_work - 1) / unit_work;
  kiln::parallel(rt, panels * row_blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t p = u / row_blocks, rb = u % row_blocks;
      const int64_t m0 = rb * mb, m1 = m0 + mb < M ? m0 + mb : M;
      gemm_panel(A, lda, Bp, K, m0, m1, p, epi);
    }
  });
}

// Packs B (element (k, n) at B[k * sk + n * sn]) into panels Bp of
// num_panels(N) * K * NR floats (layout above; padding columns are zero).
inline void pack_b(const float* B, int64_t sk, int64_t sn, int64_t K, int64_t N, float* Bp) {
  const int64_t panels = num_panels(N);
  if (sn == 1) {  // rows of B contiguous (1x1 conv activations): vector copies, k-outer
    const int64_t full = N / NR, tail = N - full * NR;
    for (int64_t k = 0; k < K; ++k) {
      const float* src = B + k * sk;
      for (int64_t p = 0; p < full; ++p) {
        float* dst = Bp + (p * K + k) * NR;
        kv::store(dst, kv::load(src + p * NR));
        kv::store(dst + kv::W, kv::load(src + p * NR + kv::W));
      }
      if (tail) {
        float* dst = Bp + (full * K + k) * NR;
        const int t0 = (int)(tail < kv::W ? tail : kv::W);
        kv::store(dst, kv::loadn(src + full * NR, t0, 0.0f));
        kv::store(dst + kv::W, kv::loadn(src + full * NR + kv::W, (int)tail - t0, 0.0f));
      }
    }
    return;
  }
  for (int64_t p = 0; p < panels; ++p) {
    for (int64_t k = 0; k < K; ++k) {
      float* dst = Bp + (p * K + k) * NR;
      for (int j = 0; j < NR; ++j) {
        const int64_t n = p * NR + j;
        dst[j] = n < N ? B[k * sk + n * sn] : 0.0f;
      }
    }
  }
}

}  // namespace kg
