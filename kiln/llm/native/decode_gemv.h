// decode_gemv.h — y (M, N) = x (M, K) @ w.T (+ bias) for decode-sized M (a few rows), the
// weight stored as fp32, bf16 or fp16 (decode_half.h: widened to fp32 as it is loaded).
//
// At decode a linear layer is a matrix-vector product: every weight is read once and used
// M times, so the time is the weight bytes streamed from DRAM. The weight stays in
// nn.Linear's own row-major (N, K) layout (no packed copy: an fp32 model would otherwise
// hold its weights twice).
//   * M = 1 (batch-1 decode): gemv_row reads one weight row front to back with four
//     accumulators; consecutive rows are adjacent, so a thread's run of rows is one
//     sequential stream (measured here: the head's GEMV 13.8 -> 18.2 GB/s on one thread
//     against the R-row blocks below, and a whole fp32 step 27 -> 23 ms).
//   * M = 2..4: gemv_row_m, the same one stream per run of rows, each weight vector used
//     for the M activation rows (batch 4 on SmolLM2: fp32 step 33 -> 27 ms, bf16 29 -> 20).
//   * M > 4: a block of R output rows x M activation rows keeps R x M accumulator vectors
//     in registers; per k-vector it loads R weight vectors (R streams, adjacent in memory)
//     and M activation vectors (L1-resident) and does R x M FMAs, so each weight is read
//     once for all M rows. More than 8 rows run as chunks of 8 over the same block.
// At the end each accumulator is summed across lanes. K tails use masked loads (never past
// the end). Every function is templated on the storage code S, dispatched once per call.
// The caller splits the output rows across threads (decode_team.h).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "decode_half.h"
#include "kiln_vec.h"

