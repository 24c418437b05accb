// kiln_vec_trig.h — kv::sin and kv::cos, included at the end of kiln_vec.h.
//
// Range reduction x = n pi/2 + r is the hard part: a vector Cody-Waite step for |x| <= 2^17
// and, for the rare larger lanes, an exact scalar Payne-Hanek step with 2/pi to 256 bits.
// The polynomials then run on |r| <= pi/4 for all lanes at once.
#pragma once
#include "kiln_vec.h"

namespace kv {
namespace detail {
// Bits of 2/pi after the binary point, 32 per word, most significant first, preceded by two
// zero words so that a window may start before the point.
inline constexpr uint32_t kTwoOverPi[10] = {0,          0,          0xA2F9836E, 0x4E441529,
                                            0xFC2757D1, 0xF534DDC0, 0xDB629599, 0x3C439041,
                                            0xFE5163AB, 0xDEBBC561};
// 64 bits of 2/pi from bit `start` on (bit 1 is the first after the point; bits <= 0 are 0).
inline uint64_t two_over_pi_bits(int start) {
  const int idx = start + 63, w = idx >> 5, sh = idx & 31;
  const unsigned __int128 v = (static_cast<unsigned __int128>(kTwoOverPi[w]) << 64) |
                              (static_cast<unsigned __int128>(kTwoOverPi[w + 1]) << 32) |
                              kTwoOverPi[w + 2];
  return static_cast<uint64_t>((v << sh) >> 32);
}
// Exact (Payne-Hanek) reduction of a finite float with |x| >= 2^-5: x = (4k + q + f) pi/2,
// f in [-1/2, 1/2), r = f pi/2. With x = m 2^e (m a 24-bit integer), bits of 2/pi before
// bit e - 1 only add multiples of 4 to x 2/pi, so a 128-bit window from there suffices.
__attribute__((noinline, cold)) inline void reduce_pio2_big(float x, float& r, int32_t& q) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint64_t m = (bits & 0x7fffffu) | 0x800000u;
  const int s = int((bits >> 23) & 0xffu) - 150 - 1;  // e - 1
  const uint64_t hi = two_over_pi_bits(s), lo = two_over_pi_bits(s + 64);
  // x 2/pi = m * window * 2^-126 (mod 4); the product is taken mod 2^128.
  const unsigned __int128 p =
      (static_cast<unsigned __int128>(m * hi) << 64) + static_cast<unsigned __int128>(m) * lo;
  int32_t quadrant = static_cast<int32_t>(p >> 126);
  const uint64_t frac = static_cast<uint64_t>(p >> 62);  // f * 2^64
  double f = static_cast<double>(frac) * 0x1p-64;
  if (frac >> 63) {  // f >= 1/2: round to the next quadrant
    f = -static_cast<double>(uint64_t{0} - frac) * 0x1p-64;
    quadrant += 1;
  }
  const double rd = f * 0x1.921fb54442d18p+0;
  r = static_cast<float>(x < 0 ? -rd : rd);
  q = x < 0 ? -quadrant : quadrant;
}

// x = n pi/2 + r, |r| <= pi/4: Cody-Waite with pi/2 in three floats (each fma rounds once)
// up to |x| = 2^17; larger finite lanes are patched by the exact reduction (rare, scalar).
KV_INLINE void sincos_reduce(V x, V& r, VI& q) {
  V nf = round(x * 0x1.45f306p-1f);  // 2/pi
  q = __builtin_convertvector(nf, VI);
  r = fma(nf, splat(-0x1.921fb6p+0f), x);
  r = fma(nf, splat(0x1.777a5cp-25f), r);
  r = fma(nf, splat(0x1.ee59dap-50f), r);
  const V ax = abs(x);
  const VI big = (ax > 0x1p17f) & (ax < kInf);
#if KV_BYTES == 64
  const bool any_big = _mm512_test_epi32_mask((__m512i)big, (__m512i)big) != 0;
#else
  const bool any_big = _mm256_movemask_ps((__m256)big) != 0;
#endif
  if (__builtin_expect(any_big, 0)) {
    for (int i = 0; i < W; ++i) {
      if (big[i]) {
        float ri;
        int32_t qi;
        reduce_pio2_big(x[i], ri, qi);
        r[i] = ri;
        q[i] = qi;
      }
    }
  }
}
// sin r and cos r for |r| <= pi/4 by Taylor series (sin to r^9, cos to r^10: remainders
// below 2^-26 relative); the value is (q odd ? cos r : sin r), negated when q & 2.
KV_INLINE V sincos_eval(V r, VI q) {
  V z = r * r;
  V ps = fma(fma(fma(splat(1.0f / 362880), z, splat(-1.0f / 5040)), z, splat(1.0f / 120)), z,
             splat(-1.0f / 6));
  V s = fma(ps * z, r, r);
  V pc = fma(fma(fma(fma(splat(-1.0f / 3628800), z, splat(1.0f / 40320)), z, splat(-1.0f / 720)),
                 z, splat(1.0f / 24)),
             z, splat(-0.5f));
  V c = fma(pc, z, splat(1.0f));
  V v = (q & 1) != 0 ? c : s;
  return as_float(as_int(v) ^ ((q & 2) << 30));
}
}  // namespace detail

// sin x, cos x: a few ulp for all finite x; inf and nan give nan.
KV_INLINE V sin(V x) {
  V r;
  VI q;
  detail::sincos_reduce(x, r, q);
  return detail::sincos_eval(r, q);
}
KV_INLINE V cos(V x) {
  V r;
  VI q;
  detail::sincos_reduce(x, r, q);
  return detail::sincos_eval(r, q + 1);  // cos x = sin(x + pi/2)
}

}  // namespace kv
