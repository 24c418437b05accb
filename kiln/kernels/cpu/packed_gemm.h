// packed_gemm.h — y (M, N) = x (M, K) @ W.T for many rows (prefill), W in a packed format:
// kiln's INT4 / INT8 panels (woq.h's layouts) or a GGUF tensor's blocks (gguf_blocks.h).
//
// At prefill a linear layer sees hundreds or thousands of rows and is compute-bound: the
// decode kernels (woq.h, gguf_blocks.h), which widen every weight in registers for each
// chunk of <= 8 rows, then spend as much on decoding as on multiplying. Here each weight is
// decoded once per block of rows into a small float tile that stays in cache, and a
// register-blocked micro-kernel multiplies the tile against the rows:
//
//   tile   NR = 2 W output channels x K, k-major: tile[k * NR + c] (K * NR * 4 bytes: 74 KB
//          for K = 576 on AVX-512, in L2), zero in the channels past N;
//   micro  MR rows x NR channels of accumulators in registers (AVX-512: 12 x 2 zmm = 24;
//          AVX2: 6 x 2 ymm = 12), per k two vector loads of the tile and MR broadcast FMAs;
//          the sum over k runs in order, in fp32 (one FMA rounding per term), and each output
//          is written once;
//   rows   in blocks of kBlockRows (the block of x is re-read by every tile of a thread from
//          L2 / L3); a tile is decoded once per block of rows (kept when a thread has one);
//   k      in passes of kBlockK (the tile's part in L2 for a wide K): a later pass starts its
//          accumulators from y, so the sum is the same chain as in one pass.
// Measured on AMD EPYC Zen 4 (AVX-512, 1 thread, best of 40): 105-113 GFLOP/s on SmolLM2's
// INT4 layers at 512 rows, where MKL's sgemm on the already-dequantized fp32 weight reached
// 90-100; full-K tiles beat passes of 128 / 256 k there, and 96 / 384 rows per block were no
// better than 192.
// Threads (drive): the tiles (pairs of W-channel panels) are split across OpenMP threads, each
// with its own tile buffer. The extension links libgomp.so.1, torch's copy: torch's pool.
// Each output is summed by one thread in a fixed order: results do not depend on threads.
//
// Decoding (into the tile): INT4 w = q * scale + offset (one FMA, as woq.h), INT8 w = q *
// scale (as kiln.kernels.formats.dequantize_int8), GGUF the block's own formula
// (gguf_blocks.h's group decoders, then a transpose to k-major).
// Header-only (namespace kpg), SIMD through kiln_vec.h: AVX-512 (W = 16) or AVX2 (W = 8).
#pragma once
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <new>

#include "gguf_blocks.h"
#include "kiln_vec.h"