namespace kdec {

// Output rows per unit of parallel work (a multiple of every block height R below).
constexpr int64_t kGemvRowsPerBlock = 16;

struct DenseArgs {
  const float* x;     // (M, K)
  const float* xs;    // bf16: x through split_pairs (M, K); unused otherwise
  int64_t M, K, N;
  const void* w;      // (N, K) row-major, storage `storage`
  int storage;        // kF32, kBF16 or kF16
  const float* bias;  // (N,) or nullptr
  float* y;           // (M, N)
};

// bf16 weights, 2W at a time: one load holds W 32-bit lanes of two bf16 values each; the
// even-indexed value (low half) is the float `lane << 16`, the odd one `lane & 0xffff0000`,
// so two bit operations widen 2W weights (a zero-extending conversion would take 2 per W).
// The activations are split to match once per call: in each chunk of 2W, the W even
// elements, then the W odd ones.
constexpr int32_t kHighHalves = static_cast<int32_t>(0xffff0000u);
constexpr int64_t kBf16Prefetch = 1024;  // elements (2 KB) a bf16 row stream prefetches ahead

// The 2W bf16 values at p as floats: the even-indexed ones, and the odd ones.
KV_INLINE void widen_pairs(const uint16_t* p, kv::V& even, kv::V& odd) {
  kv::VI bits;
  std::memcpy(&bits, p, sizeof bits);
  even = kv::as_float(bits << 16), odd = kv::as_float(bits & kHighHalves);
}

// xs (rows, K) = x with each full chunk of 2W columns split into its even then odd
// elements; the last K % 2W columns copied as they are.
inline void split_pairs(const float* x, int64_t rows, int64_t K, float* xs) {
  constexpr int64_t C = 2 * kv::W;
  for (int64_t m = 0; m < rows; ++m) {
    const float* xr = x + m * K;
    float* out = xs + m * K;
    int64_t c = 0;
    for (; c + C <= K; c += C)
      for (int64_t j = 0; j < kv::W; ++j) {
        out[c + j] = xr[c + 2 * j];
        out[c + kv::W + j] = xr[c + 2 * j + 1];
      }
    for (; c < K; ++c) out[c] = xr[c];
  }
}

// R output rows n0.. of M activation rows r0..: R x M accumulators, fully unrolled.
template <int S, int M, int R>
inline void gemv_block(const DenseArgs& a, int64_t n0, int64_t r0) {
  using kv::V;
  constexpr int W = kv::W;
  const int64_t K = a.K;
  const int64_t w0 = n0 * K;  // element offset of row n0
  const float* x = a.x + r0 * K;
  V acc[R][M];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[r][m] = kv::splat(0.0f);
  int64_t k = 0;
  if constexpr (S == kBF16) {  // 2W weights per load: even and odd elements (see split_pairs)
    const float* xs = a.xs + r0 * K;
    for (; k + 2 * W <= K; k += 2 * W) {
      V we[R], wo[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
        widen_pairs(static_cast<const uint16_t*>(a.w) + w0 + r * K + k, we[r], wo[r]);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const V xe = kv::load(xs + m * K + k), xo = kv::load(xs + m * K + k + W);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          acc[r][m] = kv::fma(we[r], xe, acc[r][m]);
          acc[r][m] = kv::fma(wo[r], xo, acc[r][m]);
        }
      }
    }
  }
  for (; k + W <= K; k += W) {
    V wr[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) wr[r] = load_as<S>(a.w, w0 + r * K + k);
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
    for (int r = 0; r < R; ++r) wr[r] = load_as_n<S>(a.w, w0 + r * K + k, n);
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

// One activation row (M = 1), output row n: the weight row read front to back, four
// accumulators over consecutive vectors of it for instruction-level parallelism. A run of
// rows is one sequential stream, the hardware prefetcher's best case (R rows side by side
// are R short streams of K values each).
template <int S>
inline void gemv_row(const DenseArgs& a, int64_t n) {
  using kv::V;
  constexpr int W = kv::W;
  const int64_t K = a.K, w0 = n * K;
  V acc[4] = {kv::splat(0.0f), kv::splat(0.0f), kv::splat(0.0f), kv::splat(0.0f)};
  int64_t k = 0;
  if constexpr (S == kBF16) {
    const uint16_t* w = static_cast<const uint16_t*>(a.w) + w0;
    for (; k + 4 * W <= K; k += 4 * W) {  // two chunks of 2W: even / odd accumulators each
      // 2 KB ahead (the rows after this one: a run of rows is one stream); measured 5%
      // faster for bf16 here, while the same prefetch made fp32 12% slower (left out there).
      _mm_prefetch(reinterpret_cast<const char*>(w + k + kBf16Prefetch), _MM_HINT_T0);
#pragma GCC unroll 2
      for (int c = 0; c < 2; ++c) {
        V we, wo;
        widen_pairs(w + k + 2 * W * c, we, wo);
        const float* xs = a.xs + k + 2 * W * c;
        acc[2 * c] = kv::fma(we, kv::load(xs), acc[2 * c]);
        acc[2 * c + 1] = kv::fma(wo, kv::load(xs + W), acc[2 * c + 1]);
      }
    }
    if (k + 2 * W <= K) {
      V we, wo;
      widen_pairs(w + k, we, wo);
      acc[0] = kv::fma(we, kv::load(a.xs + k), acc[0]);
      acc[1] = kv::fma(wo, kv::load(a.xs + k + W), acc[1]);
      k += 2 * W;
    }
  } else {
    for (; k + 4 * W <= K; k += 4 * W)
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i)
        acc[i] = kv::fma(load_as<S>(a.w, w0 + k + i * W), kv::load(a.x + k + i * W), acc[i]);
  }
  for (; k + W <= K; k += W) acc[0] = kv::fma(load_as<S>(a.w, w0 + k), kv::load(a.x + k), acc[0]);
  if (k < K) {
    const int rest = static_cast<int>(K - k);
    acc[1] = kv::fma(load_as_n<S>(a.w, w0 + k, rest), kv::loadn(a.x + k, rest, 0.0f), acc[1]);
  }
  float s = kv::hsum((acc[0] + acc[1]) + (acc[2] + acc[3]));
  if (a.bias != nullptr) s += a.bias[n];
  a.y[n] = s;
}

// M = 2..4 activation rows, output row n: as gemv_row, the weight row read once front to
// back (one stream for a run of rows), two accumulators per activation row.
template <int S, int M>
inline void gemv_row_m(const DenseArgs& a, int64_t n) {
  using kv::V;
  constexpr int W = kv::W;
  const int64_t K = a.K, w0 = n * K;
  V acc[2][M];
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m) acc[0][m] = acc[1][m] = kv::splat(0.0f);
  int64_t k = 0;
  for (; k + 2 * W <= K; k += 2 * W) {
    V lo, hi;  // the weights at k .. k + W (bf16: the even ones) and the next W (odd)
    const float* x = a.x;
    if constexpr (S == kBF16) {
      widen_pairs(static_cast<const uint16_t*>(a.w) + w0 + k, lo, hi);
      x = a.xs;
    } else {
      lo = load_as<S>(a.w, w0 + k), hi = load_as<S>(a.w, w0 + k + W);
    }
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      acc[0][m] = kv::fma(lo, kv::load(x + m * K + k), acc[0][m]);
      acc[1][m] = kv::fma(hi, kv::load(x + m * K + k + W), acc[1][m]);
    }
  }
  for (; k < K; k += W) {  // K % 2W: whole vectors, then a masked one
    const int rest = static_cast<int>(std::min<int64_t>(W, K - k));
    const V wv = load_as_n<S>(a.w, w0 + k, rest);
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m)
      acc[0][m] = kv::fma(wv, kv::loadn(a.x + m * K + k, rest, 0.0f), acc[0][m]);
  }
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m) {
    float s = kv::hsum(acc[0][m] + acc[1][m]);
    if (a.bias != nullptr) s += a.bias[n];
    a.y[m * a.N + n] = s;
  }
}

