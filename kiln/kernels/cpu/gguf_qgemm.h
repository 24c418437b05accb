// gguf_qgemm.h — y (M, N) = q8(x) (M, K) @ W.T for many rows (prefill), W a GGUF tensor's
// blocks as stored, by integer dot products: the 8-bit-activation arithmetic of the decode
// kernels (gguf_q8.h, gguf_qdot.h) at GEMM speed, in the AVX-512 and the AVX2 builds.
//
// The fp32 prefill GEMM (packed_gemm.h) is compute-bound at W multiply-adds per FMA; one
// integer dot instruction does 4 W (W int32 lanes x 4 byte products): AVX-512 VNNI
// `vpdpbusd`, else `vpmaddubsw` + `vpmaddwd` (pairs summed in saturating int16, which these
// codes never reach: unsigned codes <= 63, or |w| <= 128 for Q8_0, times |x| <= 127). As in
// packed_gemm.h, the weight is decoded once per block of rows into a cache-resident tile of
// NR = 2 W output channels, now as bytes, and a register-blocked micro-kernel multiplies it
// against the rows:
//
//   codes  uint8 [K / 4][NR][4]: the 4 codes of channel c for k = 4 j .. 4 j + 3 are dword
//          j * NR + c, so one vector load is W channels x 4 k (a dot operand). The codes are
//          unsigned (gguf_qdot.h's decoders); Q8_0's signed values + 128 with VNNI, else
//          kept signed (the dot takes |w| and x with w's sign, as gguf_qdot.h);
//   scales float [K / S][NR], S = 32 (16 for Q6_K): the weight scale of each channel's
//          sub-block (the block's d; K-quants: d * the sub-block scale);
//   mins   float [K / 32][NR] for the formats with mins: the term added per 32 elements;
//   micro  MR rows x 2 vectors of W channels: per 4 k, two loads of codes and 2 MR dots
//          against the rows' 4 activation bytes (a broadcast dword); per sub-block the int32
//          sums are turned to float once: acc += s_w * (d_x * dot - O * d_x * sum(q_x)),
//          where O is the format's code offset (Q4_0 8, Q5_0 16, Q6_K 32, Q8_0 128, else 0),
//          then the mins' term acc += min_w * d_x * sum(q_x) (ds) per 32 elements.
//
// The activations are quantized once per call (gguf_q8.h's blocks: d = max|x| / 127 per 32
// elements), in parallel over rows. The dots are exact in int32 (|sum| <= 32 * 255 * 127);
// the result differs from the decode kernels' only by the fp32 rounding of the per-block sums.
// Threads: the tiles split across OpenMP threads in contiguous ranges (packed_gemm.h's drive),
// each with its own tile buffer; each output is summed by one thread in a fixed order.
#pragma once
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gguf_blocks.h"
#include "gguf_q8.h"
#include "gguf_qdot.h"
#include "packed_gemm.h"  // threads_for

