"""kiln_vec.h (kv::) against torch: every math function over ragged lengths and special values.

Each C++ test kernel runs full vectors then a masked tail (loadn/storen), like generated code.
Accuracy is measured in ulp against torch in float64 rounded to fp32.
"""

from __future__ import annotations

import ctypes
import math
import re
import shutil
import subprocess
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import Tensor

from kiln.compiler.codegen.cpu import build

VEC_SOURCE = r"""
#include "kiln_vec.h"
using namespace kv;
#define UNARY(name)                                                                \
  extern "C" void t_##name(const float* x, float* y, int64_t n) {                  \
    int64_t i = 0;                                                                 \
    for (; i + W <= n; i += W) store(y + i, kv::name(load(x + i)));                \
    if (i < n) storen(y + i, kv::name(loadn(x + i, int(n - i), 0.5f)), int(n - i)); \
  }
#define BINARY(name)                                                                \
  extern "C" void t_##name(const float* a, const float* b, float* y, int64_t n) {   \
    int64_t i = 0;                                                                  \
    for (; i + W <= n; i += W) store(y + i, kv::name(load(a + i), load(b + i)));    \
    if (i < n) {                                                                    \
      int r = int(n - i);                                                           \
      storen(y + i, kv::name(loadn(a + i, r, 0.5f), loadn(b + i, r, 0.5f)), r);     \
    }                                                                               \
  }
UNARY(exp) UNARY(log) UNARY(tanh) UNARY(sigmoid) UNARY(erf) UNARY(sqrt) UNARY(rsqrt)
UNARY(recip) UNARY(abs) UNARY(neg) UNARY(relu) UNARY(floor) UNARY(ceil) UNARY(round)
UNARY(sign) UNARY(sin) UNARY(cos) UNARY(log1p) UNARY(expm1) UNARY(logical_not)
BINARY(max) BINARY(min) BINARY(pow) BINARY(cmp_lt) BINARY(cmp_le) BINARY(cmp_gt)
BINARY(cmp_ge) BINARY(cmp_eq) BINARY(cmp_ne) BINARY(logical_and) BINARY(logical_or)
extern "C" void t_select(const float* c, const float* a, const float* b, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) store(y + i, select(load(c + i), load(a + i), load(b + i)));
  if (i < n) {
    int r = int(n - i);
    storen(y + i, select(loadn(c + i, r, 0), loadn(a + i, r, 0), loadn(b + i, r, 0)), r);
  }
}
// op 0 = sum, 1 = max, 2 = min, through vector accumulators and hsum/hmax/hmin.
extern "C" float t_reduce(const float* x, int64_t n, int op) {
  const float fill = op == 0 ? 0.0f : op == 1 ? -__builtin_inff() : __builtin_inff();
  V acc = splat(fill);
  for (int64_t i = 0; i < n; i += W) {
    V v = loadn(x + i, int(n - i < W ? n - i : W), fill);
    acc = op == 0 ? acc + v : op == 1 ? kv::max(acc, v) : kv::min(acc, v);
  }
  return op == 0 ? hsum(acc) : op == 1 ? hmax(acc) : hmin(acc);
}
// y[i] = x[i * stride] through gather / gathern.
extern "C" void t_gather(const float* x, int64_t stride, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) store(y + i, gather(x + i * stride, stride));
  if (i < n) storen(y + i, gathern(x + i * stride, stride, int(n - i), 0), int(n - i));
}
// bools: f = x as 0/1 floats, y = !x, through load_u8(n) / store_u8(n).
extern "C" void t_u8(const uint8_t* x, uint8_t* y, float* f, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    V v = load_u8(x + i);
    store(f + i, v);
    store_u8(y + i, logical_not(v));
  }
  if (i < n) {
    int r = int(n - i);
    V v = load_u8n(x + i, r);
    storen(f + i, v, r);
    store_u8n(y + i, logical_not(v), r);
  }
}
extern "C" int t_width() { return W; }
extern "C" void t_iota(float* y) { store(y, iota()); }
"""

NAN, INF = math.nan, math.inf
SPECIALS = [0.0, -0.0, INF, -INF, NAN, 1.0, -1.0, 1e-45, -1e-45, 1e-38, 3e38, -3e38, 0.5]


@pytest.fixture(scope="module")
def lib(compile_lib: Callable[[str], ctypes.CDLL]) -> ctypes.CDLL:
    lib = compile_lib(VEC_SOURCE)
    lib.t_reduce.restype = ctypes.c_float
    return lib


@pytest.fixture(scope="module")
def width(lib: ctypes.CDLL) -> int:
    return int(lib.t_width())