namespace kpg {
namespace {  // internal linkage: each extension including this gets its own copy

using kv::V;
using kv::VI;
using kv::W;

constexpr int NV = 2;                   // vectors of output channels per tile
constexpr int NR = NV * W;              // output channels per tile: 32 (AVX-512), 16 (AVX2)
constexpr int MR = W == 16 ? 12 : 6;    // rows per micro-kernel: accumulators fill the registers
constexpr int64_t kBlockRows = 16 * MR; // rows per block (x block reused by a thread's tiles)
constexpr int64_t kBlockK = 2048;       // k per pass over a block of rows (tile part in L2)
// A thread is only worth waking for this many multiply-adds (~tens of microseconds).
constexpr int64_t kMinMacsPerThread = 1 << 21;

// ------------------------------------------------------------------ tile decoders
// Each fills tile (K * NR floats, k-major) with output channels [n0, n0 + NR) of the weight,
// zeros for channels >= N.

// INT4 panels (woq.h): panel p, group i: scale fp16 [W], offset fp16 [W], g/2 rows of W bytes
// (low nibble: element 2j, high: 2j + 1).
struct Int4Panels {
  const uint8_t* w;
  int64_t K, N, g;
  int64_t group_bytes() const { return 4 * W + g / 2 * W; }
  int64_t panel_bytes() const { return K / g * group_bytes(); }
  void decode(int64_t n0, float* tile) const {
    const int64_t groups = K / g, gbytes = group_bytes(), stride = panel_bytes();
    for (int v = 0; v < NV; ++v) {
      const int64_t p = n0 / W + v;
      float* out = tile + v * W;
      if (p * W >= N) {  // a panel past the weight: zeros
        for (int64_t k = 0; k < K; ++k) kv::store(out + k * NR, kv::splat(0.0f));
        continue;
      }
      const uint8_t* panel = w + p * stride;
      for (int64_t gi = 0; gi < groups; ++gi) {
        const uint8_t* rec = panel + gi * gbytes;
        const V sc = kv::widen_f16(rec), off = kv::widen_f16(rec + 2 * W);
        const uint8_t* nib = rec + 4 * W;
        float* o = out + gi * g * NR;
        for (int64_t j = 0; j < g / 2; ++j) {
          const kv::VI d = kv::widen_u8(nib + j * W);
          kv::store(o + (2 * j) * NR, kv::fma(kv::low_nibble(d), sc, off));
          kv::store(o + (2 * j + 1) * NR, kv::fma(kv::high_nibble(d), sc, off));
        }
      }
    }
  }
};

// INT8 panels (woq.h): panel p is int8 [K][W]; scale fp32 (panels * W,).
struct Int8Panels {
  const int8_t* w;
  const float* scale;
  int64_t K, N;
  void decode(int64_t n0, float* tile) const {
    for (int v = 0; v < NV; ++v) {
      const int64_t p = n0 / W + v;
      float* out = tile + v * W;
      if (p * W >= N) {
        for (int64_t k = 0; k < K; ++k) kv::store(out + k * NR, kv::splat(0.0f));
        continue;
      }
      const int8_t* panel = w + p * K * W;
      const V s = kv::load(scale + p * W);
      for (int64_t k = 0; k < K; ++k) kv::store(out + k * NR, kv::widen_i8(panel + k * W) * s);
    }
  }
};

// The W x W floats r[i][j] (row i, lane j) transposed in registers: log2(W) stages, stage B
// swapping bit B of the row index with bit B of the lane index (two-vector shuffles).
template <int B>
KV_INLINE void transpose_stage(V (&r)[W]) {
  VI lo, hi;  // constants once unrolled
#pragma GCC unroll 16
  for (int j = 0; j < W; ++j) {
    lo[j] = (j & B) ? W + (j ^ B) : j;  // row i (bit B clear): from row i, or row i | B
    hi[j] = (j & B) ? W + j : (j ^ B);  // row i | B
  }
#pragma GCC unroll 16
  for (int i = 0; i < W; ++i)
    if (!(i & B)) {
      const V a = r[i], b = r[i | B];
      r[i] = __builtin_shuffle(a, b, lo);
      r[i | B] = __builtin_shuffle(a, b, hi);
    }
}
KV_INLINE void transpose(V (&r)[W]) {
  transpose_stage<1>(r);
  transpose_stage<2>(r);
  transpose_stage<4>(r);
  if constexpr (W == 16) transpose_stage<8>(r);
}

// A GGUF tensor's blocks, row after row (gguf_blocks.h): per group of 32 elements, W
// channels' values are decoded in registers (gguf_blocks.h's decoders), transposed W x W in
// registers and stored k-major.
template <class F>
struct GgufRows {
  const uint8_t* w;
  int64_t K, N;
  void decode(int64_t n0, float* tile) const {
    constexpr int kVecs = kgguf::kVecs;
    const int64_t blocks = K / F::kElems, row_bytes = blocks * F::kBytes;
    for (int v = 0; v < NV; ++v) {
      const int64_t c0 = n0 + v * W;
      const int64_t valid = std::clamp<int64_t>(N - c0, 0, W);
      const uint8_t* rows = w + c0 * row_bytes;
      for (int64_t blk = 0; blk < blocks; ++blk)
        for (int gi = 0; gi < F::kElems / kgguf::kGroup; ++gi) {
          V r[kVecs][W];
          for (int c = 0; c < W; ++c) {
            V wv[kVecs];
            if (c < valid)
              F::group(rows + c * row_bytes + blk * F::kBytes, gi, wv);
            else
              for (int u = 0; u < kVecs; ++u) wv[u] = kv::splat(0.0f);
#pragma GCC unroll 4
            for (int u = 0; u < kVecs; ++u) r[u][c] = wv[u];
          }
          float* o = tile + (blk * F::kElems + gi * kgguf::kGroup) * NR + v * W;
#pragma GCC unroll 4
          for (int u = 0; u < kVecs; ++u) {
            transpose(r[u]);
#pragma GCC unroll 16
            for (int e = 0; e < W; ++e) kv::store(o + (u * W + e) * NR, r[u][e]);
          }
        }
    }
  }
};

// ------------------------------------------------------------------ micro-kernel
// y[r, n0 + c] = sum_k x[r, k] * tile[k, c] for R rows (R <= MR) and `cols` valid channels.
template <int R>
KV_INLINE void micro(const float* x, int64_t ldx, int64_t k0, int64_t k1, const float* tile,
                     float* y, int64_t N, int64_t cols) {
  V acc[R][NV];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      const int64_t c = v * W;
      if (k0 == 0)
        acc[r][v] = kv::splat(0.0f);
      else  // continue the sum of the previous k block: the same chain as one pass
        acc[r][v] = c + W <= cols ? kv::load(y + r * N + c)
                                  : kv::loadn(y + r * N + c, static_cast<int>(cols - c), 0.0f);
    }
  for (int64_t k = k0; k < k1; ++k) {
    V w[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) w[v] = kv::load(tile + k * NR + v * W);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const V xb = kv::splat(x[r * ldx + k]);
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[r][v] = kv::fma(xb, w[v], acc[r][v]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      const int64_t c = v * W;
      if (c + W <= cols)
        kv::store(y + r * N + c, acc[r][v]);
      else if (c < cols)
        kv::storen(y + r * N + c, acc[r][v], static_cast<int>(cols - c));
    }
}

// Rows [r0, r1) against one tile (channels n0 ..), in micro-kernels of MR rows.
inline void rows_tile(const float* x, int64_t K, int64_t k0, int64_t k1, int64_t N,
                      const float* tile, int64_t n0, int64_t r0, int64_t r1, float* y) {
  const int64_t cols = std::min<int64_t>(NR, N - n0);
  int64_t r = r0;
  for (; r + MR <= r1; r += MR) micro<MR>(x + r * K, K, k0, k1, tile, y + r * N + n0, N, cols);
  const float* xr = x + r * K;
  float* yr = y + r * N + n0;
  switch (r1 - r) {  // the last, partial block of rows
    case 0: break;
    case 1: micro<1>(xr, K, k0, k1, tile, yr, N, cols); break;
    case 2: micro<2>(xr, K, k0, k1, tile, yr, N, cols); break;
    case 3: micro<3>(xr, K, k0, k1, tile, yr, N, cols); break;
    case 4: micro<4>(xr, K, k0, k1, tile, yr, N, cols); break;
    case 5: micro<5>(xr, K, k0, k1, tile, yr, N, cols); break;
#if KV_BYTES == 64
    case 6: micro<6>(xr, K, k0, k1, tile, yr, N, cols); break;
    case 7: micro<7>(xr, K, k0, k1, tile, yr, N, cols); break;
    case 8: micro<8>(xr, K, k0, k1, tile, yr, N, cols); break;
    case 9: micro<9>(xr, K, k0, k1, tile, yr, N, cols); break;
    case 10: micro<10>(xr, K, k0, k1, tile, yr, N, cols); break;
    case 11: micro<11>(xr, K, k0, k1, tile, yr, N, cols); break;
#endif
    default: break;  // r1 - r < MR
  }
}

// Threads for `macs` multiply-adds over `items` tiles (1 inside a parallel region).
inline int64_t threads_for(int64_t items, int64_t macs) {
  const int64_t nt = omp_in_parallel() ? 1 : omp_get_max_threads();
  return std::max<int64_t>(1, std::min({nt, items, macs / kMinMacsPerThread}));
}

// Runs the tiles [0, tiles) on `nt` OpenMP threads, each a contiguous range (static: on
// this shared 2-core machine a dynamic schedule of (row block, tile) items measured 0.7-1.0x
// the static split's speed at 2 threads, equal at 1): every thread first runs prologue()
// (work-shared loops in it end at their barrier), then range(first, last, buffer) with a
// 64-byte-aligned buffer of `bytes` of its own. Throws std::bad_alloc.
template <class Prologue, class Range>
void for_tile_ranges(int64_t tiles, int64_t nt, size_t bytes, Prologue&& prologue,
                     Range&& range) {
  bool failed = false;
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    prologue();
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    void* buffer = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (buffer == nullptr) {
#pragma omp atomic write
      failed = true;
    } else {
      range(tiles * t / n, tiles * (t + 1) / n, buffer);
      std::free(buffer);
    }
  }
  if (failed) throw std::bad_alloc();
}

// The whole product: the tiles split across threads (for_tile_ranges), rows in blocks, so a
// thread's L2 keeps the block of x for all its tiles. `block_rows` (0: kBlockRows) is the
// rows per block. Throws std::bad_alloc.
template <class Decoder>
void drive(const Decoder& dec, const float* x, int64_t M, int64_t K, int64_t N, float* y,
           int64_t block_rows = 0) {
  const int64_t tiles = (N + NR - 1) / NR;
  const int64_t mb = block_rows > 0 ? block_rows : kBlockRows;
  const auto range = [&](int64_t first, int64_t last, void* buffer) {
    float* tile = static_cast<float*>(buffer);
    for (int64_t r0 = 0; r0 < M; r0 += mb) {
      const int64_t r1 = std::min(M, r0 + mb);
      for (int64_t i = first; i < last; ++i) {
        if (r0 == 0 || first + 1 != last) dec.decode(i * NR, tile);  // one tile: kept
        for (int64_t k0 = 0; k0 < K; k0 += kBlockK)
          rows_tile(x, K, k0, std::min(K, k0 + kBlockK), N, tile, i * NR, r0, r1, y);
      }
    }
  };
  for_tile_ranges(tiles, threads_for(tiles, M * K * N), sizeof(float) * K * NR, [] {}, range);
}

// y = x @ W.T for the GGUF ggml type `type` (the caller has checked kgguf::block_shape).
inline void gguf(int type, const uint8_t* w, const float* x, int64_t M, int64_t K, int64_t N,
                 float* y, int64_t block_rows = 0) {
  kgguf::with_format(type, [&](auto fmt) {
    using F = decltype(fmt);
    drive(GgufRows<F>{w, K, N}, x, M, K, N, y, block_rows);
  });
}

}  // namespace
}  // namespace kpg
