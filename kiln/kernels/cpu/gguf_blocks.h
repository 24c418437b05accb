// gguf_blocks.h — y (M, N) = x (M, K) @ W.T with W held as the raw blocks of one GGUF tensor.
//
// The weight stays exactly as the file stores it: row n is K / block elements of blocks, one
// after the other ((N, K / elems * bytes) uint8). Nothing is expanded to float in memory: per
// block, the kernel decodes the scales (scalars) and the quants of 32 consecutive elements (a
// "group") into 32 / W float vectors in registers, and FMAs them with the activations in fp32.
// This is the exact path (fp32 activations); gguf_qdot.h multiplies the same blocks with
// activations quantized to 8 bits (integer dot products, the default at decode).
// Header-only (namespace kgguf), so the CPython module (gguf_blocks.cpp) and the decode step
// (kiln/llm/native/decode.cpp) include the one copy. SIMD through kiln_vec.h: AVX-512 (W = 16)
// or AVX2 (W = 8), whichever the compiler targets.
//
// Block layouts (ggml's definitions; fp16 = IEEE half, little-endian; "nibble j" of a 16-byte
// run holds element j in the low 4 bits and element j + 16 in the high 4 bits):
//   Q4_0  32 el, 18 B: d fp16, 16 B nibbles q;                      w = d * (q - 8)
//   Q4_1  32 el, 20 B: d, m fp16, 16 B nibbles q;                   w = d * q + m
//   Q5_0  32 el, 22 B: d, qh u32 (bit j: 5th bit of element j), nibbles; w = d * (q - 16)
//   Q5_1  32 el, 24 B: d, m, qh u32, nibbles;                       w = d * q + m
//   Q8_0  32 el, 34 B: d fp16, 32 int8 q;                           w = d * q
//   Q4_K 256 el, 144 B: d, dmin fp16, 12 B of 6-bit scales / mins (8 sub-blocks of 32),
//        128 B of quants: 32-byte run c holds sub-block 2c (low nibbles) and 2c + 1 (high);
//        w = d * sc[s] * q - dmin * mn[s] for sub-block s.
//   Q5_K 256 el, 176 B: as Q4_K, then qh[32] (bit s of qh[l]: 5th bit of element 32 s + l),
//        then the 128 B of nibbles.
//   Q6_K 256 el, 210 B: ql[128] (4 low bits), qh[64] (2 high bits), int8 scales[16] (one per
//        16 elements), d fp16 last; element 128 h + 32 i + l (i in 0..3) takes ql[64 h +
//        32 (i & 1) + l] (low nibble for i < 2, else high), bits 2i..2i+1 of qh[32 h + l];
//        w = d * sc[e / 16] * (q - 32).
// The 6-bit scale / min of Q4_K / Q5_K sub-block j < 4: sc = s[j] & 63, mn = s[j + 4] & 63;
// j >= 4: sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4, mn = (s[j + 4] >> 4) | (s[j] >> 6) << 4.
//
// Kernel: R output rows x M (<= 8) activation rows keep R x M accumulator vectors (split in
// two over alternate vectors when there are few, for more FMA chains in flight); per group
// the R rows' weights are decoded once and used for the M rows; each accumulator is summed
// across lanes at the end. More than 8 rows run as chunks of 8 over the same (cached) rows.
// Threads (drive): output rows split across OpenMP threads in items of kRowsPerItem; the
// extension links libgomp.so.1, which resolves to torch's copy (torch's one thread pool).
#pragma once
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kiln_vec.h"

