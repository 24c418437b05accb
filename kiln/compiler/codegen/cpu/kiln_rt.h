// kiln_rt.h — the ABI between a generated kiln program and the runtime extension.
//
// A generated program is plain C++ (no ATen headers, so it compiles in about a
// second) with one exported entry point. The runtime extension (runtime.cpp,
// built once per machine) loads it with dlopen and calls it once per inference.
#pragma once
#include <cstdint>
#include <type_traits>

extern "C" {
// A parallel task body: processes the index range [begin, end).
typedef void (*kiln_task_fn)(void* task_ctx, int64_t begin, int64_t end);

struct KilnRuntime {
  void* ctx;  // the runtime's Program object; pass back unchanged
  // Runs fn over [begin, end) in chunks on torch's thread pool (at::parallel_for).
  void (*parallel_for)(int64_t begin, int64_t end, int64_t grain, kiln_task_fn fn,
                       void* task_ctx);
  // Runs extern kernel `index` (a library or PyTorch call registered at load time)
  // on `inputs` (data pointers, contiguous, shapes fixed at load time). Returns the
  // data pointer of its contiguous output, valid until the entry point returns.
  void* (*extern_call)(void* ctx, int32_t index, void* const* inputs);
  int32_t num_threads;
};

// buffers: graph inputs, then graph outputs (preallocated, contiguous), then
// params (in registration order), then the arena base (64-byte aligned scratch).
// Returns 0 on success.
int kiln_entry(void* const* buffers, const KilnRuntime* rt);
}

namespace kiln {
// Run a C++ callable f(begin, end) through the runtime's thread pool.
template <class F>
inline void parallel(const KilnRuntime* rt, int64_t n, int64_t grain, F&& f) {
  using Fn = std::remove_reference_t<F>;
  if (n <= 0) return;
  if (n <= grain || rt->num_threads <= 1) {
    f(int64_t{0}, n);
    return;
  }
  rt->parallel_for(
      0, n, grain,
      [](void* c, int64_t b, int64_t e) { (*static_cast<Fn*>(c))(b, e); },
      const_cast<void*>(static_cast<const void*>(&f)));
}
}  // namespace kiln
