// decode_ops.h — the serial pieces of a decode step: norms, rotary, attention of one head,
// MLP activations. Each touches a few thousand floats (thread 0 runs them, or one thread
// per attention head); pointwise math is kiln_vec.h's vectorised exp / tanh / erf.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "decode_desc.h"
#include "decode_half.h"
#include "kiln_vec.h"

namespace kdec {

using kv::V;

// y (rows, n) = norm(x) for `rows` rows of n; y may alias x.
void norm_rows(const Model& m, const Norm& nm, const float* x, float* y, int64_t rows,
               int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* yr = y + r * n;
    float mean = 0.0f, inv;
    if (m.norm_kind == 0) {
      float ss = 0.0f;
      for (int64_t i = 0; i < n; ++i) ss += xr[i] * xr[i];
      inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + m.eps);
    } else {
      for (int64_t i = 0; i < n; ++i) mean += xr[i];
      mean /= static_cast<float>(n);
      float var = 0.0f;
      for (int64_t i = 0; i < n; ++i) var += (xr[i] - mean) * (xr[i] - mean);
      inv = 1.0f / std::sqrt(var / static_cast<float>(n) + m.eps);
    }
    for (int64_t i = 0; i < n; ++i) {
      float h = (xr[i] - mean) * inv * (m.norm_offset + nm.w[i]);
      yr[i] = nm.b != nullptr ? h + nm.b[i] : h;
    }
  }
}

// Half-split rotary embedding in place on `heads` vectors of D: x*cos + rotate(x)*sin.
void rotate(float* x, int64_t heads, int64_t D, const float* cos, const float* sin) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * D;
    for (int64_t i = 0; i < half; ++i) {
      const float a = v[i], b = v[i + half];
      const float lo_cos = a * cos[i], lo_sin = -b * sin[i];
      const float hi_cos = b * cos[i + half], hi_sin = a * sin[i + half];
      v[i] = lo_cos + lo_sin;
      v[i + half] = hi_cos + hi_sin;
    }
  }
}

// a (n floats) . b (n values of storage S from element i).
template <int S>
float dot_as(const float* a, const void* b, int64_t i, int64_t n) {
  V acc = kv::splat(0.0f);
  int64_t j = 0;
  for (; j + kv::W <= n; j += kv::W) acc = kv::fma(kv::load(a + j), load_as<S>(b, i + j), acc);
  if (j < n) {
    const int rest = static_cast<int>(n - j);
    acc = kv::fma(kv::loadn(a + j, rest, 0.0f), load_as_n<S>(b, i + j, rest), acc);
  }
  return kv::hsum(acc);
}

// One query head over cache slots [lo, pos] of a cache head stored as S (kc, vc: element
// offset `at` of slot 0): softmax(q.k * scale (soft-capped)) @ v.
template <int S>
void attend_head_as(const Model& m, const float* q, const void* kc, const void* vc, int64_t at,
                    int64_t lo, int64_t pos, float* scores, float* out) {
  const int64_t D = m.D, n = pos + 1 - lo;
  float mx = -INFINITY;
  for (int64_t s = 0; s < n; ++s) {
    float d = dot_as<S>(q, kc, at + (lo + s) * D, D) * m.attn_scale;
    if (m.attn_softcap > 0.0f) d = std::tanh(d / m.attn_softcap) * m.attn_softcap;
    scores[s] = d;
    mx = std::max(mx, d);
  }
  V vsum = kv::splat(0.0f);
  int64_t s = 0;
  for (; s + kv::W <= n; s += kv::W) {
    const V e = kv::exp(kv::load(scores + s) - mx);
    kv::store(scores + s, e);
    vsum += e;
  }
  float sum = kv::hsum(vsum);
  for (; s < n; ++s) sum += scores[s] = std::exp(scores[s] - mx);
  const float inv = 1.0f / sum;
  for (int64_t d = 0; d < D; ++d) out[d] = 0.0f;
  for (s = 0; s < n; ++s) {
    const V p = kv::splat(scores[s] * inv);
    const int64_t row = at + (lo + s) * D;
    int64_t d = 0;
    for (; d + kv::W <= D; d += kv::W) kv::store(out + d, kv::load(out + d) + p * load_as<S>(vc, row + d));
    if (d < D) {
      const int rest = static_cast<int>(D - d);
      kv::storen(out + d, kv::loadn(out + d, rest, 0.0f) + p * load_as_n<S>(vc, row + d, rest), rest);
    }
  }
}

// attend_head_as for the model's cache storage.
inline void attend_head(const Model& m, const float* q, const void* kc, const void* vc,
                        int64_t at, int64_t lo, int64_t pos, float* scores, float* out) {
  switch (m.cache_storage) {
    case kBF16: return attend_head_as<kBF16>(m, q, kc, vc, at, lo, pos, scores, out);
    case kF16: return attend_head_as<kF16>(m, q, kc, vc, at, lo, pos, scores, out);
    default: return attend_head_as<kF32>(m, q, kc, vc, at, lo, pos, scores, out);
  }
}

void activate(const Model& m, float* g, const float* u, int64_t n) {
  for (int64_t i = 0; i < n; i += kv::W) {
    const int k = static_cast<int>(std::min<int64_t>(kv::W, n - i));
    const V x = kv::loadn(g + i, k, 0.0f);
    V y;
    if (m.act == 0)
      y = x / (1.0f + kv::exp(-x));
    else if (m.act == 1)
      y = 0.5f * x * (1.0f + kv::erf(x * 0.70710678118654752f));
    else if (m.act == 2)
      y = 0.5f * x * (1.0f + kv::tanh(0.79788456080286536f * (x + 0.044715f * x * x * x)));
    else
      y = kv::relu(x);
    if (u != nullptr) y = y * kv::loadn(u + i, k, 0.0f);
    kv::storen(g + i, y, k);
  }
}

}  // namespace kdec
