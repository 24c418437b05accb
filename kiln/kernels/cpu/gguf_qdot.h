// gguf_qdot.h — y (M, N) = x (M, K) @ W.T from a GGUF tensor's blocks by integer dot products
// with 8-bit activations (gguf_q8.h), for decode-sized M.
//
// Per weight block (gguf_blocks.h lists the layouts), each group of 32 elements is decoded
// in registers to 32 unsigned codes (Q8_0: its signed values; the dot then takes |w| and x
// with w's sign) and dotted with the activation block of the same 32 columns: an int32 vector
// D whose lanes sum to sum(code * q_x) (plus -offset * sum(q_x) for the offset formats).
// Then acc += float(D) * d_x * s_w in fp32, where s_w is the weight scale of the group (the
// block's d; K-quants: d * the sub-block scale; Q6_K: per 16 elements, so per 4 lanes), and
// the formats with mins add min * d_x * sum(q_x) per block (K-quants: the 8 sub-blocks'
// -dmin * mn against 8 consecutive ds values as one vector). Every accumulator is summed
// across lanes at the end.
//
// Kernel: one output row at a time (a sequential stream of blocks) for M (<= 8) activation
// rows, M accumulators of 8 floats (two per row for M <= 2); per group the row's codes and
// scales are decoded once and used for the M rows. More than 8 activation rows run as chunks
// of 8 over the same (cached) weight rows. Threads (drive) split output rows in items of
// kRowsPerItem, as gguf_blocks.h's drive.
#pragma once
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gguf_blocks.h"
#include "gguf_q8.h"

namespace kgguf {
namespace {
// The integer-dot formats (gguf_blocks.h's structs of the same names decode to fp32).
namespace qd {

// The fp16 at p in all 8 lanes, and in lane 0 only (the others 0).
KV_INLINE F8 half_splat(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _mm256_cvtph_ps(_mm_set1_epi16(static_cast<int16_t>(h)));
}
KV_INLINE F8 half_lane0(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _mm256_cvtph_ps(_mm_cvtsi32_si128(h));
}
KV_INLINE I8 bytes(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }
// 16 bytes of nibbles -> 32 codes: element j < 16 the low nibble of byte j, j + 16 its high.
// The 16 bytes in both halves, the upper half shifted right by 4 per 32-bit lane (the bits
// shifted in from the next byte are masked off): one load, one shift, one mask.
KV_INLINE I8 nibbles32(const uint8_t* p) {
  const I8 b = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_srlv_epi32(b, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                          bytes(15));
}
// The u32 at p (little-endian) -> 32 bytes: byte j is 16 where bit j is set, else 0.
KV_INLINE I8 fifth_bits32(const uint8_t* p) {
  uint32_t h;
  std::memcpy(&h, p, 4);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm256_maskz_mov_epi8(h, bytes(16));
#else
  const I8 spread = _mm256_shuffle_epi8(  // byte j = byte j / 8 of h (in both 128-bit halves)
      _mm256_set1_epi32(static_cast<int32_t>(h)),
      _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const I8 bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201));  // 1 << j % 8
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), bytes(16));
#endif
}
// The low (hi = false) or high nibbles of 32 bytes.
KV_INLINE I8 half_bytes(I8 v, bool hi) {
  return _mm256_and_si256(hi ? _mm256_srli_epi16(v, 4) : v, bytes(15));
}

// Each format: kElems / kBytes per block; kBits: bits per code; kShift: log2 of the offset subtracted from the
// codes (-1: none); kSigned: codes are signed values (Q8_0); kMins: a min term per block;
// Pre: what prepare() decodes once per block and row (scales); codes(block, pre, g) and
// scale(pre, g) for the group g of 32 elements; min(pre): the min vector (see the top).
struct Base {
  static constexpr int kShift = -1;
  static constexpr bool kSigned = false, kMins = false;
};

