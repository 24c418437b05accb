// woq.h — kiln's weight-only quantized matmuls for decode-sized inputs (a few rows).
//
// y (M, N) = x (M, K) @ W.T, with W stored as INT8 per output channel or INT4 group-wise,
// in fp32 arithmetic. Header-only (templates and inline functions in namespace woq), so
// that both woq.cpp (their CPython module, loaded by woq.py) and the decode step
// (kiln/llm/native/decode.cpp) include the one copy. SIMD through kiln_vec.h (namespace kv,
// its "weight loads for the weight-only kernels" section); no Python here.
//
// Layouts (woq.py repacks the shared format into them once). Output channels are grouped
// into panels of W (one vector of lanes, W = 8 on AVX2, 16 on AVX-512); N is zero-padded
// to whole panels. Each panel is one contiguous stream read once per call:
//   INT8  panel p: bytes [K][W], w[k][l] = qweight[p*W + l, k]; scale: fp32 (panels*W,).
//   INT4  panel p: for each group i (K/g of them) one record of 4W + gW/2 bytes:
//         scale fp16 [W], offset fp16 [W], then g/2 rows of W bytes whose byte l is
//         packed[p*W + l, i*g/2 + j] = q[., 2j] | q[., 2j+1] << 4 (the shared format's byte).
//
// Kernel: a block of M <= 8 activation rows and P panels keeps M x P accumulator vectors in
// registers; per k it loads W weights per panel, widens them to fp32 in registers (INT4:
// nibble mask/shift, then w = q * scale + offset by FMA) and does M x P broadcast-FMAs.
// INT8 applies the channel scale once at the end; INT4 with 1-2 rows sums x * q per group
// and applies scale and offset per group (saves the dequantizing FMA). Small blocks split
// accumulators across even/odd k so enough FMA chains are in flight. More than 8 rows run
// as chunks of 8 over the same (cache-resident) panels.
// Threads (drive): panels are split across OpenMP threads. The extensions link libgomp.so.1,
// which resolves to the copy torch has already loaded, so this is torch's one thread pool
// (and omp_get_max_threads() is torch.get_num_threads()).
#pragma once
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kiln_vec.h"

#if !defined(KV_HAVE_F16)
#error "woq.h needs AVX2+FMA+F16C or AVX-512F: compile with -march=native on such a CPU"
#endif

namespace woq {
// Internal linkage (the nested unnamed namespace): each extension that includes this header
// (woq.cpp, decode.cpp) gets its own private copy, called directly rather than through the
// PLT and not exported from its .so, so it compiles as when the kernels lived in woq.cpp.
namespace {

using kv::V;
using kv::W;

// Panels per parallel work item: 32 output channels, split into blocks of P panels.
inline constexpr int kBlockPanels = 32 / W;
// A thread is only worth waking for this many weights (~a few microseconds of streaming).
inline constexpr int64_t kMinWeightsPerThread = 1 << 16;

struct Int8Args {
  const float* x;  // (M, K), or per chunk of <= 8 rows interleaved (K, rows): see drive
  int64_t M, K, N;
  const int8_t* w;     // (panels, K, W)
  const float* scale;  // (panels * W,)
  float* y;            // (M, N)
  int64_t panel_bytes() const { return K * W; }
};

struct Int4Args {
  const float* x;  // as Int8Args::x
  int64_t M, K, N, g;
  const uint8_t* w;     // (panels, K / g, 4W + gW/2)
  float* y;             // (M, N)
  const float* xsum;    // per chunk of rows: sums of x over each group, (K / g, rows)
  int64_t group_bytes() const { return 4 * W + g / 2 * W; }
  int64_t panel_bytes() const { return K / g * group_bytes(); }
};

template <int S, int M, int P>
KV_INLINE void zero_all(V (&acc)[S][M][P]) {
#pragma GCC unroll 2
  for (int s = 0; s < S; ++s)
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) acc[s][m][p] = V{};
}

// Sum the split accumulators, apply the per-channel factor (INT8) and store valid lanes.
template <int S, int M, int P>
KV_INLINE void finish(V (&acc)[S][M][P], const float* scale, float* y, int64_t N, int64_t p0) {
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) {
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      V r = acc[0][m][p];
      if (S == 2) r = r + acc[S - 1][m][p];
      if (scale != nullptr) r = r * kv::load(scale + (p0 + p) * W);
      const int64_t n = (p0 + p) * W;
      if (n + W <= N)
        kv::store(y + m * N + n, r);
      else if (n < N)  // the last, partial panel
        kv::storen(y + m * N + n, r, static_cast<int>(N - n));
    }
  }
}

