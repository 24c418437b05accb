// kiln_vec.h — portable SIMD float math for kiln's C++ (namespace kv): the compiler's generated
// programs, the weight-only INT8 / INT4 kernels (kiln/kernels/cpu/woq.h, which also use the
// weight loads section) and the decode step (kiln/llm/native).
//
// One vector type V of W float lanes, written with GCC vector extensions so that the
// same source is AVX-512 (W = 16, zmm) when the compiler targets AVX-512F and AVX2 (W = 8,
// ymm) otherwise. Everything is inline and branch-free (but for sin/cos of |x| > 2^17); the
// transcendental functions are polynomial approximations (no libm calls, so loops over them
// vectorise) accurate to a few ulp in fp32 (measured max: exp 1.0, log 0.7, erf 0.9,
// expm1 1.3, sin/cos 1.4, tanh 2.0, sigmoid 2.1, log1p 2.1, pow 0.5; sqrt and division
// correctly rounded) and follow torch for special values (inf, nan, signed zero).
// pow and sin/cos live in kiln_vec_pow.h and kiln_vec_trig.h, included at the end.
//
// Conventions used by the code generator:
//   * tails: loadn/storen touch only lanes [0, n) (masked loads/stores, never past the end);
//   * bool tensors are uint8 (0/1) in memory and 0.0f/1.0f floats in registers;
//   * comparisons return 1.0f/0.0f, select(cond, a, b) picks a where cond != 0.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#define KV_BYTES 64
#elif defined(__AVX2__) && defined(__FMA__)
#define KV_BYTES 32
#else
#error "kiln_vec.h needs AVX2+FMA or AVX-512F: compile with -march=native on such a CPU"
#endif

#define KV_INLINE inline __attribute__((always_inline))

namespace kv {

constexpr int W = KV_BYTES / 4;  // float lanes per vector
typedef float V __attribute__((vector_size(KV_BYTES)));
typedef int32_t VI __attribute__((vector_size(KV_BYTES)));  // lane masks (-1/0) and ints
typedef uint8_t VB __attribute__((vector_size(W)));         // W bytes (bool tensors)

// ---------------------------------------------------------------- basics, loads, stores
// (Not V{} + x: without -ffast-math that is a real add, since -0.0f + 0.0f = +0.0f.)
#if KV_BYTES == 64
KV_INLINE V splat(float x) { return (V)_mm512_set1_ps(x); }
KV_INLINE VI splati(int32_t x) { return (VI)_mm512_set1_epi32(x); }
#else
KV_INLINE V splat(float x) { return (V)_mm256_set1_ps(x); }
KV_INLINE VI splati(int32_t x) { return (VI)_mm256_set1_epi32(x); }
#endif
KV_INLINE VI as_int(V v) { return (VI)v; }  // bit casts
KV_INLINE V as_float(VI v) { return (V)v; }
KV_INLINE VI iota_i() {
  VI r{};
  for (int i = 0; i < W; ++i) r[i] = i;
  return r;
}
KV_INLINE V iota() { return __builtin_convertvector(iota_i(), V); }
// A lane mask (-1/0 per lane) as 1.0f/0.0f.
KV_INLINE V from_mask(VI m) { return as_float(m & as_int(splat(1.0f))); }

KV_INLINE V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
KV_INLINE void store(float* p, V v) { std::memcpy(p, &v, sizeof v); }

#if KV_BYTES == 64
KV_INLINE __mmask16 lane_mask(int n) {
  return n >= W ? __mmask16(0xffff) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1u);
}
#endif

// Lanes [0, n) from p, the others `fill`; reads no memory past p[n-1].
KV_INLINE V loadn(const float* p, int n, float fill) {
#if KV_BYTES == 64
  return (V)_mm512_mask_loadu_ps((__m512)splat(fill), lane_mask(n), p);
#else
  VI m = iota_i() < n;
  V v = (V)_mm256_maskload_ps(p, (__m256i)m);
  return m ? v : splat(fill);
#endif
}
// Stores lanes [0, n) of v; writes nothing past p[n-1].
KV_INLINE void storen(float* p, V v, int n) {
#if KV_BYTES == 64
  _mm512_mask_storeu_ps(p, lane_mask(n), (__m512)v);
#else
  _mm256_maskstore_ps(p, (__m256i)(iota_i() < n), (__m256)v);
#endif
}