struct Q8_0 : Base {
  static constexpr int kElems = 32, kBytes = 34, kBits = 8;
  static constexpr bool kSigned = true;
  struct Pre { F8 d; };
  static KV_INLINE Pre prepare(const uint8_t* b) { return {half_splat(b)}; }
  static KV_INLINE I8 codes(const uint8_t* b, const Pre&, int) { return load_i8(b + 2); }
  static KV_INLINE F8 scale(const Pre& p, int) { return p.d; }
};

struct Q4_0 : Base {
  static constexpr int kElems = 32, kBytes = 18, kShift = 3, kBits = 4;
  struct Pre { F8 d; };
  static KV_INLINE Pre prepare(const uint8_t* b) { return {half_splat(b)}; }
  static KV_INLINE I8 codes(const uint8_t* b, const Pre&, int) { return nibbles32(b + 2); }
  static KV_INLINE F8 scale(const Pre& p, int) { return p.d; }
};

struct Q5_0 : Base {
  static constexpr int kElems = 32, kBytes = 22, kShift = 4, kBits = 5;
  struct Pre { F8 d; };
  static KV_INLINE Pre prepare(const uint8_t* b) { return {half_splat(b)}; }
  static KV_INLINE I8 codes(const uint8_t* b, const Pre&, int) {
    return _mm256_or_si256(nibbles32(b + 6), fifth_bits32(b + 2));
  }
  static KV_INLINE F8 scale(const Pre& p, int) { return p.d; }
};

struct Q4_1 : Base {
  static constexpr int kElems = 32, kBytes = 20, kBits = 4;
  static constexpr bool kMins = true;
  struct Pre { F8 d, m; };
  static KV_INLINE Pre prepare(const uint8_t* b) { return {half_splat(b), half_lane0(b + 2)}; }
  static KV_INLINE I8 codes(const uint8_t* b, const Pre&, int) { return nibbles32(b + 4); }
  static KV_INLINE F8 scale(const Pre& p, int) { return p.d; }
  static KV_INLINE F8 min(const Pre& p) { return p.m; }
};

struct Q5_1 : Q4_1 {
  static constexpr int kBytes = 24, kBits = 5;
  static KV_INLINE I8 codes(const uint8_t* b, const Pre&, int) {
    return _mm256_or_si256(nibbles32(b + 8), fifth_bits32(b + 4));
  }
};

// Q4_K / Q5_K: d * sc[g] per sub-block (broadcast from memory), -dmin * mn[] as a vector.
struct KPre {
  alignas(32) float sc[8];
  F8 mn;
};
KV_INLINE KPre k_prepare(const uint8_t* b) {
  uint32_t w[3];  // the 12 scale bytes as 3 words: 4 sub-blocks per word
  std::memcpy(w, b + 4, 12);
  const uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, top2 = 0x03030303;
  const uint32_t sc_lo = w[0] & low6, mn_lo = w[1] & low6;
  const uint32_t sc_hi = (w[2] & low4) | (((w[0] >> 6) & top2) << 4);
  const uint32_t mn_hi = ((w[2] >> 4) & low4) | (((w[1] >> 6) & top2) << 4);
  const auto widen = [](uint32_t lo, uint32_t hi) {  // 8 bytes -> 8 floats
    const __m128i b8 = _mm_setr_epi32(static_cast<int32_t>(lo), static_cast<int32_t>(hi), 0, 0);
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b8));
  };
  KPre p;
  _mm256_store_ps(p.sc, _mm256_mul_ps(widen(sc_lo, sc_hi), half_splat(b)));
  const F8 minus_dmin = _mm256_xor_ps(half_splat(b + 2), _mm256_set1_ps(-0.0f));
  p.mn = _mm256_mul_ps(widen(mn_lo, mn_hi), minus_dmin);
  return p;
}

struct Q4_K : Base {
  static constexpr int kElems = 256, kBytes = 144, kBits = 4;
  static constexpr bool kMins = true;
  using Pre = KPre;
  static KV_INLINE Pre prepare(const uint8_t* b) { return k_prepare(b); }
  static KV_INLINE I8 codes(const uint8_t* b, const Pre&, int g) {
    return half_bytes(load_i8(b + 16 + (g >> 1) * 32), g & 1);
  }
  static KV_INLINE F8 scale(const Pre& p, int g) { return _mm256_broadcast_ss(p.sc + g); }
  static KV_INLINE F8 min(const Pre& p) { return p.mn; }
};