template <int M, int P>
struct Int8Block {
  // Panels per M-row block: as many accumulators as fit the 16 ymm (32 zmm) registers
  // next to the weights, with no spills in the inner loop (checked in the assembly).
  static constexpr int panels(int m) { return W == 16 ? 2 : (m == 1 ? 4 : (m <= 4 ? 2 : 1)); }
  static void run(const Int8Args& a, int64_t p0, int64_t r0) {
    constexpr int S = (M * P <= 4) ? 2 : 1;  // split accumulators: even / odd k
    const int64_t K = a.K, stride = a.panel_bytes();
    const int8_t* w = a.w + p0 * stride;
    const float* x = a.x + r0 * K;
    V acc[S][M][P];
    zero_all(acc);
    int64_t k = 0;
    for (; k + S <= K; k += S) {
#pragma GCC unroll 2
      for (int s = 0; s < S; ++s) {
        V wq[P];
#pragma GCC unroll 4
        for (int p = 0; p < P; ++p) wq[p] = kv::widen_i8(w + p * stride + (k + s) * W);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
          const V xb = kv::splat(x[(k + s) * M + m]);
#pragma GCC unroll 4
          for (int p = 0; p < P; ++p) acc[s][m][p] = kv::fma(xb, wq[p], acc[s][m][p]);
        }
      }
    }
    if (S == 2 && k < K) {  // odd K: the last k (loops unrolled: acc stays in registers)
      V wq[P];
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) wq[p] = kv::widen_i8(w + p * stride + k * W);
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const V xb = kv::splat(x[k * M + m]);
#pragma GCC unroll 4
        for (int p = 0; p < P; ++p) acc[0][m][p] = kv::fma(xb, wq[p], acc[0][m][p]);
      }
    }
    finish<S, M, P>(acc, a.scale, a.y + r0 * a.N, a.N, p0);
  }
};

template <int M, int P>
struct Int4Block {
  // As Int8Block::panels; INT4 also holds the group's scale and offset per panel.
  static constexpr int panels(int m) { return W == 16 ? 2 : (m <= 3 ? 2 : 1); }
  // Up to this many rows, factor the group's affine map out of the sum (see run_factored).
  static constexpr int kFactoredRows = 2;

  static void run(const Int4Args& a, int64_t p0, int64_t r0) {
    if constexpr (M <= kFactoredRows)
      run_factored(a, p0, r0);
    else
      run_dequant(a, p0, r0);
  }