namespace kpg {
namespace {
namespace q8 {

using kv::V;
using kv::VI;
using kv::W;
using kgguf::QActs;

constexpr int QNV = 2;                     // vectors of W channels per tile
constexpr int QNR = W * QNV;               // output channels per tile
constexpr int QMR = W == 16 ? 6 : 4;       // rows per micro-kernel: accumulators fill registers
constexpr int64_t kQBlockRows = 32 * QMR;  // rows per block (x block reused by a thread's tiles)

#if KV_BYTES == 64 && defined(__AVX512VNNI__)
#define KILN_QGEMM_VNNI 1
#endif

#if KV_BYTES == 64
#ifdef KILN_QGEMM_VNNI
constexpr bool kVnni = true;
// acc + per int32 lane the 4 products of unsigned u and signed s bytes
KV_INLINE VI dot_u(VI acc, VI u, VI s) {
  return (VI)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)u, (__m512i)s);
}
#else
constexpr bool kVnni = false;
#endif
// s with the sign of w per byte (w < 0: -s); where w is 0, |w| = 0 cancels the product
KV_INLINE VI sign_of(VI s, VI w) {
  return (VI)_mm512_mask_sub_epi8((__m512i)s, _mm512_movepi8_mask((__m512i)w),
                                  _mm512_setzero_si512(), (__m512i)s);
}
KV_INLINE VI abs8(VI w) { return (VI)_mm512_abs_epi8((__m512i)w); }
// Without VNNI: the pairs' sums in int16 (maddubs), added in int16, then widened to int32.
KV_INLINE VI pairs(VI u, VI s) { return (VI)_mm512_maddubs_epi16((__m512i)u, (__m512i)s); }
KV_INLINE VI add16(VI a, VI b) { return (VI)_mm512_add_epi16((__m512i)a, (__m512i)b); }
KV_INLINE VI widen(VI acc, VI p) {
  return acc + (VI)_mm512_madd_epi16((__m512i)p, _mm512_set1_epi16(1));
}
#else
constexpr bool kVnni = false;  // (AVX-VNNI's 256-bit form is not used here)
KV_INLINE VI sign_of(VI s, VI w) { return (VI)_mm256_sign_epi8((__m256i)s, (__m256i)w); }
KV_INLINE VI abs8(VI w) { return (VI)_mm256_abs_epi8((__m256i)w); }
KV_INLINE VI pairs(VI u, VI s) { return (VI)_mm256_maddubs_epi16((__m256i)u, (__m256i)s); }
KV_INLINE VI add16(VI a, VI b) { return (VI)_mm256_add_epi16((__m256i)a, (__m256i)b); }
KV_INLINE VI widen(VI acc, VI p) {
  return acc + (VI)_mm256_madd_epi16((__m256i)p, _mm256_set1_epi16(1));
}
#endif

#ifndef KILN_QGEMM_VNNI
KV_INLINE VI dot_u(VI acc, VI u, VI s) { return widen(acc, pairs(u, s)); }  // (unused)
#endif

// What a format contributes to the tile: codes unsigned or signed, sub-block size, offset.
template <class F>
struct Traits {
  static constexpr int kSub = F::kElems == 256 && F::kShift == 5 ? 16 : 32;  // Q6_K: 16
  static constexpr bool kSignedCodes = F::kSigned && !kVnni;  // Q8_0 without VNNI
  static constexpr int kOffset =
      F::kSigned ? (kVnni ? 128 : 0) : (F::kShift >= 0 ? 1 << F::kShift : 0);
  static constexpr bool kMins = F::kMins;
  // Without VNNI: k4 steps whose int16 pair sums add up without saturating (a pair sums to
  // at most 2 * max code * 127): Q4 8, Q5 4, Q6_K 2, Q8_0 (|w| <= 128) 1.
  static constexpr int kMaxCode = kSignedCodes ? 128 : (1 << F::kBits) - 1;
  static constexpr int kChain = std::min(kSub / 4, 32767 / (2 * kMaxCode * 127));
};

// The tile of channels [n0, n0 + QNR): its three parts in one buffer (offsets below).
struct Tile {
  uint8_t* codes;  // K * QNR
  float* scales;   // K / S * QNR
  float* mins;     // K / 32 * QNR
  static size_t bytes(int64_t K) {
    return static_cast<size_t>(K * QNR + 2 * K * QNR / 16 * sizeof(float)) + 64;
  }
  static Tile at(void* base, int64_t K) {
    uint8_t* b = static_cast<uint8_t*>(base);
    float* s = reinterpret_cast<float*>(b + K * QNR);
    return Tile{b, s, s + K / 16 * QNR};
  }
};

// Decodes channels [n0, n0 + QNR) of the blocks w (N rows of K) into the tile; zeros past N.
template <class F>
void decode(const uint8_t* w, int64_t K, int64_t N, int64_t n0, const Tile& t) {
  using T = Traits<F>;
  constexpr int G = F::kElems / kgguf::kQBlock;  // groups of 32 per block
  const int64_t blocks = K / F::kElems, row_bytes = blocks * F::kBytes;
  const int64_t valid = std::clamp<int64_t>(N - n0, 0, QNR);
  if (valid < QNR) {
    std::memset(t.codes, 0, static_cast<size_t>(K * QNR));
    std::memset(t.scales, 0, sizeof(float) * static_cast<size_t>(K / T::kSub * QNR));
    if (T::kMins) std::memset(t.mins, 0, sizeof(float) * static_cast<size_t>(K / 32 * QNR));
  }
  uint32_t* codes = reinterpret_cast<uint32_t*>(t.codes);
  for (int64_t c = 0; c < valid; ++c) {
    const uint8_t* row = w + (n0 + c) * row_bytes;
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const uint8_t* wb = row + blk * F::kBytes;
      const typename F::Pre pre = F::prepare(wb);
      alignas(32) float mins[8];
      if constexpr (T::kMins) _mm256_store_ps(mins, F::min(pre));
      for (int g = 0; g < G; ++g) {
        const int64_t grp = blk * G + g;  // the group's index along K
        kgguf::I8 u = F::codes(wb, pre, g);
        if constexpr (F::kSigned && kVnni) u = _mm256_xor_si256(u, _mm256_set1_epi8(-128));
        alignas(32) uint32_t dw[8];
        _mm256_store_si256(reinterpret_cast<kgguf::I8*>(dw), u);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) codes[(grp * 8 + j) * QNR + c] = dw[j];
        alignas(32) float sc[8];
        _mm256_store_ps(sc, F::scale(pre, g));
        if constexpr (T::kSub == 16) {  // lanes 0-3: the first 16 elements, 4-7 the next
          t.scales[(2 * grp) * QNR + c] = sc[0];
          t.scales[(2 * grp + 1) * QNR + c] = sc[4];
        } else {
          t.scales[grp * QNR + c] = sc[0];
        }
        if constexpr (T::kMins) t.mins[grp * QNR + c] = mins[F::kElems == 32 ? 0 : g];
      }
    }
  }
}