// W elements p[i * stride] (hardware gather when the offsets fit in int32).
KV_INLINE V gather(const float* p, int64_t stride) {
  if (stride < INT32_MAX / W && stride > -(INT32_MAX / W)) {
    VI idx = iota_i() * static_cast<int32_t>(stride);
#if KV_BYTES == 64
    return (V)_mm512_i32gather_ps((__m512i)idx, p, 4);
#else
    return (V)_mm256_i32gather_ps(p, (__m256i)idx, 4);
#endif
  }
  V r;
  for (int i = 0; i < W; ++i) r[i] = p[i * stride];
  return r;
}
KV_INLINE V gathern(const float* p, int64_t stride, int n, float fill) {
  V r = splat(fill);
  for (int i = 0; i < n && i < W; ++i) r[i] = p[i * stride];
  return r;
}

// bool (uint8) <-> 0/1 floats; any nonzero byte or float counts as true.
KV_INLINE V load_u8(const uint8_t* p) {
  VB b;
  std::memcpy(&b, p, sizeof b);
  return from_mask(__builtin_convertvector(b, VI) != 0);
}
KV_INLINE V load_u8n(const uint8_t* p, int n) {
  VB b{};
  for (int i = 0; i < n && i < W; ++i) b[i] = p[i];
  return from_mask(__builtin_convertvector(b, VI) != 0);
}
KV_INLINE VB to_u8(V v) { return __builtin_convertvector((v != 0) & 1, VB); }
KV_INLINE void store_u8(uint8_t* p, V v) {
  VB b = to_u8(v);
  std::memcpy(p, &b, sizeof b);
}
KV_INLINE void store_u8n(uint8_t* p, V v, int n) {
  VB b = to_u8(v);
  for (int i = 0; i < n && i < W; ++i) p[i] = b[i];
}

