// decode.cpp — one whole transformer decode step (all layers, final norm, head) in one call.
//
// decode.py builds the extension (plain g++, no torch headers) and encodes the model as a
// flat int64 "descriptor" (layout in decode_desc.h; floats stored as their double bits,
// tensors as data pointers that the Python side keeps alive). A step reads it, then for B
// sequences at T consecutive positions each (T = 1: plain decoding; T > 1: a draft's tokens
// verified at once, each position attending causally to the cache and the ones before it),
// one activation row per (sequence, position): embedding lookup, per layer norm -> q/k/v
// projections -> (q/k norms) -> rotary (precomputed cos/sin rows) -> in-place KV-cache write ->
// grouped-query attention over the filled prefix (sliding window, soft-cap) -> o projection
// -> (post norm) -> residual -> norm -> MLP -> (post norm) -> residual; then final norm,
// head, soft-cap.
// Linear layers (decode_linear.h): dense fp32 / bf16 / fp16 weights through decode_gemv.h,
// INT8 / INT4 weight-only through woq.h's kernels (kiln/kernels/cpu, namespace woq), GGUF
// tensors' blocks as stored through gguf_blocks.h (fp32 activations) or gguf_qdot.h (8-bit
// activations, integer dot products; namespace kgguf). A bf16 / fp16
// model's embedding table and KV cache stay 16-bit too (decode_half.h); activations are
// fp32. Pointwise math uses kiln_vec.h. Threads: one OpenMP region per step on torch's
// libgomp (the one thread pool), synchronised by work counting (decode_team.h):
// projections (q/k/v together, gate/up together), attention and the head are split across
// threads; norms and pointwise steps (a few thousand floats) run on thread 0.
#include <Python.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "decode_desc.h"
#include "decode_linear.h"  // LinearJob: one linear layer of any kind as a Task
#include "decode_ops.h"
#include "decode_team.h"
#include "kiln_py.h"

namespace kdec {

// Rows of a step: B sequences x T consecutive positions from `pos`; row r = b * T + t is
// sequence b at position pos + t.
struct Rows {
  int64_t B, T, pos;
  int64_t n() const { return B * T; }
  int64_t seq(int64_t r) const { return r / T; }
  int64_t at(int64_t r) const { return pos + r % T; }
};

// Grouped-query attention of every (row, query head) pair, each over its row's sequence's
// cache slots up to the row's own position (the rows' keys are all written before). An
// item is a run of `per_item` consecutive pairs (attention_per_item).
struct AttentionJob {
  const Model* m;
  const Layer* l;
  const float* q;  // (R, H, D)
  float* att;      // (R, H, D)
  float* scores;   // (R, H, max_len)
  Rows rows;
  int64_t per_item;

  int64_t pairs() const { return rows.n() * m->H; }

  // Item i: scores and outputs in the workspace, or (a helper) in scratch: one pair's
  // scores (S floats), then the item's outputs (per_item * D).
  static void run(const void* ctx, int64_t i, float* scratch) {
    const AttentionJob& j = *static_cast<const AttentionJob*>(ctx);
    const Model& m = *j.m;
    const int64_t p0 = i * j.per_item, p1 = std::min(j.pairs(), p0 + j.per_item);
    for (int64_t it = p0; it < p1; ++it) {
      const int64_t r = it / m.H, h = it % m.H, p = j.rows.at(r);
      const int64_t lo = j.l->window > 0 ? std::max<int64_t>(0, p - j.l->window + 1) : 0;
      const int64_t cache = ((j.rows.seq(r) * m.Hkv + h / (m.H / m.Hkv)) * m.S) * m.D;
      float* scores = scratch ? scratch : j.scores + it * m.S;
      float* out = scratch ? scratch + m.S + (it - p0) * m.D : j.att + it * m.D;
      attend_head(m, j.q + it * m.D, j.l->kc, j.l->vc, cache, lo, p, scores, out);
    }
  }

  static void commit(const void* ctx, int64_t i, const float* scratch) {
    const AttentionJob& j = *static_cast<const AttentionJob*>(ctx);
    const int64_t p0 = i * j.per_item, p1 = std::min(j.pairs(), p0 + j.per_item);
    std::memcpy(j.att + p0 * j.m->D, scratch + j.m->S, sizeof(float) * (p1 - p0) * j.m->D);
  }

