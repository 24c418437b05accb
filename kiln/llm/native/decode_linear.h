// decode_linear.h — one linear layer of the decode step, y (M, N) = x (M, K) @ W.T (+ bias),
// for every weight kind of decode_desc.h, prepared as a Task of items (decode_team.h).
//
// Kinds: dense fp32 / bf16 / fp16 (decode_gemv.h), INT8 / INT4 weight-only (woq.h, namespace
// woq), and a GGUF tensor's blocks as stored: fp32 activations through gguf_blocks.h
// (kLinGguf, exact) or 8-bit activation blocks through gguf_qdot.h (kLinGgufQ8, integer dot
// products: llama.cpp's arithmetic). A GGUF-Q8 layer takes its input already quantized
// (QInput): layers that read the same x (q/k/v, gate/up) share one quantization.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "decode_desc.h"
#include "decode_gemv.h"
#include "decode_team.h"
#include "gguf_blocks.h"  // GGUF blocks decoded to fp32 in registers: kgguf::run_rows
#include "gguf_q8.h"      // activations as 8-bit blocks: kgguf::QBuffer, QActs
#include "gguf_qdot.h"    // GGUF blocks by integer dot products: kgguf::qd::run_rows
#include "woq.h"  // kiln's INT8 / INT4 kernels: Int8Block, Int4Block, run_blocks, group_sums

namespace kdec {

inline bool is_gguf(int64_t kind) { return kind == kLinGguf || kind == kLinGgufQ8; }

// Bytes of weights a layer streams.
inline int64_t weight_bytes(const Lin& l) {
  if (l.kind < 0) return 0;
  const int64_t n = l.N * l.K, s = dense_storage(l.kind);
  int64_t elems = 1, bytes = 1;
  if (is_gguf(l.kind) && kgguf::block_shape(static_cast<int>(l.g), elems, bytes))
    return n / elems * bytes;
  return s >= 0 ? storage_bytes(static_cast<int>(s)) * n : (l.kind == kLinInt8 ? n : n / 2);
}

// A GGUF layer's items stream at least this many weight bytes each. The integer-dot kernels
// read ~25 GB/s per thread, so split_items' items (down to 16 rows, 10 KB: 0.4 us) cost as
// much to claim and hand over as to compute, and two threads ran slower than one. Measured
// on SmolLM2, 2 threads, AMD EPYC Zen 4, steps of builds alternated in one process: ms/step
// at 0 / 64 / 128 / 256 / 512 KB: Q8_0 6.98 / 4.40 / 4.32 / 4.39 / -, Q4_0 6.37 / 3.84 /
// 3.58 / 3.45 / 3.95, Q4_K_M 6.17 / 3.94 / 3.72 / 3.82 / 4.06.
constexpr int64_t kMinItemBytes = 128 << 10;

// A GGUF-Q8 layer's input: x and its 8-bit blocks (quantized by whoever made them).
struct QInput {
  const float* x;
  kgguf::QActs q;
};

// One linear layer as a Task of items (each a run of blocks: 16 output rows for dense
// weights and GGUF blocks, kBlockPanels panels for INT8 / INT4).
struct LinearJob {
  Lin l;
  int64_t M;
  float* y;
  int storage;  // the dense kinds' storage code, -1 for INT8 / INT4 / GGUF
  DenseArgs f{};
  woq::Int8Args i8{};
  woq::Int4Args i4{};
  kgguf::Args gg{};
  kgguf::qd::Args gq{};
  std::vector<float> xt, xsum;  // woq's interleaved rows (M > 1) or bf16's split pairs;
                                // INT4 group sums
  int64_t blocks = 0, per_item = 1, items = 0;

