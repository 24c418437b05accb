// woq_vec.h — the few SIMD operations kiln's weight-only quantized matmuls need (namespace wv).
//
// One float vector type V of W lanes: AVX-512 (W = 16, zmm) when the compiler targets
// AVX-512F, AVX2 + FMA + F16C (W = 8, ymm) otherwise. The ISA is fixed at build time by
// -march=native (woq.py keys its build cache on the CPU's flags), so nothing here dispatches
// at run time. Weight loads widen W int8 / uint8 / fp16 values to W fp32 lanes exactly.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#define WV_INLINE inline __attribute__((always_inline))

namespace wv {

#if defined(__AVX512F__)
constexpr int W = 16;
typedef __m512 V;
typedef __m512i VI;
WV_INLINE V zero() { return _mm512_setzero_ps(); }
WV_INLINE V bcast(const float* p) { return _mm512_set1_ps(*p); }
WV_INLINE V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
WV_INLINE V add(V a, V b) { return _mm512_add_ps(a, b); }
WV_INLINE V mul(V a, V b) { return _mm512_mul_ps(a, b); }
WV_INLINE V load(const float* p) { return _mm512_loadu_ps(p); }
WV_INLINE void store(float* p, V v) { _mm512_storeu_ps(p, v); }
// W signed bytes -> W floats.
WV_INLINE V load_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
// W unsigned bytes -> W int32 lanes (each holding two nibbles).
WV_INLINE VI load_u8(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
}
WV_INLINE V low_nibble(VI d) {
  return _mm512_cvtepi32_ps(_mm512_and_si512(d, _mm512_set1_epi32(15)));
}
WV_INLINE V high_nibble(VI d) { return _mm512_cvtepi32_ps(_mm512_srli_epi32(d, 4)); }
// W fp16 values -> W floats (exact).
WV_INLINE V load_f16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int W = 8;
typedef __m256 V;
typedef __m256i VI;
WV_INLINE V zero() { return _mm256_setzero_ps(); }
WV_INLINE V bcast(const float* p) { return _mm256_broadcast_ss(p); }
WV_INLINE V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
WV_INLINE V add(V a, V b) { return _mm256_add_ps(a, b); }
WV_INLINE V mul(V a, V b) { return _mm256_mul_ps(a, b); }
WV_INLINE V load(const float* p) { return _mm256_loadu_ps(p); }
WV_INLINE void store(float* p, V v) { _mm256_storeu_ps(p, v); }
WV_INLINE V load_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
WV_INLINE VI load_u8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
}
WV_INLINE V low_nibble(VI d) {
  return _mm256_cvtepi32_ps(_mm256_and_si256(d, _mm256_set1_epi32(15)));
}
WV_INLINE V high_nibble(VI d) { return _mm256_cvtepi32_ps(_mm256_srli_epi32(d, 4)); }
WV_INLINE V load_f16(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
}
#else
#error "woq_vec.h needs AVX2+FMA+F16C or AVX-512F: compile with -march=native on such a CPU"
#endif

// Stores lanes [0, n) of v to p (n <= W); the full-width case is one unaligned store.
WV_INLINE void store_n(float* p, V v, int64_t n) {
  if (n >= W) {
    store(p, v);
    return;
  }
  alignas(64) float tmp[W];
  store(tmp, v);
  std::memcpy(p, tmp, sizeof(float) * n);
}

}  // namespace wv