  Task task() const {
    return Task{(pairs() + per_item - 1) / per_item, &AttentionJob::run, &AttentionJob::commit,
                this};
  }
};

// (row, head) pairs per attention item: at most split_items items for `threads` threads.
int64_t attention_per_item(const Model& m, const Rows& rows, int threads) {
  const int64_t pairs = rows.n() * m.H, n = split_items(pairs, threads);
  return (pairs + n - 1) / n;
}

// ------------------------------------------------------------------ the step
// Jobs of one step: they outlive the region (a late helper may still read one).
struct Jobs {
  std::deque<LinearJob> linear;
  std::deque<AttentionJob> attention;
  std::deque<kgguf::QBuffer> quantized;  // 8-bit blocks of the GGUF-Q8 layers' inputs
  int threads;
};

// Below this many bytes streamed, a step runs on one thread: waking a helper (and, at the
// region's end, waiting for it to leave) costs more than it saves, even more so on a loaded
// machine (~1 ms at 1 thread; a woken thread can wait that long for a core).
constexpr int64_t kTeamMinBytes = 8 << 20;

// Threads for a step streaming `bytes`: `requested` when > 0, else torch's (libgomp's)
// thread count, or 1 for small work or when called from inside a parallel region.
int team_threads(int64_t requested, int64_t bytes) {
  if (requested > 0) return static_cast<int>(requested);
  if (omp_in_parallel() || bytes < kTeamMinBytes) return 1;
  return omp_get_max_threads();
}

// Runs body(team, jobs) on thread 0 of one OpenMP region of `threads` threads
// (decode_team.h); an exception on thread 0 ends the region and is rethrown here.
template <class F>
void in_team(int threads, int64_t max_phases, int64_t scratch_floats, F&& body) {
  Team team(max_phases, threads, scratch_floats);
  Jobs jobs{{}, {}, {}, threads};
  std::exception_ptr failure;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    if (omp_get_thread_num() == 0) {
      try {
        body(team, jobs);
      } catch (...) {
        failure = std::current_exception();
      }
      team.finish();
    } else {
      team.help(omp_get_thread_num());
    }
  }
  if (failure) std::rethrow_exception(failure);
}

// Runs y = x @ W.T (+ bias) for up to 3 linear layers {lin, x, y} as one phase.
struct LinearCall {
  const Lin& l;
  const float* x;
  float* y;
};
// GGUF-Q8 layers reading the same x share its 8-bit blocks, quantized once here.
void linears(Team& team, Jobs& jobs, int64_t M, std::initializer_list<LinearCall> calls) {
  Task tasks[3];
  size_t n = 0;
  const float* quantized_x = nullptr;
  kgguf::QActs qx{};
  for (const LinearCall& c : calls) {
    if (c.l.kind == kLinGgufQ8 && c.x != quantized_x) {
      qx = jobs.quantized.emplace_back().quantize(c.x, M, c.l.K);
      quantized_x = c.x;
    }
    jobs.linear.emplace_back(c.l, c.x, M, c.y, jobs.threads, &qx);
    tasks[n++] = jobs.linear.back().task();
  }
  team.run({tasks[0], tasks[1], tasks[2]});
  for (size_t i = 0; i < n; ++i) jobs.linear[jobs.linear.size() - n + i].finish();
}

void layer_step(Team& team, Jobs& jobs, const Model& m, const Layer& l, const Rows& rows,
                float* ws) {
  const int64_t R = rows.n(), C = m.C, QD = m.H * m.D, KD = m.Hkv * m.D;  // R rows
  float *x = ws, *h = x + R * C, *t = h + R * C, *q = t + R * C, *att = q + R * QD;
  float *k = att + R * QD, *v = k + R * KD, *g = v + R * KD, *u = g + R * m.F;
  float* scores = u + R * m.F;
  norm_rows(m, l.attn_norm, x, h, R, C);
  linears(team, jobs, R, {{l.q, h, q}, {l.k, h, k}, {l.v, h, v}});
  if (l.q_norm.w) norm_rows(m, l.q_norm, q, q, R * m.H, m.D);
  if (l.k_norm.w) norm_rows(m, l.k_norm, k, k, R * m.Hkv, m.D);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t p = rows.at(r);
    if (l.cos) {
      rotate(q + r * QD, m.H, m.D, l.cos + p * m.D, l.sin + p * m.D);
      rotate(k + r * KD, m.Hkv, m.D, l.cos + p * m.D, l.sin + p * m.D);
    }
    for (int64_t h = 0; h < m.Hkv; ++h) {  // cache (B, Hkv, S, D): slot p of the row's sequence
      const int64_t slot = ((rows.seq(r) * m.Hkv + h) * m.S + p) * m.D;
      write_row(k + (r * m.Hkv + h) * m.D, l.kc, m.cache_storage, slot, m.D);
      write_row(v + (r * m.Hkv + h) * m.D, l.vc, m.cache_storage, slot, m.D);
    }
  }
  const int64_t per_item = attention_per_item(m, rows, jobs.threads);
  jobs.attention.push_back(AttentionJob{&m, &l, q, att, scores, rows, per_item});
  team.run({jobs.attention.back().task()});
  linears(team, jobs, R, {{l.o, att, t}});
  if (l.post_attn.w) norm_rows(m, l.post_attn, t, t, R, C);
  for (int64_t i = 0; i < R * C; ++i) x[i] += t[i];
  norm_rows(m, l.mlp_norm, x, h, R, C);
  if (l.gate.kind >= 0) {
    linears(team, jobs, R, {{l.gate, h, g}, {l.up, h, u}});
    activate(m, g, u, R * m.F);
  } else {
    linears(team, jobs, R, {{l.up, h, g}});
    activate(m, g, nullptr, R * m.F);
  }
  linears(team, jobs, R, {{l.down, g, t}});
  if (l.post_mlp.w) norm_rows(m, l.post_mlp, t, t, R, C);
  for (int64_t i = 0; i < R * C; ++i) x[i] += t[i];
}