KV_INLINE VI bcast4(const int8_t* p) {  // 4 activation bytes in every dword
  int32_t v;
  std::memcpy(&v, p, 4);
  return kv::splati(v);
}
KV_INLINE VI load_codes(const uint8_t* p) {
  VI v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
KV_INLINE V to_f(VI v) { return __builtin_convertvector(v, V); }

// y[r, n0 + c] for R rows (R <= QMR) from row r0 of x against one tile, `cols` valid channels.
template <class F, int R>
KV_INLINE void micro(const QActs& x, int64_t K, int64_t r0, const Tile& t, float* y, int64_t N,
                     int64_t cols) {
  using T = Traits<F>;
  constexpr int S = T::kSub;
  const int64_t nb = x.nb;
  V acc[R][QNV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < QNV; ++v) acc[r][v] = kv::splat(0.0f);
  const uint8_t* codes = t.codes;
  for (int64_t sb = 0; sb < K / S; ++sb) {
    VI dot[R][QNV];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int v = 0; v < QNV; ++v) dot[r][v] = kv::splati(0);
    constexpr int C = kVnni ? 1 : T::kChain;  // k4 steps per int16 chain (no VNNI)
#pragma GCC unroll 8
    for (int j0 = 0; j0 < S / 4; j0 += C) {
      [[maybe_unused]] VI p[R][QNV];
#pragma GCC unroll 8
      for (int j = j0; j < j0 + C; ++j) {
        const int64_t k = sb * S + 4 * j;
        VI w[QNV], u[QNV];
#pragma GCC unroll 2
        for (int v = 0; v < QNV; ++v) {
          w[v] = load_codes(codes + k * QNR + 4 * v * W);  // dword (k / 4) * QNR + v W
          u[v] = T::kSignedCodes ? abs8(w[v]) : w[v];
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const VI xb = bcast4(x.q + (r0 + r) * nb * kgguf::kQBlock + k);
#pragma GCC unroll 2
          for (int v = 0; v < QNV; ++v) {
            const VI s = T::kSignedCodes ? sign_of(xb, w[v]) : xb;
            if constexpr (kVnni) {
              dot[r][v] = dot_u(dot[r][v], u[v], s);
            } else {
              const VI m = pairs(u[v], s);
              p[r][v] = j == j0 ? m : add16(p[r][v], m);
            }
          }
        }
      }
      if constexpr (!kVnni)
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
          for (int v = 0; v < QNV; ++v) dot[r][v] = widen(dot[r][v], p[r][v]);
    }
    const int64_t blk = sb * S / 32;  // the activation block
    V sc[QNV];
#pragma GCC unroll 2
    for (int v = 0; v < QNV; ++v) sc[v] = kv::load(t.scales + sb * QNR + v * W);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * nb + blk;
      const V dx = kv::splat(x.d[at]);
      if constexpr (T::kOffset != 0) {
        // O * d_x * sum(q_x) over the sub-block: hs holds -sum of each half of the block
        const float qsum = S == 32 ? x.ds[at]
                                   : -x.d[at] * static_cast<float>(x.hs[at * 8 + 4 * (sb & 1)]);
        const V off = kv::splat(-static_cast<float>(T::kOffset) * qsum);
#pragma GCC unroll 2
        for (int v = 0; v < QNV; ++v)
          acc[r][v] = kv::fma(kv::fma(to_f(dot[r][v]), dx, off), sc[v], acc[r][v]);
      } else {
#pragma GCC unroll 2
        for (int v = 0; v < QNV; ++v) acc[r][v] = kv::fma(to_f(dot[r][v]) * dx, sc[v], acc[r][v]);
      }
    }
    if constexpr (T::kMins) {  // S == 32: one sub-block per activation block
      V mn[QNV];
#pragma GCC unroll 2
      for (int v = 0; v < QNV; ++v) mn[v] = kv::load(t.mins + blk * QNR + v * W);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const V ds = kv::splat(x.ds[(r0 + r) * nb + blk]);
#pragma GCC unroll 2
        for (int v = 0; v < QNV; ++v) acc[r][v] = kv::fma(mn[v], ds, acc[r][v]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < QNV; ++v) {
      const int64_t c = v * W;
      if (c + W <= cols)
        kv::store(y + r * N + c, acc[r][v]);
      else if (c < cols)
        kv::storen(y + r * N + c, acc[r][v], static_cast<int>(cols - c));
    }
}

// Rows [r0, r1) against one tile (channels n0 ..), in micro-kernels of QMR rows.
template <class F>
void rows_tile(const QActs& x, int64_t K, int64_t N, const Tile& t, int64_t n0, int64_t r0,
               int64_t r1, float* y) {
  const int64_t cols = std::min<int64_t>(QNR, N - n0);
  int64_t r = r0;
  for (; r + QMR <= r1; r += QMR) micro<F, QMR>(x, K, r, t, y + r * N + n0, N, cols);
  float* yr = y + r * N + n0;
  switch (r1 - r) {  // the last, partial block of rows
    case 1: micro<F, 1>(x, K, r, t, yr, N, cols); break;
    case 2: micro<F, 2>(x, K, r, t, yr, N, cols); break;
    case 3: micro<F, 3>(x, K, r, t, yr, N, cols); break;
#if KV_BYTES == 64
    case 4: micro<F, 4>(x, K, r, t, yr, N, cols); break;
    case 5: micro<F, 5>(x, K, r, t, yr, N, cols); break;
#endif
    default: break;  // 0
  }
}

// The whole product for format F: x quantized (rows split across the threads), then the
// tiles split across the threads as packed_gemm.h's drive. Throws std::bad_alloc.
template <class F>
void drive(const uint8_t* w, const float* xf, int64_t M, int64_t K, int64_t N, float* y,
           int64_t block_rows) {
  const int64_t tiles = (N + QNR - 1) / QNR;
  const int64_t mb = block_rows > 0 ? block_rows : kQBlockRows;
  kgguf::QBuffer buffer;
  const QActs x = buffer.reserve(M, K);
  const auto quantize = [&] {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < M; ++r) buffer.quantize_rows(xf, r, r + 1, K);
  };
  const auto range = [&](int64_t first, int64_t last, void* base) {
    const Tile tile = Tile::at(base, K);
    for (int64_t r0 = 0; r0 < M; r0 += mb) {
      const int64_t r1 = std::min(M, r0 + mb);
      for (int64_t i = first; i < last; ++i) {
        if (r0 == 0 || first + 1 != last) decode<F>(w, K, N, i * QNR, tile);  // one: kept
        rows_tile<F>(x, K, N, tile, i * QNR, r0, r1, y);
      }
    }
  };
  // ~4x the fp32 GEMM's rate: a thread is worth waking for 4x the multiply-adds
  for_tile_ranges(tiles, threads_for(tiles, M * K * N / 4), Tile::bytes(K), quantize, range);
}