  // `qx`: x's 8-bit blocks, for a kLinGgufQ8 layer (nullptr otherwise).
  LinearJob(const Lin& lin, const float* x, int64_t rows, float* out, int threads,
            const kgguf::QActs* qx)
      : l(lin), M(rows), y(out), storage(dense_storage(lin.kind)) {
    if (storage < 0 && !is_gguf(l.kind) && M > 1) {  // woq reads rows interleaved (drive)
      xt = woq::interleave_rows(x, M, l.K);
    }
    const float* xk = xt.empty() ? x : xt.data();
    if (storage == kBF16) {
      xt.resize(static_cast<size_t>(M * l.K));
      split_pairs(x, M, l.K, xt.data());
    }
    const auto* w8 = static_cast<const uint8_t*>(l.w);
    if (storage >= 0) {
      f = DenseArgs{x, xt.data(), M, l.K, l.N, l.w, storage, l.bias, y};
      blocks = (l.N + kGemvRowsPerBlock - 1) / kGemvRowsPerBlock;
    } else if (is_gguf(l.kind)) {  // rows as they are; the bias is added by finish
      if (l.kind == kLinGgufQ8)
        gq = kgguf::qd::Args{*qx, M, l.K, l.N, w8, static_cast<int>(l.g), y};
      else
        gg = kgguf::Args{x, M, l.K, l.N, w8, static_cast<int>(l.g), nullptr, y};
      blocks = (l.N + kgguf::kRowsPerItem - 1) / kgguf::kRowsPerItem;
    } else {
      blocks = ((l.N + kv::W - 1) / kv::W + woq::kBlockPanels - 1) / woq::kBlockPanels;
      if (l.kind == kLinInt8) {
        i8 = woq::Int8Args{xk, M, l.K, l.N, static_cast<const int8_t*>(l.w), l.scale, y};
      } else {
        xsum = woq::group_sums(x, M, l.K, l.g);
        i4 = woq::Int4Args{xk, M, l.K, l.N, l.g, w8, y, xsum.data()};
      }
    }
    const int64_t n = split_items(blocks, threads);
    per_item = (blocks + n - 1) / n;
    if (is_gguf(l.kind)) {  // items of at least kMinItemBytes
      const int64_t block_bytes = weight_bytes(l) / l.N * kgguf::kRowsPerItem;
      per_item = std::max(per_item, (kMinItemBytes + block_bytes - 1) / block_bytes);
    }
    items = (blocks + per_item - 1) / per_item;
  }

  // Item i: blocks [b0, b1), into y or (a helper) into scratch (M, N) at the same places.
  static void run(const void* ctx, int64_t i, float* scratch) {
    const LinearJob& j = *static_cast<const LinearJob*>(ctx);
    const int64_t b0 = i * j.per_item, b1 = std::min(j.blocks, b0 + j.per_item);
    const int64_t n0 = b0 * kgguf::kRowsPerItem, n1 = std::min(j.l.N, b1 * kgguf::kRowsPerItem);
    if (j.storage >= 0) {
      DenseArgs a = j.f;
      if (scratch) a.y = scratch;
      gemv_dense(a, b0 * kGemvRowsPerBlock, std::min(j.l.N, b1 * kGemvRowsPerBlock));
    } else if (j.l.kind == kLinGgufQ8) {
      kgguf::qd::Args a = j.gq;
      if (scratch) a.y = scratch;
      kgguf::qd::run_rows(a, n0, n1);
    } else if (j.l.kind == kLinGguf) {
      kgguf::Args a = j.gg;
      if (scratch) a.y = scratch;
      kgguf::run_rows(a, n0, n1);
    } else if (j.l.kind == kLinInt8) {
      woq::Int8Args a = j.i8;
      if (scratch) a.y = scratch;
      woq::run_blocks<woq::Int8Block>(a, b0, b1);
    } else {
      woq::Int4Args a = j.i4;
      if (scratch) a.y = scratch;
      woq::run_blocks<woq::Int4Block>(a, b0, b1);
    }
  }

  // Copies item i's output columns from a helper's scratch to y.
  static void commit(const void* ctx, int64_t i, const float* scratch) {
    const LinearJob& j = *static_cast<const LinearJob*>(ctx);
    const int64_t unit = j.storage >= 0      ? kGemvRowsPerBlock
                         : is_gguf(j.l.kind) ? kgguf::kRowsPerItem
                                             : woq::kBlockPanels * kv::W;
    const int64_t n0 = i * j.per_item * unit, n1 = std::min(j.l.N, (i + 1) * j.per_item * unit);
    for (int64_t r = 0; r < j.M; ++r)
      std::memcpy(j.y + r * j.l.N + n0, scratch + r * j.l.N + n0, sizeof(float) * (n1 - n0));
  }

  Task task() const { return Task{items, &LinearJob::run, &LinearJob::commit, this}; }

  // The bias of the woq kinds (dense adds it in its kernel), once all items are done.
  void finish() const {
    if (storage >= 0 || l.bias == nullptr) return;
    for (int64_t r = 0; r < M; ++r)
      for (int64_t n = 0; n < l.N; ++n) y[r * l.N + n] += l.bias[n];
  }
};

}  // namespace kdec
