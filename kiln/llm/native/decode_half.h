// decode_half.h — the storage types a decode step reads: fp32, bf16 and fp16, as fp32 lanes.
//
// A bf16 or fp16 model keeps its weights, embedding table and KV cache in 16 bits: half the
// bytes of fp32, so a memory-bound decode step reads half as much. The step still computes
// in fp32: each 16-bit value is widened in registers as it is loaded (bf16: the bits
// shifted into a float's upper half, exact; fp16: the F16C conversion, exact), and values
// written back (the new key/value rows) are rounded to nearest-even, as torch's .to() does.
// Everything here is templated on the storage code S so that the fp32 case compiles to the
// plain float loads it replaces.
#pragma once
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kiln_vec.h"

namespace kdec {

// Storage codes (decode.py STORAGE): fp32, bf16, fp16.
enum : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

typedef uint16_t VH __attribute__((vector_size(kv::W * 2)));  // W 16-bit values

template <int S>
KV_INLINE kv::V widen(VH h) {
  if constexpr (S == kBF16) {
    return kv::as_float(__builtin_convertvector(h, kv::VI) << 16);
  } else {
    static_assert(S == kF16, "widen: a 16-bit storage code");
#if KV_BYTES == 64
    __m256i bits;
    std::memcpy(&bits, &h, sizeof h);
    return (kv::V)_mm512_cvtph_ps(bits);
#else
    __m128i bits;
    std::memcpy(&bits, &h, sizeof h);
    return (kv::V)_mm256_cvtph_ps(bits);
#endif
  }
}

// W values of storage S from element i of p, as floats.
template <int S>
KV_INLINE kv::V load_as(const void* p, int64_t i) {
  if constexpr (S == kF32) {
    return kv::load(static_cast<const float*>(p) + i);
  } else {
    VH h;
    std::memcpy(&h, static_cast<const uint16_t*>(p) + i, sizeof h);
    return widen<S>(h);
  }
}

// Lanes [0, n) from element i of p, zeros elsewhere; reads nothing past element i + n - 1.
template <int S>
KV_INLINE kv::V load_as_n(const void* p, int64_t i, int n) {
  if constexpr (S == kF32) {
    return kv::loadn(static_cast<const float*>(p) + i, n, 0.0f);
  } else {
    VH h{};  // +0.0 in both formats
    std::memcpy(&h, static_cast<const uint16_t*>(p) + i, sizeof(uint16_t) * n);
    return widen<S>(h);
  }
}

inline float half_to_float(uint16_t h, int s) {
  if (s == kBF16) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
  return _cvtsh_ss(h);
}

// fp32 -> bf16 / fp16, round to nearest-even (NaN stays NaN).
inline uint16_t float_to_half(float f, int s) {
  if (s == kF16) return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if (std::isnan(f)) return static_cast<uint16_t>((bits >> 16) | 0x40);  // quiet NaN
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// dst[0 .. n) = src[i .. i + n) as floats.
inline void read_row(const void* src, int s, int64_t i, float* dst, int64_t n) {
  if (s == kF32) {
    std::memcpy(dst, static_cast<const float*>(src) + i, sizeof(float) * n);
    return;
  }
  const uint16_t* h = static_cast<const uint16_t*>(src) + i;
  for (int64_t j = 0; j < n; ++j) dst[j] = half_to_float(h[j], s);
}

// dst[i .. i + n) = src[0 .. n), rounded to storage s.
inline void write_row(const float* src, void* dst, int s, int64_t i, int64_t n) {
  if (s == kF32) {
    std::memcpy(static_cast<float*>(dst) + i, src, sizeof(float) * n);
    return;
  }
  uint16_t* h = static_cast<uint16_t*>(dst) + i;
  for (int64_t j = 0; j < n; ++j) h[j] = float_to_half(src[j], s);
}

inline int64_t storage_bytes(int s) { return s == kF32 ? 4 : 2; }

}  // namespace kdec