// y = q8(x) @ W.T for the GGUF ggml type `type` (the caller has checked kgguf::block_shape).
inline void gguf(int type, const uint8_t* w, const float* x, int64_t M, int64_t K, int64_t N,
                 float* y, int64_t block_rows = 0) {
  namespace qd = kgguf::qd;
  switch (type) {
    case kgguf::kQ4_0: return drive<qd::Q4_0>(w, x, M, K, N, y, block_rows);
    case kgguf::kQ4_1: return drive<qd::Q4_1>(w, x, M, K, N, y, block_rows);
    case kgguf::kQ5_0: return drive<qd::Q5_0>(w, x, M, K, N, y, block_rows);
    case kgguf::kQ5_1: return drive<qd::Q5_1>(w, x, M, K, N, y, block_rows);
    case kgguf::kQ8_0: return drive<qd::Q8_0>(w, x, M, K, N, y, block_rows);
    case kgguf::kQ4_K: return drive<qd::Q4_K>(w, x, M, K, N, y, block_rows);
    case kgguf::kQ5_K: return drive<qd::Q5_K>(w, x, M, K, N, y, block_rows);
    default: return drive<qd::Q6_K>(w, x, M, K, N, y, block_rows);
  }
}

}  // namespace q8
}  // namespace
}  // namespace kpg