def _p(t: Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def call(lib: ctypes.CDLL, name: str, *args: Tensor) -> Tensor:
    """Run kernel t_<name> on fp32 args; checks that nothing past n is written."""
    n = args[0].numel()
    y = torch.full((n + 64,), 7.0)
    held = [a.contiguous() for a in args]  # alive across the call
    getattr(lib, f"t_{name}")(*[_p(a) for a in held], _p(y), ctypes.c_int64(n))
    assert torch.all(y[n:] == 7.0), f"t_{name} wrote past the end"
    return y[:n]


def ulp_error(y: Tensor, ref64: Tensor) -> Tensor:
    """|y - ref| in units of the fp32 spacing at ref (0 where equal, inf on nan mismatch)."""
    spacing = np.spacing(np.abs(ref64.float().numpy()))
    ulp = torch.from_numpy(spacing).double().clamp_min(2.0**-149)
    err = ((y.double() - ref64).abs() / ulp).nan_to_num(nan=INF)
    err[(y == ref64.float()) | (y.isnan() & ref64.isnan())] = 0.0
    err[y.isnan() != ref64.isnan()] = INF
    return err


def _uniform(lo: float, hi: float, n: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, generator=g, dtype=torch.float64) * (hi - lo) + lo).float()


def _log_uniform(lo: float, hi: float, n: int, seed: int) -> Tensor:
    return _uniform(math.log(lo), math.log(hi), n, seed).double().exp().float()


# name -> (torch op, inputs, max ulp error). Inputs mix the interesting range, tiny and
# huge magnitudes; torch's own fp32 results are within ~1-2 ulp of the float64 reference.
ACCURACY: dict[str, tuple[Callable[[Tensor], Tensor], Callable[[], Tensor], float]] = {
    "exp": (torch.exp, lambda: _uniform(-110, 90, 50000, 1), 2),
    "expm1": (
        torch.expm1,
        lambda: torch.cat(
            [
                _uniform(-30, 90, 40000, 2),
                _log_uniform(1e-30, 1, 5000, 3),
                -_log_uniform(1e-30, 1, 5000, 4),
            ]
        ),
        2,
    ),
    "log": (torch.log, lambda: _log_uniform(1e-45, 3e38, 50000, 5), 2),
    # log1p: log(u) * x / (u - 1) carries three roundings on top of log's.
    "log1p": (
        torch.log1p,
        lambda: torch.cat([_log_uniform(1e-30, 3e38, 25000, 6), -_log_uniform(1e-30, 1, 25000, 7)]),
        3,
    ),
    # tanh: expm1's error plus a division.
    "tanh": (
        torch.tanh,
        lambda: torch.cat([_uniform(-10, 10, 40000, 8), _log_uniform(1e-30, 1, 10000, 9)]),
        3,
    ),
    # sigmoid: exp's error plus an add and a division; below -80 torch itself flushes to 0.
    "sigmoid": (torch.sigmoid, lambda: _uniform(-80, 80, 50000, 10), 3),
    "erf": (
        torch.erf,
        lambda: torch.cat([_uniform(-5, 5, 40000, 11), _log_uniform(1e-30, 1, 10000, 12)]),
        2,
    ),
    "sin": (
        torch.sin,
        lambda: torch.cat(
            [
                _uniform(-10, 10, 30000, 13),
                _uniform(-2e5, 2e5, 10000, 14),
                _log_uniform(1e5, 3e38, 10000, 15),
            ]
        ),
        2,
    ),
    "cos": (
        torch.cos,
        lambda: torch.cat(
            [
                _uniform(-10, 10, 30000, 16),
                _uniform(-2e5, 2e5, 10000, 17),
                -_log_uniform(1e5, 3e38, 10000, 18),
            ]
        ),
        2,
    ),
    "sqrt": (torch.sqrt, lambda: _log_uniform(1e-45, 3e38, 50000, 17), 0.5),
    # rsqrt = 1 / sqrt(x): two correctly rounded steps.
    "rsqrt": (torch.rsqrt, lambda: _log_uniform(1e-38, 3e38, 50000, 18), 1.5),
    "recip": (torch.reciprocal, lambda: _log_uniform(1e-37, 3e38, 50000, 19), 0.5),
}


@pytest.mark.parametrize("name", sorted(ACCURACY))
def test_unary_accuracy(lib: ctypes.CDLL, name: str) -> None:
    op, make, max_ulp = ACCURACY[name]
    x = make()
    err = ulp_error(call(lib, name, x), op(x.double()))
    worst = int(err.argmax())
    assert err.max().item() <= max_ulp, f"{name}({x[worst].item()!r}): {err.max().item()} ulp"