// Phases one layer runs (q/k/v, attention, o, gate/up, down); the head is one more.
constexpr int64_t kPhasesPerLayer = 5;

// One decode step of tokens (B, T) at positions pos..pos+T-1 -> logits (B, T, V), on
// `threads` threads (0: automatic, see team_threads).
std::string step(const int64_t* desc, const int64_t* tokens, int64_t pos, int64_t T,
                 float* logits, float* ws, int64_t ws_floats, int64_t threads) {
  Reader r{desc};
  Model m{};
  std::string err = read_model(r, m);
  if (!err.empty()) return err;
  std::vector<Layer> layers(static_cast<size_t>(m.L));
  for (int64_t li = 0; li < m.L; ++li) {
    err = read_layer(r, layers[li]);
    if (!err.empty()) return "layer " + std::to_string(li) + ": " + err;
  }
  if (T < 1) return "a step needs at least one position per sequence, got " + std::to_string(T);
  if (pos < 0 || pos + T > m.S)
    return "positions " + std::to_string(pos) + ".." + std::to_string(pos + T - 1) +
           " are outside the cache's " + std::to_string(m.S) + " slots";
  const Rows rows{m.B, T, pos};
  const int64_t R = rows.n(), C = m.C;  // activation rows, one per (sequence, position)
  if (ws_floats < workspace_floats(m, R)) return "workspace is too small for this step";
  for (int64_t r = 0; r < R; ++r)
    if (tokens[r] < 0 || tokens[r] >= m.Vocab)
      return "token " + std::to_string(tokens[r]) + " is outside the vocabulary of " +
             std::to_string(m.Vocab);
  float *x = ws, *h = x + R * C;
  for (int64_t r = 0; r < R; ++r) {  // x = embed[token] * scale (+ pos_embed[p]); h: scratch
    float* xr = x + r * C;
    read_row(m.embed, m.embed_storage, tokens[r] * C, xr, C);
    if (m.embed_scale != 1.0f)
      for (int64_t i = 0; i < C; ++i) xr[i] *= m.embed_scale;
    if (m.pos_embed) {
      read_row(m.pos_embed, m.embed_storage, (rows.at(r) + m.learned_offset) * C, h, C);
      for (int64_t i = 0; i < C; ++i) xr[i] += h[i];
    }
  }
  // A helper's scratch: one linear layer's (R, N) output, or an attention item's scores and
  // outputs.
  const int64_t widest = std::max({m.Vocab, m.F, m.H * m.D, m.C});
  int64_t bytes = weight_bytes(m.head) +  // + the KV cache read
                  2 * storage_bytes(m.cache_storage) * m.B * m.Hkv * (pos + T) * m.D * m.L;
  for (const Layer& l : layers)
    for (const Lin* lin : {&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down})
      bytes += weight_bytes(*lin);
  const int nt = team_threads(threads, bytes);
  const int64_t scratch = std::max(R * widest, m.S + attention_per_item(m, rows, nt) * m.D);
  in_team(nt, kPhasesPerLayer * m.L + 1, scratch, [&](Team& t, Jobs& j) {
    for (const Layer& l : layers) layer_step(t, j, m, l, rows, ws);
    norm_rows(m, m.final_norm, x, h, R, C);
    linears(t, j, R, {{m.head, h, logits}});
  });
  if (m.final_softcap > 0.0f)
    for (int64_t i = 0; i < R * m.Vocab; ++i)
      logits[i] = std::tanh(logits[i] / m.final_softcap) * m.final_softcap;
  return "";
}

