"""The public API end to end: kiln.compile, its report, errors, caching, the
torch.compile backend and the eager fallback on a verification failure."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kiln
from kiln.compiler.codegen.cpu import build
from kiln.core.compare import RTOL_TO_MAX
from tests.support.compare import assert_close_to_reference


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 64)
        self.fc2 = torch.nn.Linear(64, 32)
        self.norm = torch.nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        h = self.norm(self.fc2(torch.nn.functional.gelu(self.fc1(x))) + x)
        return h, {"probs": torch.softmax(h, -1)}


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kiln-cache")


@pytest.fixture
def cache(cache_root: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache shared by this module's tests (the runtime extension builds once)."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(cache_root))
    return cache_root


def test_compile_matches_eager_and_keeps_output_structure(cache: Path) -> None:
    model = Block().eval()
    x = torch.randn(8, 32)
    compiled = kiln.compile(model, (x,))
    got, want = compiled(x), model(x)
    assert isinstance(got, tuple) and set(got[1]) == {"probs"}
    assert_close_to_reference(got, want, rtol_to_max=1e-5)
    r = compiled.report
    assert r.solver is not None and r.solver.status == "optimal" and r.solver.gap <= 1e-9
    assert r.verification.startswith("ok")
    assert all(k.executor == "native" for k in r.kernels)
    assert len(r.kernels) < r.nodes  # fused: fewer kernels than primitives


def test_second_compile_hits_every_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = Block().eval()
    x = torch.randn(4, 32)
    kiln.compile(model, (x,))
    calls: list[list[str]] = []
    real = build.run_compiler
    monkeypatch.setattr(build, "run_compiler", lambda cmd: (calls.append(cmd), real(cmd)))
    warm = kiln.compile(model, (x,))
    assert calls == [], "a warm compile must not invoke the C++ compiler"
    assert warm.report.cache_hit
    assert warm.report.timings_s["capture"] < 0.5  # torch.export skipped


def test_other_shapes_are_rejected_clearly(cache: Path) -> None:
    model = Block().eval()
    compiled = kiln.compile(model, (torch.randn(4, 32),))
    with pytest.raises(ValueError, match=r"\[4, 32\]"):
        compiled(torch.randn(5, 32))


def test_reference_executor_and_greedy_solver(cache: Path) -> None:
    model = Block().eval()
    x = torch.randn(3, 32)
    ref = kiln.compile(model, (x,), executor="reference")
    greedy = kiln.compile(model, (x,), solver="greedy")
    assert_close_to_reference(ref(x), model(x), rtol_to_max=1e-5)
    assert_close_to_reference(greedy(x), model(x), rtol_to_max=1e-5)
    assert greedy.report.solver is not None and greedy.report.solver.method == "greedy"


def test_invalid_options_are_refused() -> None:
    with pytest.raises(ValueError, match="on_mismatch"):
        kiln.CompileOptions(on_mismatch="ignore")  # type: ignore[arg-type]


def test_unsupported_op_falls_back_and_is_reported(cache: Path) -> None:
    class Sorts(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sort(x.exp(), dim=-1).values * 2

    model = Sorts()
    x = torch.randn(3, 10)
    compiled = kiln.compile(model, (x,))
    assert any("sort" in f.op for f in compiled.report.fallbacks)
    assert_close_to_reference(compiled(x), model(x), rtol_to_max=1e-6)


def test_verification_failure_raises_or_falls_back(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kiln.compiler.codegen.cpu import emit

    # Break one primitive's generated code: exp becomes exp(x) + 1.
    monkeypatch.setitem(emit._UNARY, "exp", "(kv::exp({0}) + kv::splat(1.0f))")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Softmax(-1)).eval()
    x = torch.randn(2, 8)
    with pytest.raises(kiln.VerificationError, match="first divergence: kernel"):
        kiln.compile(model, (x,), cache=False)
    with pytest.warns(RuntimeWarning, match="falling back to eager"):
        compiled = kiln.compile(model, (x,), on_mismatch="eager", cache=False)
    assert_close_to_reference(compiled(x), model(x), rtol_to_max=1e-6)


def test_torch_compile_backend(cache: Path) -> None:
    model = Block().eval()
    x = torch.randn(6, 32)
    compiled = torch.compile(model, backend="kiln")
    with torch.no_grad():
        assert_close_to_reference(compiled(x), model(x), rtol_to_max=1e-5)


def test_measured_costs_are_timed_and_cached(cache: Path) -> None:
    from kiln.compiler.api import CompileOptions, compile_graph
    from kiln.compiler.ir.graph import Graph, TensorMeta

    g = Graph()
    x = g.add_input("x", TensorMeta((16, 64), torch.float32))
    y = g.add_node(
        "neg",
        (g.add_node("exp", (x,), TensorMeta((16, 64), torch.float32)),),
        TensorMeta((16, 64), torch.float32),
    )
    g.outputs = [y]
    compiled = compile_graph(g, CompileOptions(measure=True))
    table = (cache / "measured_costs.json").read_text()
    assert table.count(":") >= 3  # exp, neg and the fused exp+neg were each timed
    assert compiled.report.solver is not None and compiled.report.solver.objective_us > 0
    x_t = torch.randn(16, 64)
    assert_close_to_reference(compiled.run_flat([x_t])[0], -x_t.exp(), rtol_to_max=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_model_compiles_runs_and_says_how(dtype: torch.dtype) -> None:
    """kiln's C++ holds float32 / bool tensors: a 16-bit model runs its kernels through
    ATen, says so in the report, and is verified at its own dtype's tolerance."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 32), torch.nn.LayerNorm(32)
    ).eval().to(dtype)  # fmt: skip
    x = torch.randn(8, 64, dtype=dtype)
    compiled = kiln.compile(model, (x,))
    assert compiled.report.executor == "reference"
    assert any(f.op == "program" and "no native program" in f.reason
               for f in compiled.report.fallbacks)  # fmt: skip
    assert compiled.report.verification.startswith("ok"), compiled.report.verification
    with torch.no_grad():
        # kiln's bound for the dtype: the decomposed norm rounds at each 16-bit primitive
        assert_close_to_reference(compiled(x), model(x), rtol_to_max=RTOL_TO_MAX[dtype])