  // Dequantize in registers, w = q * scale + offset (one FMA per W weights, shared by the
  // M rows), and accumulate x * w.
  static void run_dequant(const Int4Args& a, int64_t p0, int64_t r0) {
    constexpr int S = (M * P <= 4) ? 2 : 1;  // split accumulators: low / high nibble
    const int64_t K = a.K, g = a.g, groups = K / g, gbytes = a.group_bytes();
    const int64_t stride = a.panel_bytes();
    const uint8_t* w = a.w + p0 * stride;
    const float* x = a.x + r0 * K;
    V acc[S][M][P];
    zero_all(acc);
    for (int64_t gi = 0; gi < groups; ++gi) {
      const uint8_t* rec = w + gi * gbytes;
      V sc[P], off[P];
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) {
        sc[p] = kv::widen_f16(rec + p * stride);
        off[p] = kv::widen_f16(rec + p * stride + 2 * W);
      }
      const uint8_t* nib = rec + 4 * W;
      const float* xg = x + gi * g * M;
      for (int64_t j = 0; j < g / 2; ++j) {
        V w0[P], w1[P];
#pragma GCC unroll 4
        for (int p = 0; p < P; ++p) {
          const kv::VI d = kv::widen_u8(nib + p * stride + j * W);
          w0[p] = kv::fma(kv::low_nibble(d), sc[p], off[p]);
          w1[p] = kv::fma(kv::high_nibble(d), sc[p], off[p]);
        }
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
          const V b0 = kv::splat(xg[2 * j * M + m]);
          const V b1 = kv::splat(xg[(2 * j + 1) * M + m]);
#pragma GCC unroll 4
          for (int p = 0; p < P; ++p) {
            acc[0][m][p] = kv::fma(b0, w0[p], acc[0][m][p]);
            acc[S - 1][m][p] = kv::fma(b1, w1[p], acc[S - 1][m][p]);
          }
        }
      }
    }
    finish<S, M, P>(acc, nullptr, a.y + r0 * a.N, a.N, p0);
  }

  // Few rows: the dequantizing FMA would be a third of the work. Per group instead
  // sum_k x*q (codes as floats), then y += scale * that + offset * sum_k x (a.xsum).
  static void run_factored(const Int4Args& a, int64_t p0, int64_t r0) {
    constexpr int S = (M * P <= 2) ? 2 : 1;  // split partial sums: low / high nibble
    const int64_t K = a.K, g = a.g, groups = K / g, gbytes = a.group_bytes();
    const int64_t stride = a.panel_bytes();
    const uint8_t* w = a.w + p0 * stride;
    const float* x = a.x + r0 * K;
    const float* xsum = a.xsum + r0 * groups;  // (groups, M)
    V tot[1][M][P];
    zero_all(tot);
    for (int64_t gi = 0; gi < groups; ++gi) {
      const uint8_t* rec = w + gi * gbytes;
      const uint8_t* nib = rec + 4 * W;
      const float* xg = x + gi * g * M;
      V part[S][M][P];
      zero_all(part);
      for (int64_t j = 0; j < g / 2; ++j) {
        V q0[P], q1[P];
#pragma GCC unroll 4
        for (int p = 0; p < P; ++p) {
          const kv::VI d = kv::widen_u8(nib + p * stride + j * W);
          q0[p] = kv::low_nibble(d);
          q1[p] = kv::high_nibble(d);
        }
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
          const V b0 = kv::splat(xg[2 * j * M + m]);
          const V b1 = kv::splat(xg[(2 * j + 1) * M + m]);
#pragma GCC unroll 4
          for (int p = 0; p < P; ++p) {
            part[0][m][p] = kv::fma(b0, q0[p], part[0][m][p]);
            part[S - 1][m][p] = kv::fma(b1, q1[p], part[S - 1][m][p]);
          }
        }
      }
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) {
        const V sc = kv::widen_f16(rec + p * stride), off = kv::widen_f16(rec + p * stride + 2 * W);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
          const V sum = S == 2 ? part[0][m][p] + part[S - 1][m][p] : part[0][m][p];
          tot[0][m][p] = kv::fma(sum, sc, tot[0][m][p]);
          tot[0][m][p] = kv::fma(kv::splat(xsum[gi * M + m]), off, tot[0][m][p]);
        }
      }
    }
    finish<1, M, P>(tot, nullptr, a.y + r0 * a.N, a.N, p0);
  }
};

template <template <int, int> class B, int M, class Args>
inline void run_rows(int p, const Args& a, int64_t p0, int64_t r0) {
  constexpr int P = B<1, 1>::panels(M);
  if (P > 1 && p == P)
    B<M, P>::run(a, p0, r0);
  else
    B<M, 1>::run(a, p0, r0);
}