// ---------------------------------------------------------------- weight loads for the
// weight-only kernels (kiln/kernels/cpu/woq.h): W int8 / uint8 / fp16 weights widened to W
// fp32 lanes in registers as they stream past, exactly. Each reads exactly the W source
// elements it converts. (Broadcast, fma, load, store and the partial store of the results
// are splat, fma, load, store and storen above.)
#if KV_BYTES == 64
// W signed bytes -> W floats.
KV_INLINE V widen_i8(const int8_t* p) {
  return (V)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
// W unsigned bytes -> W int32 lanes (for INT4: each byte holds two 4-bit codes).
KV_INLINE VI widen_u8(const uint8_t* p) {
  return (VI)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
}
// Bits 0-3 / 4-7 of each lane of widen_u8 as floats 0..15.
KV_INLINE V low_nibble(VI d) {
  return (V)_mm512_cvtepi32_ps(_mm512_and_si512((__m512i)d, _mm512_set1_epi32(15)));
}
KV_INLINE V high_nibble(VI d) { return (V)_mm512_cvtepi32_ps(_mm512_srli_epi32((__m512i)d, 4)); }
// W fp16 values -> W floats.
#define KV_HAVE_F16 1
KV_INLINE V widen_f16(const void* p) {
  return (V)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}
#else
KV_INLINE V widen_i8(const int8_t* p) {
  return (V)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
KV_INLINE VI widen_u8(const uint8_t* p) {
  return (VI)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
}
KV_INLINE V low_nibble(VI d) {
  return (V)_mm256_cvtepi32_ps(_mm256_and_si256((__m256i)d, _mm256_set1_epi32(15)));
}
KV_INLINE V high_nibble(VI d) { return (V)_mm256_cvtepi32_ps(_mm256_srli_epi32((__m256i)d, 4)); }
#if defined(__F16C__)  // widen_f16 (KV_HAVE_F16) needs F16C next to AVX2
#define KV_HAVE_F16 1
KV_INLINE V widen_f16(const void* p) {
  return (V)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
}
#endif
#endif

// ---------------------------------------------------------------- simple arithmetic
KV_INLINE V fma(V a, V b, V c) {  // a * b + c, one rounding
#if KV_BYTES == 64
  return (V)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
  return (V)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#endif
}
KV_INLINE V select(V cond, V a, V b) { return cond != 0 ? a : b; }
KV_INLINE V abs(V x) { return as_float(as_int(x) & 0x7fffffff); }
KV_INLINE V neg(V x) { return -x; }
KV_INLINE V relu(V x) { return x < 0 ? splat(0.0f) : x; }  // keeps nan, like torch
KV_INLINE V recip(V x) { return 1.0f / x; }
KV_INLINE V sqrt(V x) {
#if KV_BYTES == 64
  return (V)_mm512_sqrt_ps((__m512)x);
#else
  return (V)_mm256_sqrt_ps((__m256)x);
#endif
}
KV_INLINE V rsqrt(V x) { return 1.0f / sqrt(x); }  // exact, not the 12-bit rsqrtps
// torch.maximum / torch.minimum: a nan in either operand gives nan.
KV_INLINE V max(V a, V b) { return (a > b) | (a != a) ? a : b; }
KV_INLINE V min(V a, V b) { return (a < b) | (a != a) ? a : b; }
KV_INLINE V sign(V x) { return from_mask(x > 0) - from_mask(x < 0); }  // sign(nan) = 0

#if KV_BYTES == 64
#define KV_ROUND(x, mode) (V) _mm512_roundscale_ps((__m512)(x), (mode) | _MM_FROUND_NO_EXC)
#else
#define KV_ROUND(x, mode) (V) _mm256_round_ps((__m256)(x), (mode) | _MM_FROUND_NO_EXC)
#endif
KV_INLINE V floor(V x) { return KV_ROUND(x, _MM_FROUND_TO_NEG_INF); }
KV_INLINE V ceil(V x) { return KV_ROUND(x, _MM_FROUND_TO_POS_INF); }
KV_INLINE V round(V x) { return KV_ROUND(x, _MM_FROUND_TO_NEAREST_INT); }  // half to even
KV_INLINE V trunc(V x) { return KV_ROUND(x, _MM_FROUND_TO_ZERO); }

// ---------------------------------------------------------------- comparisons, logic
KV_INLINE V cmp_lt(V a, V b) { return from_mask(a < b); }
KV_INLINE V cmp_le(V a, V b) { return from_mask(a <= b); }
KV_INLINE V cmp_gt(V a, V b) { return from_mask(a > b); }
KV_INLINE V cmp_ge(V a, V b) { return from_mask(a >= b); }
KV_INLINE V cmp_eq(V a, V b) { return from_mask(a == b); }
KV_INLINE V cmp_ne(V a, V b) { return from_mask(a != b); }  // true for nan, like torch
KV_INLINE V logical_and(V a, V b) { return from_mask((a != 0) & (b != 0)); }
KV_INLINE V logical_or(V a, V b) { return from_mask((a != 0) | (b != 0)); }
KV_INLINE V logical_not(V a) { return from_mask(a == 0); }

// ---------------------------------------------------------------- exp family
namespace detail {
constexpr float kInf = __builtin_inff();
constexpr float kNan = __builtin_nanf("");
constexpr float kLog2e = 0x1.715476p+0f;
constexpr float kLn2Hi = 0x1.62e430p-1f;   // float(ln 2)
constexpr float kLn2Lo = -0x1.05c610p-29f;  // ln 2 - kLn2Hi

KV_INLINE V clamp_keep_nan(V x, float lo, float hi) {
  x = x < lo ? splat(lo) : x;
  return x > hi ? splat(hi) : x;
}
// 2^n for integer lanes n in [-126, 127].
KV_INLINE V pow2i(VI n) { return as_float((n + 127) << 23); }

// x = n ln2 + r with |r| <= ln2 / 2 (n integral); returns e^r - 1. The first fma is exact
// (x and n * kLn2Hi agree in their leading bits), so r carries one rounding only.
KV_INLINE V exp_reduce(V x, VI& n) {
  V nf = round(x * kLog2e);
  n = __builtin_convertvector(nf, VI);
  V r = fma(nf, splat(-kLn2Hi), x);
  r = fma(nf, splat(-kLn2Lo), r);
  // Taylor series of e^r - 1 to r^7: the r^8/8! remainder is < 2^-26 relative on the interval.
  V p = splat(1.0f / 5040);
  p = fma(p, r, splat(1.0f / 720));
  p = fma(p, r, splat(1.0f / 120));
  p = fma(p, r, splat(1.0f / 24));
  p = fma(p, r, splat(1.0f / 6));
  p = fma(p, r, splat(0.5f));
  return fma(p, r * r, r);
}
}  // namespace detail

// e^x: inf above ~88.72, gradual underflow to denormals, 0 below ~-103.9, nan kept.
KV_INLINE V exp(V x) {
  VI n;
  // Clamped inputs already overflow/underflow, so the bounds only keep n in range.
  V em1 = detail::exp_reduce(detail::clamp_keep_nan(x, -110.0f, 89.0f), n);
  // 2^n split as 2^n1 * 2^n2 (both normal) so denormal and overflowing results round once.
  VI n1 = n >> 1;
  return ((1.0f + em1) * detail::pow2i(n1)) * detail::pow2i(n - n1);
}

// e^x - 1, accurate near 0: 2^n (e^r - 1) + (2^n - 1), the second term exact.
KV_INLINE V expm1(V x) {
  VI n;
  V em1 = detail::exp_reduce(detail::clamp_keep_nan(x, -30.0f, 89.0f), n);
  VI n1 = n < 127 ? n : splati(127);  // n = 128 (x near 88.7): one more factor 2 below
  V s = detail::pow2i(n1);
  V r = fma(s, em1, s - 1.0f);
  return n > n1 ? r * 2.0f : r;
}

KV_INLINE V sigmoid(V x) { return 1.0f / (1.0f + exp(-x)); }  // saturates to 0 / 1

// tanh|x| = u / (u + 2) with u = expm1(2|x|) >= 0, which does not amplify u's error;
// above |x| = 9.1 tanh rounds to 1 (and u would overflow).
KV_INLINE V tanh(V x) {
  V a = abs(x);
  V u = expm1(2.0f * a);
  V y = a > 9.1f ? splat(1.0f) : u / (u + 2.0f);
  return as_float(as_int(y) | (as_int(x) & int32_t(0x80000000u)));
}

// ---------------------------------------------------------------- log family
namespace detail {
// x = 2^e * m with m in [sqrt(1/2), sqrt(2)), for finite x > 0 (denormals included).
KV_INLINE void split_exponent(V x, V& m, VI& e) {
  VI tiny = x < 0x1p-126f;
  x = tiny ? x * 0x1p23f : x;
  // Offsetting by the bits of sqrt(1/2) puts mantissas >= sqrt(2) into the next binade.
  VI ix = as_int(x) - 0x3f3504f3;
  e = (ix >> 23) - (tiny & 23);
  m = as_float((ix & 0x007fffff) + 0x3f3504f3);
}
}  // namespace detail

// log x: -inf at 0, nan below 0 and for nan, inf at inf.
KV_INLINE V log(V x) {
  V m;
  VI e;
  detail::split_exponent(x, m, e);
  // log(1 + f) = 2 atanh(s), s = f / (2 + f), |s| <= 0.1716; series 2s (1 + z/3 + z^2/5 + ...)
  // written as f - hfsq + s (hfsq + R) so the rounding errors only touch small terms.
  V f = m - 1.0f;
  V s = f / (2.0f + f);
  V z = s * s;
  V R = fma(fma(fma(splat(2.0f / 9), z, splat(2.0f / 7)), z, splat(2.0f / 5)), z,
            splat(2.0f / 3)) *
        z;
  V hfsq = 0.5f * f * f;
  V ef = __builtin_convertvector(e, V);
  V t = fma(ef, splat(detail::kLn2Lo), s * (hfsq + R)) - hfsq;
  V r = fma(ef, splat(detail::kLn2Hi), t + f);
  r = x == detail::kInf ? x : r;
  r = x == 0 ? splat(-detail::kInf) : r;
  return (x < 0) | (x != x) ? splat(detail::kNan) : r;
}

// log(1 + x): the factor x / (u - 1) cancels the rounding error of u = 1 + x.
KV_INLINE V log1p(V x) {
  V u = 1.0f + x;
  V r = log(u) * (x / (u - 1.0f));
  r = u == 1.0f ? x : r;
  return x == detail::kInf ? x : r;
}

// ---------------------------------------------------------------- erf
// |x| < 1: erf(x) = x + x P(x^2) (P ~ erf(x)/x - 1, small, so its rounding barely shows).
// 1 <= |x| < 3.92: erf = 1 - exp(Q(|x| - 1)), Q ~ log erfc. Above 3.92 erf rounds to 1.
// Coefficients are weighted least-squares (near-minimax) fits in fp32, within ~1 ulp.
KV_INLINE V erf(V x) {
  V a = abs(x);
  V t = a * a;
  V p = fma(splat(0x1.49e89ep-14f), t, splat(-0x1.a42ac2p-11f));
  p = fma(p, t, splat(0x1.540ddap-8f));
  p = fma(p, t, splat(-0x1.b7fa4ap-6f));
  p = fma(p, t, splat(0x1.ce2d0ep-4f));
  p = fma(p, t, splat(-0x1.81273ep-2f));
  p = fma(p, t, splat(0x1.06eba8p-3f));  // 2/sqrt(pi) - 1
  V small = fma(a, p, a);
  V u = a - 1.0f;
  V q = fma(splat(0x1.86dd9ap-13f), u, splat(-0x1.df8fd6p-10f));
  q = fma(q, u, splat(0x1.444124p-7f));
  q = fma(q, u, splat(-0x1.53ff24p-5f));
  q = fma(q, u, splat(-0x1.afad1cp-1f));
  q = fma(q, u, splat(-0x1.51c9aap+1f));
  q = fma(q, u, splat(-0x1.d97fc0p+0f));
  V r = 1.0f - exp(q);
  r = a < 1.0f ? small : r;
  r = a >= 3.92f ? splat(1.0f) : r;  // nan fails both tests and stays nan via q
  return as_float(as_int(r) | (as_int(x) & int32_t(0x80000000u)));
}

// ---------------------------------------------------------------- horizontal reductions
namespace detail {
typedef float F8 __attribute__((vector_size(32)));
typedef float F4 __attribute__((vector_size(16)));
typedef float F2 __attribute__((vector_size(8)));
// Pairwise tree: halves combined with op until one lane is left.
template <class Op>
KV_INLINE float tree(V v, Op op) {
#if KV_BYTES == 64
  F8 v8 = op(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7),
             __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
#else
  F8 v8 = v;
#endif
  F4 v4 = op(__builtin_shufflevector(v8, v8, 0, 1, 2, 3), __builtin_shufflevector(v8, v8, 4, 5, 6, 7));
  F2 v2 = op(__builtin_shufflevector(v4, v4, 0, 1), __builtin_shufflevector(v4, v4, 2, 3));
  return op(v2, __builtin_shufflevector(v2, v2, 1, 0))[0];
}
}  // namespace detail

KV_INLINE float hsum(V v) {
  return detail::tree(v, [](auto a, auto b) { return a + b; });
}
KV_INLINE float hmax(V v) {  // nan if any lane is nan
  return detail::tree(v, [](auto a, auto b) { return (a > b) | (a != a) ? a : b; });
}
KV_INLINE float hmin(V v) {
  return detail::tree(v, [](auto a, auto b) { return (a < b) | (a != a) ? a : b; });
}

}  // namespace kv

#include "kiln_vec_pow.h"   // kv::pow
#include "kiln_vec_trig.h"  // kv::sin, kv::cos
