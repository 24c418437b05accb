// kiln_rnn.h — one LSTM or GRU layer as one kernel (namespace kr).
//
//   1. The input projections of every time step in one GEMM (kiln_gemm.h):
//        xp (B*T, G*H) = x (B*T, I) @ W_ih^T + bias        (G gates: LSTM i,f,g,o; GRU r,z,n)
//   2. The recurrence, the whole time loop inside one parallel region. Each thread owns a
//      slice of the hidden units for the whole loop and, per step, multiplies the previous
//      h (B, H) by its slice of W_hh^T, adds the step's projections, applies the gate
//      arithmetic (vectorised over units) and writes its part of the new h; a spin barrier
//      between steps makes the whole h visible before the next step reads it. A thread's
//      slice of W_hh stays in its core's cache from step to step, and no step pays a
//      parallel region's start-up.
//
// W_hh^T is packed gate-blocked: G blocks of Hp = H rounded up to whole NR-column panels,
// gate q of unit j in column q * Hp + j (padding columns zero). A thread owns the same
// panels p0..p1 of every gate block, so the gates of its units land in its own columns of
// the step's pre-activations, added to the projections in the vectorised cell update.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "kiln_gemm.h"
#include "kiln_rt.h"
#include "kiln_vec.h"

namespace kr {


struct RnnLayer {
  int64_t B, T, I, H;
  int gates;             // 4: LSTM, 3: GRU
  bool batch_first;      // x and out are (B, T, .) rather than (T, B, .)
  const float* x;        // (B, T, I) or (T, B, I), contiguous
  const float* h0;       // h0[b * h0_sb + j * h0_sh]
  int64_t h0_sb, h0_sh;
  const float* c0;       // LSTM only, strides as h0's
  int64_t c0_sb, c0_sh;
  const float* w_ih;     // W_ih^T (I, G*H) in column panels
  const float* w_hh;     // W_hh^T (H, G * Hp), gate-blocked panels (see above)
  const float* bias;     // (G*H): projections' bias; GRU: then b_hn (H)
  float* out;            // the outputs h_t, laid out as x, or nullptr
  float* cell;           // LSTM: the final cell state (B, H), or nullptr
};

namespace detail {

// Spin barrier over "slots": a call that runs s slots arrives with s, so the barrier works
// however the runtime split the slots between threads (one thread with all of them never
// waits). Arrivals only grow; step t's barrier waits for slots * (t + 1).
struct Barrier {
  std::atomic<int64_t> arrived{0};
  void wait(int64_t slots, int64_t target) {
    arrived.fetch_add(slots, std::memory_order_acq_rel);
    while (arrived.load(std::memory_order_acquire) < target) _mm_pause();
  }
};

inline int64_t row_of(const RnnLayer& L, int64_t b, int64_t t) {
  return L.batch_first ? b * L.T + t : t * L.B + b;
}

// Units [u0, u1) of step t for batch row b: rec[q] the recurrent part of gate q (W_hh h),
// x_t the step's projections (G*H, bias included) -> new h (and c), written to h_next,
// c and out.
inline void cell_update(const RnnLayer& L, int64_t b, int64_t t, int64_t u0, int64_t u1,
                        const float* const* rec, const float* x_t, const float* h_prev,
                        float* h_next, float* c) {
  const int64_t H = L.H;
  float* out = L.out ? L.out + row_of(L, b, t) * H : nullptr;
  for (int64_t j = u0; j < u1; j += kv::W) {
    const int n = static_cast<int>(std::min<int64_t>(kv::W, u1 - j));
    auto ld = [&](const float* p) { return n == kv::W ? kv::load(p + j) : kv::loadn(p + j, n, 0.0f); };
    auto st = [&](float* p, kv::V v) {
      if (n == kv::W) {
        kv::store(p + j, v);
      } else {
        float tmp[kv::W];
        kv::store(tmp, v);
        for (int l = 0; l < n; ++l) p[j + l] = tmp[l];
      }
    };
    auto gate = [&](int q) { return ld(rec[q]) + ld(x_t + q * H); };
    kv::V h;
    if (L.gates == 4) {  // i, f, g, o
      const kv::V i = kv::sigmoid(gate(0)), f = kv::sigmoid(gate(1));
      const kv::V g = kv::tanh(gate(2)), o = kv::sigmoid(gate(3));
      const kv::V cn = kv::fma(f, ld(c), i * g);
      st(c, cn);
      h = o * kv::tanh(cn);
    } else {  // r, z, n = tanh(x_n + r * (W_hn h + b_hn))
      const kv::V r = kv::sigmoid(gate(0)), z = kv::sigmoid(gate(1));
      const kv::V nn = kv::tanh(kv::fma(r, ld(rec[2]) + ld(L.bias + 3 * H), ld(x_t + 2 * H)));
      h = kv::fma(z, ld(h_prev) - nn, nn);  // (1 - z) * n + z * h
    }
    st(h_next, h);
    if (out) st(out, h);
  }
}

}  // namespace detail

// The layer. `scratch` holds at least scratch_floats(L) floats.
inline int64_t padded_units(int64_t H) { return kg::num_panels(H) * kg::NR; }

inline int64_t scratch_floats(int64_t B, int64_t T, int64_t H, int gates) {
  return B * T * gates * H + B * gates * padded_units(H) + 2 * B * H + B * H + 64;
}

inline void rnn_layer(const KilnRuntime* rt, const RnnLayer& L, float* scratch) {
  const int64_t B = L.B, T = L.T, H = L.H, G = L.gates, GH = G * H;
  float* xp = scratch;                 // (B*T, G*H) projections
  const int64_t Hp = padded_units(H), PB = Hp / kg::NR;  // gate block: Hp columns, PB panels
  float* rec = xp + B * T * GH;        // (B, G * Hp): W_hh h of a step, per gate block
  float* hbuf = rec + B * G * Hp;      // 2 x (B, H): h_prev / h_next
  float* c = hbuf + 2 * B * H;         // (B, H) LSTM cell state
  kg::gemm(rt, L.x, L.I, B * T, L.w_ih, L.I, GH, [&](int64_t i, int64_t c0, kv::V a0, kv::V a1) {
    const kv::V acc[2] = {a0, a1};
    for (int h = 0; h < 2; ++h) {
      const int64_t col = c0 + h * kv::W;
      if (col >= GH) break;
      const int n = static_cast<int>(std::min<int64_t>(kv::W, GH - col));
      const kv::V v = acc[h] + kv::loadn(L.bias + col, n, 0.0f);
      if (n == kv::W) {
        kv::store(xp + i * GH + col, v);
      } else {
        float tmp[kv::W];
        kv::store(tmp, v);
        for (int l = 0; l < n; ++l) xp[i * GH + col + l] = tmp[l];
      }
    }
  });
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < H; ++j) {
      hbuf[b * H + j] = L.h0[b * L.h0_sb + j * L.h0_sh];
      if (G == 4) c[b * H + j] = L.c0[b * L.c0_sb + j * L.c0_sh];
    }
  const int64_t slots = std::max<int64_t>(1, std::min<int64_t>(rt->num_threads, PB));
  detail::Barrier barrier;
  kiln::parallel(rt, slots, 1, [&](int64_t s0, int64_t s1) {
    const int64_t p0 = s0 * PB / slots, p1 = s1 * PB / slots;  // this thread's panels
    const int64_t u0 = p0 * kg::NR, u1 = std::min(H, p1 * kg::NR);
    for (int64_t t = 0; t < T; ++t) {
      const float* h_prev = hbuf + (t & 1) * B * H;
      float* h_next = hbuf + ((t + 1) & 1) * B * H;
      for (int64_t q = 0; q < G; ++q)
        for (int64_t p = p0; p < p1; ++p)
          kg::gemm_panel(h_prev, H, L.w_hh, H, 0, B, q * PB + p,
                         [&](int64_t b, int64_t col0, kv::V a0, kv::V a1) {
                           kv::store(rec + b * G * Hp + col0, a0);
                           kv::store(rec + b * G * Hp + col0 + kv::W, a1);
                         });
      for (int64_t b = 0; b < B; ++b) {
        const float* r = rec + b * G * Hp;
        const float* parts[4] = {r, r + Hp, r + 2 * Hp, r + (G == 4 ? 3 : 2) * Hp};
        detail::cell_update(L, b, t, u0, u1, parts, xp + detail::row_of(L, b, t) * GH,
                            h_prev + b * H, h_next + b * H, c + b * H);
      }
      if (slots > 1) barrier.wait(s1 - s0, slots * (t + 1));
    }
  });
  if (L.cell)
    for (int64_t i = 0; i < B * H; ++i) L.cell[i] = c[i];
}

}  // namespace kr