template <template <int, int> class B, class Args>
void run_block(int m, int p, const Args& a, int64_t p0, int64_t r0) {
  switch (m) {
    case 1: return run_rows<B, 1>(p, a, p0, r0);
    case 2: return run_rows<B, 2>(p, a, p0, r0);
    case 3: return run_rows<B, 3>(p, a, p0, r0);
    case 4: return run_rows<B, 4>(p, a, p0, r0);
    case 5: return run_rows<B, 5>(p, a, p0, r0);
    case 6: return run_rows<B, 6>(p, a, p0, r0);
    case 7: return run_rows<B, 7>(p, a, p0, r0);
    default: return run_rows<B, 8>(p, a, p0, r0);
  }
}

// The rows of x in chunks of <= 8, each chunk interleaved as (K, rows): a kernel then
// broadcasts x[r0 + m, k] from one pointer plus a constant offset (fewer address registers
// and instructions per FMA). A single row is already in that layout.
inline std::vector<float> interleave_rows(const float* x, int64_t M, int64_t K) {
  std::vector<float> xt(static_cast<size_t>(M * K));
  for (int64_t r0 = 0; r0 < M; r0 += 8) {
    const int64_t rows = std::min<int64_t>(8, M - r0);
    float* out = xt.data() + r0 * K;
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t k = 0; k < K; ++k) out[k * rows + m] = x[(r0 + m) * K + k];
  }
  return xt;
}

// Per chunk of <= 8 rows (as interleave_rows), the sums of x over each group of g.
inline std::vector<float> group_sums(const float* x, int64_t M, int64_t K, int64_t g) {
  const int64_t groups = K / g;
  std::vector<float> out(static_cast<size_t>(M * groups));
  for (int64_t r0 = 0; r0 < M; r0 += 8) {
    const int64_t rows = std::min<int64_t>(8, M - r0);
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t gi = 0; gi < groups; ++gi) {
        float s = 0.0f;
        for (int64_t j = 0; j < g; ++j) s += x[(r0 + m) * K + gi * g + j];
        out[r0 * groups + gi * rows + m] = s;
      }
  }
  return out;
}

// Blocks [b0, b1) of kBlockPanels panels, all rows: inside a block every chunk of <= 8
// rows re-reads the (L1-resident) panels, so DRAM streams the weights once. (Also the
// unit of work of decode.cpp's linear layers.)
template <template <int, int> class B, class Args>
void run_blocks(const Args& a, int64_t b0, int64_t b1) {
  const int64_t panels = (a.N + W - 1) / W;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t first = b * kBlockPanels, end = std::min(panels, first + kBlockPanels);
    for (int64_t r0 = 0; r0 < a.M; r0 += 8) {
      const int m = static_cast<int>(std::min<int64_t>(8, a.M - r0));
      const int p = B<1, 1>::panels(m);
      int64_t p0 = first;
      for (; p0 + p <= end; p0 += p) run_block<B>(m, p, a, p0, r0);
      for (; p0 < end; ++p0) run_block<B>(m, 1, a, p0, r0);
    }
  }
}

// All rows x all panels: parallel over the blocks of kBlockPanels panels.
template <template <int, int> class B, class Args>
void drive(Args a) {
  std::vector<float> xt;
  if (a.M > 1) {
    xt = interleave_rows(a.x, a.M, a.K);
    a.x = xt.data();
  }
  const int64_t panels = (a.N + W - 1) / W;
  const int64_t blocks = (panels + kBlockPanels - 1) / kBlockPanels;
  int64_t nt = omp_in_parallel() ? 1 : omp_get_max_threads();
  nt = std::min({nt, blocks, std::max<int64_t>(1, a.N * a.K / kMinWeightsPerThread)});
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
  for (int64_t b = 0; b < blocks; ++b) run_blocks<B>(a, b, b + 1);
}

}  // namespace
}  // namespace woq