struct Q5_K : Q4_K {
  static constexpr int kBytes = 176, kBits = 5;
  static KV_INLINE I8 codes(const uint8_t* b, const Pre&, int g) {
    const I8 high = _mm256_slli_epi16(_mm256_srli_epi16(load_i8(b + 16), g), 4);  // bit g -> 4
    return _mm256_or_si256(half_bytes(load_i8(b + 48 + (g >> 1) * 32), g & 1),
                           _mm256_and_si256(high, bytes(16)));
  }
};

// Q6_K: 16 int8 scales times d as two vectors; a group's lanes 0-3 take scale 2g, 4-7 2g + 1.
struct Q6_K : Base {
  static constexpr int kElems = 256, kBytes = 210, kShift = 5, kBits = 6;
  struct Pre { F8 lo, hi; };
  static KV_INLINE Pre prepare(const uint8_t* b) {
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    const F8 d = half_splat(b + 208);
    return {_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), d),
            _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))), d)};
  }
  static KV_INLINE I8 codes(const uint8_t* b, const Pre&, int g) {
    const int h = g >> 2, i = g & 3;  // half of the block, quarter of the half
    const I8 low = half_bytes(load_i8(b + 64 * h + 32 * (i & 1)), i >= 2);
    const I8 qh = load_i8(b + 128 + 32 * h);  // bits 2i, 2i + 1 -> bits 4, 5
    const I8 high = i == 0 ? _mm256_slli_epi16(qh, 4)
                    : i == 1 ? _mm256_slli_epi16(qh, 2)
                    : i == 2 ? qh
                             : _mm256_srli_epi16(qh, 2);
    return _mm256_or_si256(low, _mm256_and_si256(high, bytes(0x30)));
  }
  static KV_INLINE F8 scale(const Pre& p, int g) {
    const int j = 2 * (g & 3);
    return _mm256_permutevar8x32_ps(g < 4 ? p.lo : p.hi,
                                    _mm256_setr_epi32(j, j, j, j, j + 1, j + 1, j + 1, j + 1));
  }
};

// The ds operand of a block's min term: one value (lane 0 of the min vector) or 8 (K-quants).
template <class F>
KV_INLINE F8 min_x(const float* ds, int64_t blk) {
  if constexpr (F::kElems == 32) return _mm256_broadcast_ss(ds + blk);
  return _mm256_loadu_ps(ds + blk * 8);
}

struct Args {
  QActs x;  // M rows of 8-bit blocks (gguf_q8.h)
  int64_t M, K, N;
  const uint8_t* w;  // (N, K / F::kElems * F::kBytes): the tensor's rows as stored
  int type;          // ggml_type id
  float* y;          // (M, N)
};

// Accumulators per activation row: one row's groups all add into its accumulator, so with
// one or two activation rows the groups alternate between two (the add's latency is longer
// than a group's other work).
constexpr int splits(int m) { return m <= 2 ? 2 : 1; }