// Block height: 8 accumulators at most (16 ymm registers: accumulators + R weights + x).
constexpr int gemv_rows(int m) { return m <= 2 ? 4 : (m <= 4 ? 2 : 1); }

// Rows [n0, n1) of the output for the activation rows r0 .. r0 + M - 1.
template <int S, int M>
inline void gemv_range(const DenseArgs& a, int64_t n0, int64_t n1, int64_t r0) {
  constexpr int R = gemv_rows(M);
  int64_t n = n0;
  for (; n + R <= n1; n += R) gemv_block<S, M, R>(a, n, r0);
  for (; n < n1; ++n) gemv_block<S, M, 1>(a, n, r0);
}

template <int S>
inline void gemv_all_rows(const DenseArgs& a, int64_t n0, int64_t n1) {
  switch (a.M) {  // a few rows: one weight stream (gemv_row, gemv_row_m)
    case 1: for (int64_t n = n0; n < n1; ++n) gemv_row<S>(a, n); return;
    case 2: for (int64_t n = n0; n < n1; ++n) gemv_row_m<S, 2>(a, n); return;
    case 3: for (int64_t n = n0; n < n1; ++n) gemv_row_m<S, 3>(a, n); return;
    case 4: for (int64_t n = n0; n < n1; ++n) gemv_row_m<S, 4>(a, n); return;
    default: break;
  }
  for (int64_t r0 = 0; r0 < a.M; r0 += 8) {
    switch (std::min<int64_t>(8, a.M - r0)) {
      case 1: gemv_range<S, 1>(a, n0, n1, r0); break;
      case 2: gemv_range<S, 2>(a, n0, n1, r0); break;
      case 3: gemv_range<S, 3>(a, n0, n1, r0); break;
      case 4: gemv_range<S, 4>(a, n0, n1, r0); break;
      case 5: gemv_range<S, 5>(a, n0, n1, r0); break;
      case 6: gemv_range<S, 6>(a, n0, n1, r0); break;
      case 7: gemv_range<S, 7>(a, n0, n1, r0); break;
      default: gemv_range<S, 8>(a, n0, n1, r0);
    }
  }
}

// Output rows [n0, n1) for every activation row (chunks of <= 8 rows).
inline void gemv_dense(const DenseArgs& a, int64_t n0, int64_t n1) {
  switch (a.storage) {
    case kBF16: return gemv_all_rows<kBF16>(a, n0, n1);
    case kF16: return gemv_all_rows<kF16>(a, n0, n1);
    default: return gemv_all_rows<kF32>(a, n0, n1);
  }
}

}  // namespace kdec