namespace kgguf {
namespace {  // internal linkage: each extension including this gets its own copy

using kv::V;
using kv::VI;
using kv::W;

constexpr int kGroup = 32;         // elements decoded at a time
constexpr int kVecs = kGroup / W;  // vectors per group: 2 (AVX-512) or 4 (AVX2)
// ggml_type ids (gguf.GGMLQuantizationType).
enum : int { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13,
             kQ6_K = 14 };
// Output rows per unit of parallel work (a multiple of every block height R).
constexpr int64_t kRowsPerItem = 16;
// A thread is only worth waking for this many weights (as woq.h).
constexpr int64_t kMinWeightsPerThread = 1 << 16;

KV_INLINE float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
KV_INLINE V to_f(VI v) { return __builtin_convertvector(v, V); }
// The 4-bit codes of elements e0 .. e0 + W of a 32-element run of nibbles at q (e0 % W == 0).
KV_INLINE VI nibbles(const uint8_t* q, int e0) {
  const VI b = kv::widen_u8(q + (e0 & 15));
  return e0 < 16 ? (b & 15) : (b >> 4);
}
// The bits e0 .. e0 + W of the 32-bit word qh (little-endian at p), one per lane, as 0 / 16.
KV_INLINE VI fifth_bits(const uint8_t* p, int e0) {
  uint32_t qh;
  std::memcpy(&qh, p, 4);
  return ((kv::splati(static_cast<int32_t>(qh)) >> (kv::iota_i() + e0)) & 1) << 4;
}
// Q4_K / Q5_K: the 6-bit scale and min of sub-block j from the 12 packed bytes s.
KV_INLINE void scale_min(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63, mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Each format: kElems and kBytes per block, and group(block, g, w) decoding elements
// [32 g, 32 g + 32) of the block into w[0 .. kVecs) in element order.
struct Q8_0 {
  static constexpr int kElems = 32, kBytes = 34;
  static KV_INLINE void group(const uint8_t* b, int, V (&w)[kVecs]) {
    const V d = kv::splat(f16(b));
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v)
      w[v] = kv::widen_i8(reinterpret_cast<const int8_t*>(b + 2 + v * W)) * d;
  }
};

struct Q4_0 {
  static constexpr int kElems = 32, kBytes = 18;
  static KV_INLINE void group(const uint8_t* b, int, V (&w)[kVecs]) {
    const V d = kv::splat(f16(b));
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) w[v] = to_f(nibbles(b + 2, v * W) - 8) * d;
  }
};

struct Q4_1 {
  static constexpr int kElems = 32, kBytes = 20;
  static KV_INLINE void group(const uint8_t* b, int, V (&w)[kVecs]) {
    const V d = kv::splat(f16(b)), m = kv::splat(f16(b + 2));
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) w[v] = kv::fma(to_f(nibbles(b + 4, v * W)), d, m);
  }
};

struct Q5_0 {
  static constexpr int kElems = 32, kBytes = 22;
  static KV_INLINE void group(const uint8_t* b, int, V (&w)[kVecs]) {
    const V d = kv::splat(f16(b));
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v)
      w[v] = to_f((nibbles(b + 6, v * W) | fifth_bits(b + 2, v * W)) - 16) * d;
  }
};

struct Q5_1 {
  static constexpr int kElems = 32, kBytes = 24;
  static KV_INLINE void group(const uint8_t* b, int, V (&w)[kVecs]) {
    const V d = kv::splat(f16(b)), m = kv::splat(f16(b + 2));
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v)
      w[v] = kv::fma(to_f(nibbles(b + 8, v * W) | fifth_bits(b + 4, v * W)), d, m);
  }
};

struct Q4_K {
  static constexpr int kElems = 256, kBytes = 144;
  static KV_INLINE void group(const uint8_t* b, int g, V (&w)[kVecs]) {
    int sc, mn;
    scale_min(b + 4, g, sc, mn);
    const V d = kv::splat(f16(b) * static_cast<float>(sc));
    const V m = kv::splat(-(f16(b + 2) * static_cast<float>(mn)));
    const uint8_t* q = b + 16 + (g >> 1) * 32;  // sub-block g: nibbles of run g / 2
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) {
      const VI byte = kv::widen_u8(q + v * W);
      w[v] = kv::fma(to_f((g & 1) ? (byte >> 4) : (byte & 15)), d, m);
    }
  }
};

struct Q5_K {
  static constexpr int kElems = 256, kBytes = 176;
  static KV_INLINE void group(const uint8_t* b, int g, V (&w)[kVecs]) {
    int sc, mn;
    scale_min(b + 4, g, sc, mn);
    const V d = kv::splat(f16(b) * static_cast<float>(sc));
    const V m = kv::splat(-(f16(b + 2) * static_cast<float>(mn)));
    const uint8_t* qh = b + 16;
    const uint8_t* q = b + 48 + (g >> 1) * 32;
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) {
      const VI byte = kv::widen_u8(q + v * W);
      const VI high = ((kv::widen_u8(qh + v * W) >> g) & 1) << 4;
      w[v] = kv::fma(to_f(((g & 1) ? (byte >> 4) : (byte & 15)) | high), d, m);
    }
  }
};

