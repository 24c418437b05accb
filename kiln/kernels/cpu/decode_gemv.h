// decode_gemv.h — fp32 y (M, N) = x (M, K) @ w.T (+ bias) for decode-sized M (a few rows).
//
// At decode a linear layer is a matrix-vector product: every weight is read once and used
// M times, so the time is the weight bytes streamed from DRAM. The weight stays in
// nn.Linear's own row-major (N, K) layout (no packed copy: an fp32 model would otherwise
// hold its weights twice). A block of R output rows x M activation rows keeps R x M
// accumulator vectors in registers; per k-vector it loads R weight vectors (R sequential
// streams, adjacent in memory) and M activation vectors (L1-resident) and does R x M FMAs;
// at the end each accumulator is summed across lanes. K tails use masked loads (never past
// the end). More than 8 rows run as chunks of 8 over the same (cache-resident) block.
// The caller splits the output rows across threads (decode_team.h).
#pragma once
#include <algorithm>
#include <cstdint>

#include "kiln_vec.h"

namespace kdec {

// Output rows per unit of parallel work (a multiple of every block height R below).
constexpr int64_t kGemvRowsPerBlock = 16;

struct Fp32Args {
  const float* x;     // (M, K)
  int64_t M, K, N;
  const float* w;     // (N, K) row-major
  const float* bias;  // (N,) or nullptr
  float* y;           // (M, N)
};

// R output rows n0.. of M activation rows r0..: R x M accumulators, fully unrolled.
template <int M, int R>
inline void gemv_block(const Fp32Args& a, int64_t n0, int64_t r0) {
  using kv::V;
  constexpr int W = kv::W;
  const int64_t K = a.K;
  const float* w = a.w + n0 * K;
  const float* x = a.x + r0 * K;
  V acc[R][M];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[r][m] = kv::splat(0.0f);
  int64_t k = 0;
  for (; k + W <= K; k += W) {
    V wr[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) wr[r] = kv::load(w + r * K + k);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const V xm = kv::load(x + m * K + k);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r][m] = kv::fma(wr[r], xm, acc[r][m]);
    }
  }
  if (k < K) {  // K % W lanes: masked loads, zero elsewhere
    const int n = static_cast<int>(K - k);
    V wr[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) wr[r] = kv::loadn(w + r * K + k, n, 0.0f);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const V xm = kv::loadn(x + m * K + k, n, 0.0f);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r][m] = kv::fma(wr[r], xm, acc[r][m]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      float s = kv::hsum(acc[r][m]);
      if (a.bias != nullptr) s += a.bias[n0 + r];
      a.y[(r0 + m) * a.N + n0 + r] = s;
    }
}

// Block height: 8 accumulators at most (16 ymm registers: accumulators + R weights + x).
constexpr int gemv_rows(int m) { return m <= 2 ? 4 : (m <= 4 ? 2 : 1); }

// Rows [n0, n1) of the output for the activation rows r0 .. r0 + M - 1.
template <int M>
inline void gemv_range(const Fp32Args& a, int64_t n0, int64_t n1, int64_t r0) {
  constexpr int R = gemv_rows(M);
  int64_t n = n0;
  for (; n + R <= n1; n += R) gemv_block<M, R>(a, n, r0);
  for (; n < n1; ++n) gemv_block<M, 1>(a, n, r0);
}

inline void gemv_rows_dispatch(int m, const Fp32Args& a, int64_t n0, int64_t n1, int64_t r0) {
  switch (m) {
    case 1: return gemv_range<1>(a, n0, n1, r0);
    case 2: return gemv_range<2>(a, n0, n1, r0);
    case 3: return gemv_range<3>(a, n0, n1, r0);
    case 4: return gemv_range<4>(a, n0, n1, r0);
    case 5: return gemv_range<5>(a, n0, n1, r0);
    case 6: return gemv_range<6>(a, n0, n1, r0);
    case 7: return gemv_range<7>(a, n0, n1, r0);
    default: return gemv_range<8>(a, n0, n1, r0);
  }
}

// Output rows [n0, n1) for every activation row (chunks of <= 8 rows).
inline void gemv_fp32(const Fp32Args& a, int64_t n0, int64_t n1) {
  for (int64_t r0 = 0; r0 < a.M; r0 += 8) {
    const int m = static_cast<int>(std::min<int64_t>(8, a.M - r0));
    gemv_rows_dispatch(m, a, n0, n1, r0);
  }
}

}  // namespace kdec