UNARY_OPS: dict[str, Callable[[Tensor], Tensor]] = {
    "exp": torch.exp, "expm1": torch.expm1, "log": torch.log, "log1p": torch.log1p,
    "tanh": torch.tanh, "sigmoid": torch.sigmoid, "erf": torch.erf, "sin": torch.sin,
    "cos": torch.cos, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "recip": torch.reciprocal,
    "abs": torch.abs, "neg": torch.neg, "relu": torch.relu, "floor": torch.floor,
    "ceil": torch.ceil, "round": torch.round, "sign": torch.sign,
    "logical_not": lambda x: torch.logical_not(x).float(),
}  # fmt: skip
EXACT = {"abs", "neg", "relu", "floor", "ceil", "round", "sign", "logical_not", "sqrt", "recip"}


@pytest.mark.parametrize("name", sorted(UNARY_OPS))
@pytest.mark.parametrize("length", ["1", "W-1", "W+3", "1000"])
def test_unary_ragged_and_specials(lib: ctypes.CDLL, width: int, name: str, length: str) -> None:
    n = {"1": 1, "W-1": width - 1, "W+3": width + 3, "1000": 1000}[length]
    extra = [88.72, 88.73, -87.5, -103.9, -104.5, 100.0, -100.0, 9.5, -9.5, 3.9, -3.95]
    halves = [0.5, 1.5, 2.5, -0.5, -2.5, 1e7 + 0.5]
    x = torch.cat([torch.tensor(SPECIALS + extra + halves), _uniform(-20, 20, 1000, 20)])[:n]
    y = call(lib, name, x)
    ref = UNARY_OPS[name](x)
    if name in EXACT:
        # Correctly rounded (torch's fp32 sqrt goes through MKL VML here, which is not).
        exact = UNARY_OPS[name](x.double()).float()
        torch.testing.assert_close(y, exact, rtol=0, atol=0, equal_nan=True)
    else:
        # Approximations: within 3 fp32 ulp of exact, or equal to torch's fp32 result (torch
        # flushes sigmoid(-100) to 0 through exp overflow, and so does kv::sigmoid).
        err = ulp_error(y, UNARY_OPS[name](x.double()))
        err[y == ref] = 0.0
        assert err.max().item() <= 3, f"{name}: {x[int(err.argmax())].item()!r}"
        same_class = (y.isnan() == ref.isnan()) & (y.isinf() == ref.isinf())
        assert bool(same_class.all()), f"{name}: nan/inf differ from torch at {x[~same_class]}"


def test_special_values_match_torch(lib: ctypes.CDLL) -> None:
    x = torch.tensor([INF, -INF, NAN, 0.0, -0.0, 100.0, -100.0, 1e-30, -1e-30])
    for name in ("exp", "log", "tanh", "sigmoid", "erf", "expm1", "log1p", "sqrt", "rsqrt"):
        torch.testing.assert_close(call(lib, name, x), UNARY_OPS[name](x), equal_nan=True)


BINARY_OPS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "max": torch.maximum, "min": torch.minimum, "pow": torch.pow,
    "cmp_lt": lambda a, b: (a < b).float(), "cmp_le": lambda a, b: (a <= b).float(),
    "cmp_gt": lambda a, b: (a > b).float(), "cmp_ge": lambda a, b: (a >= b).float(),
    "cmp_eq": lambda a, b: (a == b).float(), "cmp_ne": lambda a, b: (a != b).float(),
    "logical_and": lambda a, b: torch.logical_and(a, b).float(),
    "logical_or": lambda a, b: torch.logical_or(a, b).float(),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(BINARY_OPS))
@pytest.mark.parametrize("n", [1, 7, 11, 1000])
def test_binary_ragged(lib: ctypes.CDLL, name: str, n: int) -> None:
    specials = torch.tensor(SPECIALS + [2.0, 3.0, -2.0])
    a = torch.cat([specials.repeat_interleave(len(specials)), _uniform(-4, 4, 1000, 21)])[:n]
    b = torch.cat([specials.repeat(len(specials)), _uniform(-4, 4, 1000, 22)])[:n]
    if name == "pow":
        b = torch.where(torch.arange(b.numel()) % 3 == 0, b.round(), b)  # integer exponents
    y, ref = call(lib, name, a, b), BINARY_OPS[name](a, b)
    if name == "pow":
        assert bool(((y.isnan() == ref.isnan()) & (y.isinf() == ref.isinf())).all())
        assert ulp_error(y, torch.pow(a.double(), b.double())).max().item() <= 1
    else:
        torch.testing.assert_close(y, ref, rtol=0, atol=0, equal_nan=True)