struct Q6_K {
  static constexpr int kElems = 256, kBytes = 210;
  static KV_INLINE void group(const uint8_t* b, int g, V (&w)[kVecs]) {
    const int h = g >> 2, i = g & 3;  // half of the block, quarter of the half
    const uint8_t* ql = b + 64 * h + 32 * (i & 1);
    const uint8_t* qh = b + 128 + 32 * h;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = f16(b + 208);
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) {
      const VI low = kv::widen_u8(ql + v * W);
      const VI high = (kv::widen_u8(qh + v * W) >> (2 * i)) & 3;
      const VI q = ((i < 2) ? (low & 15) : (low >> 4)) | (high << 4);
      w[v] = to_f(q - 32) * kv::splat(d * static_cast<float>(sc[(kGroup * g + v * W) / 16]));
    }
  }
};

struct Args {
  const float* x;     // (M, K) row-major
  int64_t M, K, N;
  const uint8_t* w;   // (N, K / F::kElems * F::kBytes): the tensor's rows as stored
  int type;           // ggml_type id
  const float* bias;  // (N,) or nullptr
  float* y;           // (M, N)
};

// Block heights: R output rows per pass, so that R x M accumulators, R x kVecs weights and
// the decoding temporaries fit the 32 zmm (16 ymm) registers.
constexpr int block_rows(int m) {
  return W == 16 ? (m <= 2 ? 4 : 2) : (m <= 2 ? 2 : 1);
}

// Output rows n0 .. n0 + R - 1 for activation rows r0 .. r0 + M - 1.
template <class F, int M, int R>
inline void rows_block(const Args& a, int64_t n0, int64_t r0) {
  constexpr int S = (M * R <= 4) ? 2 : 1;  // split accumulators over alternate vectors
  const int64_t K = a.K, blocks = K / F::kElems, row_bytes = blocks * F::kBytes;
  const uint8_t* w = a.w + n0 * row_bytes;
  const float* x = a.x + r0 * K;
  V acc[S][M][R];
#pragma GCC unroll 2
  for (int s = 0; s < S; ++s)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[s][m][r] = kv::splat(0.0f);
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const uint8_t* wb = w + blk * F::kBytes;
    for (int g = 0; g < F::kElems / kGroup; ++g) {
      V wv[R][kVecs];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) F::group(wb + r * row_bytes, g, wv[r]);
      const float* xg = x + blk * F::kElems + g * kGroup;
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
        for (int v = 0; v < kVecs; ++v) {
          const V xv = kv::load(xg + m * K + v * W);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r)
            acc[v % S][m][r] = kv::fma(xv, wv[r][v], acc[v % S][m][r]);
        }
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      float s = kv::hsum(S == 2 ? acc[0][m][r] + acc[S - 1][m][r] : acc[0][m][r]);
      if (a.bias != nullptr) s += a.bias[n0 + r];
      a.y[(r0 + m) * a.N + n0 + r] = s;
    }
}

template <class F, int M>
inline void rows_range(const Args& a, int64_t n0, int64_t n1, int64_t r0) {
  constexpr int R = block_rows(M);
  int64_t n = n0;
  for (; n + R <= n1; n += R) rows_block<F, M, R>(a, n, r0);
  for (; n < n1; ++n) rows_block<F, M, 1>(a, n, r0);
}

// Calls f(std::integral_constant<int, M>{}, r0) for the activation rows in chunks of
// M <= 8 starting at r0: the kernels' row count is a compile-time constant.
template <class Fn>
inline void for_row_chunks(int64_t rows, Fn&& f) {
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    switch (std::min<int64_t>(8, rows - r0)) {
      case 1: f(std::integral_constant<int, 1>{}, r0); break;
      case 2: f(std::integral_constant<int, 2>{}, r0); break;
      case 3: f(std::integral_constant<int, 3>{}, r0); break;
      case 4: f(std::integral_constant<int, 4>{}, r0); break;
      case 5: f(std::integral_constant<int, 5>{}, r0); break;
      case 6: f(std::integral_constant<int, 6>{}, r0); break;
      case 7: f(std::integral_constant<int, 7>{}, r0); break;
      default: f(std::integral_constant<int, 8>{}, r0);
    }
  }
}

