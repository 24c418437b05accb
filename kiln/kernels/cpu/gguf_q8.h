// gguf_q8.h — activations quantized to 8-bit blocks, and the integer dot product of the
// GGUF integer-dot kernels (gguf_qdot.h).
//
// At decode a GGUF matmul streams every weight once; decoding each to fp32 and FMAing in
// fp32 (gguf_blocks.h) makes it compute-bound. The integer path instead quantizes the
// activations once per call, per block of 32 elements: q = round(x / d) in int8 with
// d = max|x| / 127 (llama.cpp's Q8_0 / Q8_1 activation blocks), and multiplies 32 unsigned
// weight codes with 32 int8 activations as one integer dot product, 4 products summed per
// int32 lane: AVX-512 VNNI `vpdpbusd` (ymm, needs AVX512VL), AVX-VNNI's VEX form, or AVX2
// `vpmaddubsw` + `vpmaddwd`. A block's int32 lanes are then scaled in fp32 by the two
// blocks' scales. Offsets (Q4_0's -8, Q5_0's -16, Q6_K's -32) enter the integer dot through
// its starting value, -offset * sum(q) (hs below); mins (Q4_1, Q5_1, Q4_K, Q5_K) through
// d * sum(q) (ds), in fp32.
//
// Exactness: the integer dots are exact; the activations carry a rounding error of at most
// d / 2 = max|x| / 254 per element of each block (llama.cpp's own arithmetic). Non-finite
// activations make the block's scale NaN, so a NaN or inf input gives NaN outputs as the fp32
// path does, instead of silently quantizing to garbage.
//
// Everything here works on 256-bit vectors (one block of 32 int8 is one ymm), in both the
// AVX-512 and the AVX2 builds.
#pragma once
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kiln_vec.h"

namespace kgguf {
namespace {

using I8 = __m256i;  // 32 int8 / uint8, or 8 int32
using F8 = __m256;   // 8 floats

constexpr int kQBlock = 32;  // activation elements per 8-bit block

// acc + per int32 lane the sum of 4 consecutive products u (unsigned) x s (signed). Without
// VNNI: maddubs sums pairs into saturating int16, which these codes never reach (|s| <= 127,
// u <= 63, or u <= 128 for Q8_0's |w|: 2 * 128 * 127 < 32767).
KV_INLINE I8 dot_acc(I8 acc, I8 u, I8 s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  const I8 pairs = _mm256_maddubs_epi16(u, s);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

// Which dot product this build uses (reported by the extensions).
constexpr const char* kDotIsa =
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    "avx512_vnni";
#elif defined(__AVXVNNI__)
    "avx_vnni";
#else
    "avx2";
#endif

KV_INLINE I8 load_i8(const void* p) { return _mm256_loadu_si256(static_cast<const I8*>(p)); }

KV_INLINE float hsum8(F8 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

KV_INLINE int32_t hsum8i(I8 v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

// M rows of K activations as 8-bit blocks (nb = K / 32 per row), structure of arrays.
struct QActs {
  const int8_t* q;    // (M, nb, 32) the int8 values
  const float* d;     // (M, nb) scales: x ~ d * q
  const float* ds;    // (M, nb) d * sum(q): the mins' term
  const int32_t* hs;  // (M, nb, 8) int32 lanes {-sum(q[0:16]), 0, 0, 0, -sum(q[16:32]), 0, 0, 0}
  int64_t nb;
};

// One block: 32 floats at x -> q, d, ds, hs (see QActs).
inline void quantize_block(const float* x, int8_t* q, float& d, float& ds, int32_t* hs) {
  F8 v[4];
  const F8 sign = _mm256_set1_ps(-0.0f);
  F8 amax = _mm256_setzero_ps(), inf_nan = _mm256_setzero_ps();
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    inf_nan = _mm256_add_ps(inf_nan, _mm256_sub_ps(v[i], v[i]));  // NaN where x is inf / NaN
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  const float top = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  const float scale = top / 127.0f, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
  I8 n[4];  // round half to even (the default rounding mode), |n| <= 127
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)
    n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
  const int32_t lo = hsum8i(_mm256_add_epi32(n[0], n[1]));
  const int32_t hi = hsum8i(_mm256_add_epi32(n[2], n[3]));
  // The narrowing packs work within 128-bit halves: dword j of the packed bytes holds
  // elements 4 p(j) .. 4 p(j) + 3 with p = 0 2 4 6 1 3 5 7; the permute restores the order.
  const I8 bytes =
      _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
  const I8 order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<I8*>(q), _mm256_permutevar8x32_epi32(bytes, order));
  const bool finite = _mm256_movemask_ps(_mm256_cmp_ps(inf_nan, inf_nan, _CMP_UNORD_Q)) == 0;
  d = finite ? scale : std::numeric_limits<float>::quiet_NaN();
  ds = d * static_cast<float>(lo + hi);
  const int32_t lanes[8] = {-lo, 0, 0, 0, -hi, 0, 0, 0};
  std::memcpy(hs, lanes, sizeof lanes);
}

// Owns the 8-bit blocks of a call's activations.
struct QBuffer {
  std::vector<int8_t> q;
  std::vector<float> d, ds;
  std::vector<int32_t> hs;

  // Sizes the buffer for M rows of K (a multiple of 32) and returns the view of the blocks
  // quantize_rows fills.
  QActs reserve(int64_t M, int64_t K) {
    const int64_t nb = K / kQBlock, n = M * nb;
    q.resize(static_cast<size_t>(n * kQBlock));
    d.resize(static_cast<size_t>(n));
    ds.resize(static_cast<size_t>(n));
    hs.resize(static_cast<size_t>(n * 8));
    return QActs{q.data(), d.data(), ds.data(), hs.data(), nb};
  }

  // Quantizes rows [r0, r1) of x (M, K) row-major into the reserved buffer (threads may
  // fill disjoint ranges).
  void quantize_rows(const float* x, int64_t r0, int64_t r1, int64_t K) {
    const int64_t nb = K / kQBlock;
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t i = r * nb + b;
        quantize_block(x + r * K + b * kQBlock, q.data() + i * kQBlock, d[i], ds[i],
                       hs.data() + i * 8);
      }
  }

  // Quantizes x (M, K) row-major (K a multiple of 32) and returns the view of the blocks.
  QActs quantize(const float* x, int64_t M, int64_t K) {
    const QActs view = reserve(M, K);
    quantize_rows(x, 0, M, K);
    return view;
  }
};

}  // namespace
}  // namespace kgguf