def test_pow_accuracy_and_special_cases(lib: ctypes.CDLL) -> None:
    a = _log_uniform(1e-3, 1e3, 50000, 23)
    b = _uniform(-12, 12, 50000, 24)
    # Computed in double internally: within 1 ulp even where |b log a| is large.
    assert ulp_error(call(lib, "pow", a, b), torch.pow(a.double(), b.double())).max() <= 1
    pa = [-2.0, -2.0, -2.0, -2.0, -1.0, -1.0, NAN, 1.0, 0.0, -0.0, -0.0, 0.0, -INF, -INF, INF]
    pb = [3.0, 2.0, 0.5, INF, INF, NAN, 0.0, NAN, -1.0, -1.0, -3.0, 0.0, 3.0, 0.5, -2.0]
    pa += [2.0, -0.5, -0.5, -0.0, 0.0, 1e-45, 3e38, 2.0, -3.0, 10.0]
    pb += [200.0, INF, -INF, 0.5, -0.5, 0.5, 2.0, 127.9, -7.0, -40.0]
    ta, tb = torch.tensor(pa), torch.tensor(pb)
    torch.testing.assert_close(call(lib, "pow", ta, tb), torch.pow(ta, tb), equal_nan=True)


def test_select(lib: ctypes.CDLL) -> None:
    c = torch.tensor([0.0, 1.0, -0.0, NAN, 2.0, 0.0, 1.0, 0.0, 1.0, 0.0, 5.0])
    a, b = torch.arange(11.0), -torch.arange(11.0) - 1
    y = call(lib, "select", c, a, b)
    torch.testing.assert_close(y, torch.where(c != 0, a, b))


@pytest.mark.parametrize("n", [1, 7, 11, 1000])
def test_reductions(lib: ctypes.CDLL, n: int) -> None:
    x = _uniform(-3, 3, n, 25)
    assert lib.t_reduce(_p(x), ctypes.c_int64(n), 0) == pytest.approx(x.sum().item(), abs=1e-3)
    assert lib.t_reduce(_p(x), ctypes.c_int64(n), 1) == x.max().item()
    assert lib.t_reduce(_p(x), ctypes.c_int64(n), 2) == x.min().item()
    x[n // 2] = NAN  # torch's max/min reductions propagate nan
    assert math.isnan(lib.t_reduce(_p(x), ctypes.c_int64(n), 1))
    assert math.isnan(lib.t_reduce(_p(x), ctypes.c_int64(n), 2))


@pytest.mark.parametrize("stride", [1, 3, -2])
@pytest.mark.parametrize("n", [1, 7, 11, 100])
def test_gather(lib: ctypes.CDLL, stride: int, n: int) -> None:
    x = torch.arange(float(n * abs(stride)))
    start = 0 if stride > 0 else x.numel() - 1
    expect = x[start::stride][:n] if stride > 0 else x.flip(0)[::-stride][:n]
    y = torch.full((n + 64,), 7.0)
    base = ctypes.c_void_p(x.data_ptr() + 4 * start)
    lib.t_gather(base, ctypes.c_int64(stride), _p(y), ctypes.c_int64(n))
    torch.testing.assert_close(y[:n], expect)
    assert torch.all(y[n:] == 7.0)


@pytest.mark.parametrize("n", [1, 7, 11, 1000])
def test_bool_load_store(lib: ctypes.CDLL, n: int) -> None:
    g = torch.Generator().manual_seed(26)
    x = torch.tensor([0, 1, 2, 255], dtype=torch.uint8)[torch.randint(0, 4, (n,), generator=g)]
    y = torch.full((n + 64,), 9, dtype=torch.uint8)
    f = torch.full((n + 64,), 7.0)
    lib.t_u8(_p(x), _p(y), _p(f), ctypes.c_int64(n))
    torch.testing.assert_close(f[:n], (x != 0).float())
    torch.testing.assert_close(y[:n], (x == 0).to(torch.uint8))
    assert torch.all(y[n:] == 9) and torch.all(f[n:] == 7.0)


def test_width_and_iota(lib: ctypes.CDLL, width: int) -> None:
    assert width == (16 if build.isa() == "avx512" else 8)
    y = torch.empty(width)
    lib.t_iota(_p(y))
    torch.testing.assert_close(y, torch.arange(float(width)))


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs binutils objdump")
def test_math_loops_are_vectorised_without_libm(width: int) -> None:
    so = build.compile_program(VEC_SOURCE)
    asm = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", str(so)], capture_output=True, text=True
    ).stdout
    reg = "zmm" if width == 16 else "ymm"
    for fn in ("t_exp", "t_erf", "t_tanh", "t_log", "t_sin", "t_pow"):
        body = asm.split(f"<{fn}>:\n", 1)[1].split("\n\n", 1)[0]
        assert reg in body, f"{fn} uses no {reg} registers"
        # No library calls (a stack-protector failure call may be there on some distros).
        calls = set(re.findall(r"call\s+\w+ <([^>]+)>", body)) - {"__stack_chk_fail@plt"}
        assert not calls, f"{fn} calls {calls}"
    for libm in ("expf", "erff", "tanhf", "logf", "sinf", "cosf", "powf", "exp", "pow"):
        assert f"<{libm}@plt>" not in asm