// ------------------------------------------------------------------ Python bindings
using kpy::read_ints;

// Runs f() (returning "" or an error) without the GIL; errors become Python exceptions.
template <class F>
PyObject* released(const char* what, F&& f) {
  std::string err;
  bool oom = false;
  Py_BEGIN_ALLOW_THREADS
  try {
    err = f();
  } catch (const std::bad_alloc&) {
    oom = true;
  } catch (const std::exception& e) {
    err = std::string("internal error: ") + e.what();
  }
  Py_END_ALLOW_THREADS
  if (oom) return PyErr_NoMemory();
  if (!err.empty()) return PyErr_Format(PyExc_ValueError, "%s: %s", what, err.c_str());
  Py_RETURN_NONE;
}

// workspace_floats(desc, rows): scratch floats of a step of `rows` (sequence, position) rows.
PyObject* py_workspace_floats(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  int64_t v[2];
  if (!read_ints(args, nargs, 2, v, "workspace_floats")) return nullptr;
  Reader r{reinterpret_cast<const int64_t*>(v[0])};
  Model m{};
  const std::string err = read_model(r, m);
  if (!err.empty()) return PyErr_Format(PyExc_ValueError, "%s", err.c_str());
  return PyLong_FromLongLong(workspace_floats(m, v[1]));
}

// step(desc, tokens, pos, T, logits, workspace, workspace_floats, threads)
PyObject* py_step(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  int64_t v[8];
  if (!read_ints(args, nargs, 8, v, "step")) return nullptr;
  return released("decode step", [&] {
    return step(reinterpret_cast<const int64_t*>(v[0]), reinterpret_cast<const int64_t*>(v[1]),
                v[2], v[3], reinterpret_cast<float*>(v[4]), reinterpret_cast<float*>(v[5]), v[6],
                v[7]);
  });
}

// linear(record, x, M, y, threads): one LIN record (7 int64) applied to M rows.
PyObject* py_linear(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  int64_t v[5];
  if (!read_ints(args, nargs, 5, v, "linear")) return nullptr;
  Reader r{reinterpret_cast<const int64_t*>(v[0])};
  const Lin l = r.lin();
  return released("linear", [&]() -> std::string {
    if (l.kind < kLinFp32 || l.kind > kLinGgufQ8) return "unknown kind " + std::to_string(l.kind);
    int64_t elems, bytes;
    if (is_gguf(l.kind) && !kgguf::block_shape(static_cast<int>(l.g), elems, bytes))
      return "no GGUF block kernel for ggml type " + std::to_string(l.g);
    const auto* x = reinterpret_cast<const float*>(v[1]);
    auto* y = reinterpret_cast<float*>(v[3]);
    const int nt = team_threads(v[4], weight_bytes(l));
    in_team(nt, 1, v[2] * l.N, [&](Team& t, Jobs& j) { linears(t, j, v[2], {{l, x, y}}); });
    return "";
  });
}

PyObject* py_decode_lanes(PyObject*, PyObject*) { return PyLong_FromLong(kv::W); }

#define KDEC_FASTCALL(f) reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(f))
PyMethodDef kDecodeMethods[] = {
    {"step", KDEC_FASTCALL(py_step), METH_FASTCALL,
     "step(desc, tokens, pos, T, logits, workspace, workspace_floats, threads): one step"},
    {"workspace_floats", KDEC_FASTCALL(py_workspace_floats), METH_FASTCALL,
     "workspace_floats(desc, rows): scratch floats of a step of `rows` rows"},
    {"linear", KDEC_FASTCALL(py_linear), METH_FASTCALL,
     "linear(record, x, M, y, threads): y = x @ W.T + bias for one LIN record"},
    {"lanes", py_decode_lanes, METH_NOARGS, "float lanes per vector (woq panel width)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kDecodeModule = {PyModuleDef_HEAD_INIT, "kiln_decode_ext",
                             "kiln's whole-model decode step", -1, kDecodeMethods,
                             nullptr, nullptr, nullptr, nullptr};

}  // namespace kdec

PyMODINIT_FUNC PyInit_kiln_decode_ext() { return PyModule_Create(&kdec::kDecodeModule); }

