// kiln_vec_pow.h — kv::pow (torch.pow semantics), included at the end of kiln_vec.h.
//
// pow(a, b) = exp(b log|a|) loses accuracy in fp32 because the error of b log|a| is
// multiplied by the result (|b log a| ~ 80 costs ~7 bits). So the core runs in double on
// two half-width vectors: log|a| and exp to ~1e-13 relative, then one rounding to float,
// which gives a result within 1 ulp. The special cases (zero, inf, nan, negative bases)
// are patched afterwards with selects, following C99 / torch.pow.
#pragma once
#include "kiln_vec.h"

namespace kv {
namespace detail {

typedef double VD __attribute__((vector_size(KV_BYTES)));   // W/2 double lanes
typedef int64_t VL __attribute__((vector_size(KV_BYTES)));  // W/2 int64 lanes
typedef float VH __attribute__((vector_size(KV_BYTES / 2)));  // W/2 float lanes

#if KV_BYTES == 64
KV_INLINE VH lo_half(V v) { return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7); }
KV_INLINE VH hi_half(V v) { return __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15); }
KV_INLINE V join(VH a, VH b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
#else
KV_INLINE VH lo_half(V v) { return __builtin_shufflevector(v, v, 0, 1, 2, 3); }
KV_INLINE VH hi_half(V v) { return __builtin_shufflevector(v, v, 4, 5, 6, 7); }
KV_INLINE V join(VH a, VH b) { return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7); }
#endif

// e^y (double) for |y| <= 200: y = n ln2 + r, Taylor series of e^r to r^9 (|r| <= 0.35,
// remainder < 1e-11 relative), times 2^n built in the exponent field.
KV_INLINE VD exp_d(VD y) {
  const double magic = 0x1.8p52;  // adding it rounds to an integer held in the low bits
  VD t = y * 0x1.71547652b82fep+0 + magic;
  VD n = t - magic;
  VD r = y - n * 0x1.62e42fefa39efp-1;
  VD p = VD{} + 1.0 / 362880;
  p = p * r + 1.0 / 40320;
  p = p * r + 1.0 / 5040;
  p = p * r + 1.0 / 720;
  p = p * r + 1.0 / 120;
  p = p * r + 1.0 / 24;
  p = p * r + 1.0 / 6;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  VL k = (VL)t - (VL)(VD{} + magic);  // bit casts: n as an integer
  return p * (VD)((k + 1023) << 52);
}

// log m (double) for m in [sqrt(1/2), sqrt(2)): the atanh series of kv::log, to s^13.
KV_INLINE VD log_m_d(VD m) {
  VD f = m - 1.0;
  VD s = f / (2.0 + f);
  VD z = s * s;
  VD R = z * (2.0 / 3 + z * (2.0 / 5 + z * (2.0 / 7 + z * (2.0 / 9 + z * (2.0 / 11 + z * (2.0 / 13))))));
  VD hfsq = 0.5 * f * f;
  return f - hfsq + s * (hfsq + R);
}

// 2^(b (e + log2 m)) = e^(b (e ln2 + log m)) for one half of the lanes.
KV_INLINE VH pow_core(VH m, VH e, VH b) {
  VD y = __builtin_convertvector(b, VD) *
         (__builtin_convertvector(e, VD) * 0x1.62e42fefa39efp-1 +
          log_m_d(__builtin_convertvector(m, VD)));
  // Beyond +-200 the fp32 result is inf or 0 anyway; comparisons keep nan.
  y = y < -200.0 ? VD{} - 200.0 : y;
  y = y > 200.0 ? VD{} + 200.0 : y;
  return __builtin_convertvector(exp_d(y), VH);
}

}  // namespace detail

// torch.pow(a, b) elementwise.
KV_INLINE V pow(V a, V b) {
  const V inf = splat(detail::kInf), nan = splat(detail::kNan), zero = splat(0.0f);
  V ax = abs(a);
  V m;
  VI e;
  detail::split_exponent(ax, m, e);  // meaningless for 0, inf, nan: patched below
  V ef = __builtin_convertvector(e, V);
  V r = detail::join(detail::pow_core(detail::lo_half(m), detail::lo_half(ef), detail::lo_half(b)),
                     detail::pow_core(detail::hi_half(m), detail::hi_half(ef), detail::hi_half(b)));
  // |a| = 0 or inf: the limits of e^(b log|a|).
  r = ax == 0 ? (b < 0 ? inf : b > 0 ? zero : nan) : r;
  r = ax == inf ? (b > 0 ? inf : b < 0 ? zero : nan) : r;
  r = a != a ? nan : r;
  // Negative base (sign bit set, so -0 counts): odd integer exponents flip the sign;
  // a finite negative base with a non-integer exponent is nan. +-inf counts as an even
  // integer exponent.
  VI b_int = floor(b) == b;
  V hb = 0.5f * b;
  VI b_odd = b_int & (floor(hb) != hb);
  r = (b_odd & (as_int(a) < 0)) != 0 ? -r : r;
  r = ((a < 0) & (a > -detail::kInf) & ~b_int) != 0 ? nan : r;
  // Exact answers that hold even for nan operands.
  VI one = (b == 0) | (a == 1.0f) | ((a == -1.0f) & (abs(b) == detail::kInf));
  return one != 0 ? splat(1.0f) : r;
}

}  // namespace kv