// Output rows [n0, n1) for every activation row, in chunks of <= 8 rows.
template <class F>
inline void rows_all(const Args& a, int64_t n0, int64_t n1) {
  for_row_chunks(a.M, [&](auto m, int64_t r0) { rows_range<F, decltype(m)::value>(a, n0, n1, r0); });
}

// Elements per block and bytes per block of ggml type `type`; false for a type not here.
inline bool block_shape(int type, int64_t& elems, int64_t& bytes) {
  switch (type) {
    case kQ4_0: elems = Q4_0::kElems, bytes = Q4_0::kBytes; return true;
    case kQ4_1: elems = Q4_1::kElems, bytes = Q4_1::kBytes; return true;
    case kQ5_0: elems = Q5_0::kElems, bytes = Q5_0::kBytes; return true;
    case kQ5_1: elems = Q5_1::kElems, bytes = Q5_1::kBytes; return true;
    case kQ8_0: elems = Q8_0::kElems, bytes = Q8_0::kBytes; return true;
    case kQ4_K: elems = Q4_K::kElems, bytes = Q4_K::kBytes; return true;
    case kQ5_K: elems = Q5_K::kElems, bytes = Q5_K::kBytes; return true;
    case kQ6_K: elems = Q6_K::kElems, bytes = Q6_K::kBytes; return true;
    default: return false;
  }
}

// Calls f(F{}) with the format struct of `type` (the caller has checked block_shape).
template <class Fn>
inline void with_format(int type, Fn&& f) {
  switch (type) {
    case kQ4_0: return f(Q4_0{});
    case kQ4_1: return f(Q4_1{});
    case kQ5_0: return f(Q5_0{});
    case kQ5_1: return f(Q5_1{});
    case kQ8_0: return f(Q8_0{});
    case kQ4_K: return f(Q4_K{});
    case kQ5_K: return f(Q5_K{});
    default: return f(Q6_K{});
  }
}

// Output rows [n0, n1), all activation rows, on the calling thread (the decode step's unit).
inline void run_rows(const Args& a, int64_t n0, int64_t n1) {
  with_format(a.type, [&](auto fmt) { rows_all<decltype(fmt)>(a, n0, n1); });
}

// Threads for `weights` weights spread over `items` work items (1 inside a parallel region).
inline int64_t threads_for(int64_t items, int64_t weights) {
  const int64_t nt = omp_in_parallel() ? 1 : omp_get_max_threads();
  return std::max<int64_t>(1, std::min({nt, items, weights / kMinWeightsPerThread}));
}

// The whole product: output rows split across threads in items of kRowsPerItem.
inline void drive(const Args& a) {
  const int64_t items = (a.N + kRowsPerItem - 1) / kRowsPerItem;
  const int64_t nt = threads_for(items, a.N * a.K);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
  for (int64_t i = 0; i < items; ++i)
    run_rows(a, i * kRowsPerItem, std::min(a.N, (i + 1) * kRowsPerItem));
}

// Rows [0, rows) of the weight as float32 (rows, K) into out: the same decoding, stored.
inline void dequantize(int type, const uint8_t* w, int64_t rows, int64_t K, float* out) {
  const int64_t nt = threads_for(rows, rows * K);
  with_format(type, [&](auto fmt) {
    using F = decltype(fmt);
    const int64_t blocks = K / F::kElems, row_bytes = blocks * F::kBytes;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t n = 0; n < rows; ++n)
      for (int64_t blk = 0; blk < blocks; ++blk)
        for (int g = 0; g < F::kElems / kGroup; ++g) {
          V wv[kVecs];
          F::group(w + n * row_bytes + blk * F::kBytes, g, wv);
          float* o = out + n * K + blk * F::kElems + g * kGroup;
#pragma GCC unroll 4
          for (int v = 0; v < kVecs; ++v) kv::store(o + v * W, wv[v]);
        }
  });
}

}  // namespace
}  // namespace kgguf
