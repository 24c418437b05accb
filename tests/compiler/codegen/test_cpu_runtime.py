"""The runtime extension (runtime.cpp): Program end to end with hand-written programs."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kiln.compiler.codegen.cpu import build, pack
from tests.support.compare import assert_close_to_reference

pytestmark = pytest.mark.runtime_build
F32 = torch.float32

# out0 = relu(x * 2) through kiln::parallel; out1 = gelu(x) + y with gelu from extern 0;
# out2 = (x > y) as bool. Shapes (4, 1000).
PROGRAM = r"""
#include "kiln_rt.h"
#include "kiln_vec.h"
using namespace kv;
extern "C" int kiln_entry(void* const* buf, const KilnRuntime* rt) {
  const float* x = (const float*)buf[0];
  const float* y = (const float*)buf[1];
  float* o0 = (float*)buf[2];
  float* o1 = (float*)buf[3];
  uint8_t* o2 = (uint8_t*)buf[4];
  const int64_t n = 4 * 1000, vecs = (n + W - 1) / W;
  kiln::parallel(rt, vecs, 8, [&](int64_t b, int64_t e) {
    for (int64_t v = b; v < e; ++v) {
      const int64_t i = v * W;
      const int r = n - i < W ? int(n - i) : W;
      const V xv = loadn(x + i, r, 0), yv = loadn(y + i, r, 0);
      storen(o0 + i, relu(xv * 2.0f), r);
      store_u8n(o2 + i, cmp_gt(xv, yv), r);
    }
  });
  void* ins[1] = {buf[0]};
  const float* g = (const float*)rt->extern_call(rt->ctx, 0, ins);
  if (!g) return 1;
  for (int64_t i = 0; i < n; ++i) o1[i] = g[i] + y[i];
  return 0;
}
"""

# out = relu(A @ B + bias) with B packed (param 0), bias (param 1); the A rows are staged
# in the arena first (checks arena alignment: rc 2 if not 64-byte aligned).
GEMM_PROGRAM = r"""
#include <cstring>
#include "kiln_gemm.h"
using namespace kv;
constexpr int64_t M = 13, K = 300, N = 300;
extern "C" int kiln_entry(void* const* buf, const KilnRuntime* rt) {
  const float* A = (const float*)buf[0];
  float* C = (float*)buf[1];
  const float* Bp = (const float*)buf[2];
  const float* bias = (const float*)buf[3];
  float* arena = (float*)buf[4];
  if (reinterpret_cast<uintptr_t>(arena) % 64 != 0) return 2;
  std::memcpy(arena, A, sizeof(float) * M * K);
  kg::gemm(rt, arena, K, M, Bp, K, N, [&](int64_t row, int64_t col0, V a0, V a1) {
    for (int h = 0; h < 2; ++h) {
      const int64_t col = col0 + h * W, left = N - col;
      if (left <= 0) return;
      const int r = left < W ? int(left) : W;
      storen(C + row * N + col, relu((h ? a1 : a0) + loadn(bias + col, r, 0)), r);
    }
  });
  return 0;
}
"""

FAILING = r"""
#include "kiln_rt.h"
extern "C" int kiln_entry(void* const* buf, const KilnRuntime* rt) { return 3; }
"""


def _program(runtime: ModuleType, externs: list[tuple]) -> Any:
    so = build.compile_program(PROGRAM)
    shape = [4, 1000]
    return runtime.Program(
        str(so), [], 64, [shape, shape], [F32, F32], [shape, shape, shape],
        [F32, F32, torch.bool], externs,
    )  # fmt: skip


def test_program_end_to_end(runtime: ModuleType) -> None:
    calls = []

    def gelu(t: torch.Tensor) -> torch.Tensor:
        calls.append(t.shape)
        return F.gelu(t).t().contiguous().t()  # non-contiguous: the runtime copies it

    prog = _program(runtime, [(gelu, [[4, 1000]], [F32], [4, 1000], F32)])
    assert (prog.num_inputs, prog.num_outputs, prog.num_params) == (2, 3, 0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 1000, generator=g), torch.randn(4, 1000, generator=g)
    for _ in range(2):  # the second run reuses buffers and must not see stale state
        o0, o1, o2 = prog.run([x, y])
        assert torch.equal(o0, torch.relu(x * 2))
        assert torch.equal(o1, F.gelu(x) + y)
        assert o2.dtype == torch.bool and torch.equal(o2, x > y)
    assert calls == [torch.Size([4, 1000])] * 2
    o0b, _, _ = prog.run((x * -1, y))  # tuples work; outputs are fresh tensors
    assert o0b.data_ptr() != o0.data_ptr() and torch.equal(o0b, torch.relu(-x * 2))


def test_three_tuple_extern_and_params(runtime: ModuleType) -> None:
    prog = _program(runtime, [(F.gelu, [[4, 1000]], [F32])])
    x, y = torch.randn(4, 1000), torch.randn(4, 1000)
    assert torch.equal(prog.run([x, y])[1], F.gelu(x) + y)


def test_input_checks(runtime: ModuleType) -> None:
    prog = _program(runtime, [(F.gelu, [[4, 1000]], [F32])])
    x = torch.randn(4, 1000)
    with pytest.raises(ValueError, match=r"expected 2 inputs, got 1"):
        prog.run([x])
    with pytest.raises(ValueError, match=r"input 1 has shape \[4, 999\], expected \[4, 1000\]"):
        prog.run([x, torch.randn(4, 999)])
    with pytest.raises(ValueError, match=r"input 0 has dtype Double, expected Float"):
        prog.run([x.double(), x])
    with pytest.raises(ValueError, match=r"input 1 is not contiguous"):
        prog.run([x, torch.randn(1000, 4).t()])
    with pytest.raises(TypeError, match=r"input 0 is not a Tensor"):
        prog.run([1.0, x])


def test_extern_errors_propagate(runtime: ModuleType) -> None:
    def broken(t: torch.Tensor) -> torch.Tensor:
        raise KeyError("from the extern")

    x = torch.randn(4, 1000)
    with pytest.raises(KeyError, match="from the extern"):
        _program(runtime, [(broken, [[4, 1000]], [F32])]).run([x, x])
    wrong = _program(runtime, [(lambda t: t[:2], [[4, 1000]], [F32], [4, 1000], F32)])
    with pytest.raises(ValueError, match=r"extern 0 returned \[2, 1000\]"):
        wrong.run([x, x])
    with pytest.raises(TypeError, match="not a Tensor"):
        _program(runtime, [(lambda t: 3, [[4, 1000]], [F32])]).run([x, x])
    with pytest.raises(TypeError, match="not callable"):
        _program(runtime, [(None, [[4, 1000]], [F32])])


def test_nonzero_return_code_and_bad_library(runtime: ModuleType, tmp_path: Path) -> None:
    prog = runtime.Program(str(build.compile_program(FAILING)), [], 0, [], [], [], [], [])
    with pytest.raises(RuntimeError, match="kiln_entry returned 3"):
        prog.run([])
    with pytest.raises(RuntimeError, match="cannot load"):
        runtime.Program(str(tmp_path / "missing.so"), [], 0, [], [], [], [], [])


def test_gemm_through_thread_pool(runtime: ModuleType) -> None:
    g = torch.Generator().manual_seed(1)
    a, b, bias = (torch.randn(*s, generator=g) for s in [(13, 300), (300, 300), (300,)])
    so = build.compile_program(GEMM_PROGRAM)
    prog = runtime.Program(
        str(so), [pack.pack_b(b), bias], 13 * 300 * 4, [[13, 300]], [F32], [[13, 300]], [F32], []
    )
    (c,) = prog.run([a])
    # fp32 accumulation order differs from torch's: errors ~ sqrt(K) eps |terms|.
    assert_close_to_reference(c, torch.relu(a @ b + bias), rtol_to_max=1e-5)