// Output row n for activation rows r0 .. r0 + M - 1. One weight row at a time: a run of
// rows is one sequential stream, which the hardware prefetcher follows; 2-4 rows side by
// side (decoding shared per group of x) were as many short streams and read 2-3x slower
// from DRAM (Q8_0 1536 x 576, 1 thread, AMD EPYC Zen 4: 9.4 GB/s at 4 rows, 27 at 1).
template <class F, int M>
inline void row(const Args& a, int64_t n, int64_t r0) {
  constexpr int G = F::kElems / kQBlock, S = splits(M);
  constexpr int BS = G >= S ? 1 : S / G;  // blocks per iteration: at least S groups
  const int64_t blocks = a.K / F::kElems, nb = a.x.nb;
  const uint8_t* w = a.w + n * blocks * F::kBytes;
  F8 acc[S][M];
#pragma GCC unroll 2
  for (int s = 0; s < S; ++s)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[s][m] = _mm256_setzero_ps();
  // Block blk, the bi-th of its iteration: group g adds into accumulator (bi G + g) % S.
  const auto block = [&](int64_t blk, int bi) __attribute__((always_inline)) {
    const uint8_t* wb = w + blk * F::kBytes;
    const typename F::Pre pre = F::prepare(wb);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const int s = (bi * G + g) % S;
      const I8 u = F::codes(wb, pre, g);
      const F8 scale = F::scale(pre, g);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const int64_t at = (r0 + m) * nb + blk * G + g;  // the activation block
        const I8 xq = load_i8(a.x.q + at * kQBlock);
        I8 dot;
        if constexpr (F::kSigned) {  // |w| . (x with w's sign)
          dot = dot_acc(_mm256_setzero_si256(), _mm256_abs_epi8(u), _mm256_sign_epi8(xq, u));
        } else {  // from -offset * sum(q_x)
          I8 init = _mm256_setzero_si256();
          if constexpr (F::kShift >= 0)
            init = _mm256_slli_epi32(load_i8(a.x.hs + at * 8), F::kShift);
          dot = dot_acc(init, u, xq);
        }
        const F8 dx = _mm256_broadcast_ss(a.x.d + at);
        acc[s][m] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), dx), scale, acc[s][m]);
      }
    }
    if constexpr (F::kMins) {
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const F8 xs = min_x<F>(a.x.ds + (r0 + m) * nb, blk);
        acc[bi % S][m] = _mm256_fmadd_ps(F::min(pre), xs, acc[bi % S][m]);
      }
    }
  };
  int64_t blk = 0;
  for (; blk + BS <= blocks; blk += BS)
#pragma GCC unroll 2
    for (int bi = 0; bi < BS; ++bi) block(blk + bi, bi);
  for (; blk < blocks; ++blk) block(blk, 0);
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m)
    a.y[(r0 + m) * a.N + n] = hsum8(S == 2 ? _mm256_add_ps(acc[0][m], acc[S - 1][m]) : acc[0][m]);
}

template <class F, int M>
inline void rows_range(const Args& a, int64_t n0, int64_t n1, int64_t r0) {
  for (int64_t n = n0; n < n1; ++n) row<F, M>(a, n, r0);
}

// Output rows [n0, n1) for every activation row, in chunks of <= 8 rows.
template <class F>
inline void rows_all(const Args& a, int64_t n0, int64_t n1) {
  for_row_chunks(a.M, [&](auto m, int64_t r0) { rows_range<F, decltype(m)::value>(a, n0, n1, r0); });
}

// Output rows [n0, n1), all activation rows, on the calling thread (the decode step's unit).
// The caller has checked the type (block_shape).
inline void run_rows(const Args& a, int64_t n0, int64_t n1) {
  switch (a.type) {
    case kQ4_0: return rows_all<Q4_0>(a, n0, n1);
    case kQ4_1: return rows_all<Q4_1>(a, n0, n1);
    case kQ5_0: return rows_all<Q5_0>(a, n0, n1);
    case kQ5_1: return rows_all<Q5_1>(a, n0, n1);
    case kQ8_0: return rows_all<Q8_0>(a, n0, n1);
    case kQ4_K: return rows_all<Q4_K>(a, n0, n1);
    case kQ5_K: return rows_all<Q5_K>(a, n0, n1);
    default: return rows_all<Q6_K>(a, n0, n1);
  }
}

// The whole product: output rows split across threads in items of kRowsPerItem.
inline void drive(const Args& a) {
  const int64_t items = (a.N + kRowsPerItem - 1) / kRowsPerItem;
  const int64_t nt = threads_for(items, a.N * a.K);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
  for (int64_t i = 0; i < items; ++i)
    run_rows(a, i * kRowsPerItem, std::min(a.N, (i + 1) * kRowsPerItem));
}

}  // namespace qd
}  // namespace
}  // namespace kgguf
