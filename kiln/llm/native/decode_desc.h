// decode_desc.h — the decode step's model descriptor: layout, parsed structs, workspace.
//
// Descriptor (all int64; F = a double's bits, P = a pointer, NORM = P weight, P bias
// (0 = absent; weight 0 = no norm), LIN = kind (-1 none, 0 fp32, 1 int8, 2 int4, 3 bf16,
// 4 fp16, 5 GGUF blocks, 6 GGUF blocks with 8-bit activations), N, K, group (GGUF: the
// ggml type), P weight, P scale, P bias;
// S = a storage code of decode_half.h):
//   header: kMagic, n_layers, B, C, H, Hkv, D, F_inter, V, max_len, norm_kind (0 rms,
//           1 layer), F eps, F norm_offset, act (0 silu, 1 gelu, 2 gelu_tanh, 3 relu),
//           F attn_scale, F attn_softcap (0 none), F final_softcap (0 none), F embed_scale,
//           S embed, P embed (V, C), P pos_embed (0 none; storage S embed), learned_offset,
//           S cache, NORM final, LIN head
//   per layer: NORM attn, NORM q_norm, NORM k_norm, LIN q, k, v, o, NORM post_attn,
//           NORM mlp, LIN gate (kind -1 when plain), LIN up, LIN down, NORM post_mlp,
//           P k_cache (B, Hkv, max_len, D; storage S cache), P v_cache, window (0 none),
//           P rope_cos (max_len, D), P rope_sin (0 = no rotary), kLayerEnd
// decode.py writes this layout (Descriptor); a step parses it into Model and Layer.
#pragma once
#include <cstdint>
#include <cstring>
#include <string>

namespace kdec {

constexpr int64_t kMagic = 0x6B696C6E64656302;  // "kilndec" + layout version 2
constexpr int64_t kLayerEnd = 0x6C61796572656E64;

// Linear kinds: dense (a weight matrix of one storage type), woq.h's packed layouts, or a
// GGUF tensor's blocks as stored (the record's group is the ggml type), multiplied with fp32
// activations (gguf_blocks.h) or with 8-bit activation blocks (gguf_qdot.h).
enum : int64_t { kLinFp32 = 0, kLinInt8 = 1, kLinInt4 = 2, kLinBf16 = 3, kLinFp16 = 4,
                 kLinGguf = 5, kLinGgufQ8 = 6 };

// The storage code of a dense kind, or -1 for a packed (woq, GGUF) kind.
inline int dense_storage(int64_t kind) {
  return kind == kLinFp32 ? 0 : (kind == kLinBf16 ? 1 : (kind == kLinFp16 ? 2 : -1));
}

struct Norm {
  const float* w;
  const float* b;
};
struct Lin {
  int64_t kind, N, K, g;
  const void* w;
  const float* scale;
  const float* bias;
};
struct Layer {
  Norm attn_norm, q_norm, k_norm;
  Lin q, k, v, o;
  Norm post_attn;
  Norm mlp_norm;
  Lin gate, up, down;
  Norm post_mlp;
  void *kc, *vc;  // storage Model::cache_storage
  int64_t window;
  const float *cos, *sin;
};
struct Model {
  int64_t L, B, C, H, Hkv, D, F, Vocab, S, norm_kind, act, learned_offset;
  int embed_storage, cache_storage;
  float eps, norm_offset, attn_scale, attn_softcap, final_softcap, embed_scale;
  const void *embed, *pos_embed;  // storage embed_storage
  Norm final_norm;
  Lin head;
};

struct Reader {
  const int64_t* p;
  int64_t i() { return *p++; }
  float f() {
    double d;
    std::memcpy(&d, p++, sizeof d);
    return static_cast<float>(d);
  }
  template <class T>
  T* ptr() {
    return reinterpret_cast<T*>(*p++);
  }
  Norm norm() { return Norm{ptr<const float>(), ptr<const float>()}; }
  Lin lin() {
    Lin l{};
    l.kind = i(), l.N = i(), l.K = i(), l.g = i();
    l.w = ptr<const void>(), l.scale = ptr<const float>(), l.bias = ptr<const float>();
    return l;
  }
};

// Parses the header; `r` is left at the first layer. Returns "" or what is wrong.
std::string read_model(Reader& r, Model& m) {
  if (r.i() != kMagic) return "descriptor does not start with the decode layout's magic";
  m.L = r.i(), m.B = r.i(), m.C = r.i(), m.H = r.i(), m.Hkv = r.i(), m.D = r.i();
  m.F = r.i(), m.Vocab = r.i(), m.S = r.i(), m.norm_kind = r.i();
  m.eps = r.f(), m.norm_offset = r.f(), m.act = r.i();
  m.attn_scale = r.f(), m.attn_softcap = r.f(), m.final_softcap = r.f(), m.embed_scale = r.f();
  m.embed_storage = static_cast<int>(r.i());
  m.embed = r.ptr<const void>(), m.pos_embed = r.ptr<const void>();
  m.learned_offset = r.i();
  m.cache_storage = static_cast<int>(r.i());
  for (int s : {m.embed_storage, m.cache_storage})
    if (s < 0 || s > 2) return "unknown storage code " + std::to_string(s);
  m.final_norm = r.norm();
  m.head = r.lin();
  return "";
}

std::string read_layer(Reader& r, Layer& l) {
  l.attn_norm = r.norm(), l.q_norm = r.norm(), l.k_norm = r.norm();
  l.q = r.lin(), l.k = r.lin(), l.v = r.lin(), l.o = r.lin();
  l.post_attn = r.norm(), l.mlp_norm = r.norm();
  l.gate = r.lin(), l.up = r.lin(), l.down = r.lin();
  l.post_mlp = r.norm();
  l.kc = r.ptr<void>(), l.vc = r.ptr<void>();
  l.window = r.i();
  l.cos = r.ptr<const float>(), l.sin = r.ptr<const float>();
  if (r.i() != kLayerEnd) return "a layer record does not end with its marker";
  return "";
}

// Scratch floats a step of R activation rows (B sequences x T positions) needs: x, h, t
// (R, C); q, att (R, H*D); k, v (R, Hkv*D); gate, up (R, F); attention scores (R, H, max_len).
int64_t workspace_floats(const Model& m, int64_t R) {
  return R * (3 * m.C + 2 * m.H * m.D + 2 * m.Hkv * m.D + 2 * m.F + m.H * m.S);
}

}  // namespace kdec
