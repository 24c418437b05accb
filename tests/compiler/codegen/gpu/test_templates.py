"""Every Triton template, through ``kiln.compile(backend="triton")``, against an fp64
eager reference computed here: shapes that need masks, strided operands, each dtype."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln
from kiln.compiler.codegen.gpu.source import Launch
from kiln.compiler.exec.executors import ShapeMismatch
from kiln.core.compare import compare

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _check(
    model: nn.Module,
    inputs: list[torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    templates: set[str],
) -> kiln.CompiledModule:
    """Compile at ``dtype``, compare with the fp64 model, and check that the kernels
    named in ``templates`` ran as generated Triton code (not an ATen fallback)."""
    model = model.eval()
    ref = copy.deepcopy(model).double()(
        *[x.double() if x.is_floating_point() else x for x in inputs]
    )
    low = model.to(dtype).to(device)
    args = [(x.to(dtype) if x.is_floating_point() else x).to(device) for x in inputs]
    compiled = kiln.compile(low, args, backend="triton", cache=False)
    out = compiled(*args)
    r = compare(out.cpu(), ref.to(dtype))
    assert r.ok, r.detail
    native = {k.template for k in compiled.report.kernels if k.executor == "native"}
    assert templates <= native, compiled.report.kernel_table()
    steps = compiled.native_program.steps
    assert any(isinstance(s, Launch) for s in steps)
    return compiled


class Pointwise(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # y is broadcast along rows and read transposed; where/compare make bool values
        z = torch.where(x > 0.1, torch.tanh(x) * torch.sigmoid(y.t()), torch.exp(-x.abs()))
        return (
            torch.maximum(z, y.t() - 0.2)
            + F.gelu(x)
            - torch.log1p(x.abs())
            + z**2
            + torch.sign(y.t())
        )


@pytest.mark.parametrize("dtype", DTYPES)
def test_pointwise_broadcast_strided(dtype: torch.dtype, device: torch.device) -> None:
    x = torch.randn(37, 19)  # 703 elements: a ragged last block
    y = torch.randn(19, 1)
    _check(Pointwise(), [x, y], dtype, device, {"pointwise"})


def test_round_half_to_even(device: torch.device) -> None:
    class Round(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.round(x)

    x = torch.tensor([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.5, 0.49, -0.51, 7.0, 1e6 + 0.5])
    compiled = kiln.compile(Round(), [x.to(device)], backend="triton", cache=False)
    assert torch.equal(compiled(x.to(device)).cpu(), torch.round(x))


class Norms(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        nn.init.normal_(self.ln.weight)
        nn.init.normal_(self.ln.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return torch.softmax(self.ln(x), dim=-1) + rms


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 40), (7, 300)])
def test_rows_softmax_norms(
    dtype: torch.dtype, shape: tuple[int, ...], device: torch.device
) -> None:
    _check(Norms(shape[-1]), [torch.randn(shape)], dtype, device, {"reduction"})


class MeanPool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> (B, C)
        return torch.relu(x).mean(dim=(2, 3))


def test_rows_over_two_trailing_dims(device: torch.device) -> None:
    _check(MeanPool(), [torch.randn(2, 6, 5, 7)], torch.float32, device, {"reduction"})


class Pools(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> (B, C, H/4, W/4)
        return F.avg_pool2d(F.max_pool2d(torch.relu(x) - 0.5, 3, 2, 1), 2) * 2.0


def test_pools_are_library_calls(device: torch.device) -> None:
    """``pool2d`` has no Triton template: ATen's pooling runs it, as a library call (not
    a fallback), between generated kernels."""
    compiled = _check(Pools(), [torch.randn(2, 3, 13, 16)], torch.float32, device, {"pointwise"})
    pools = [k.executor for k in compiled.report.kernels if k.primitives == ["pool2d"]]
    assert pools == ["extern", "extern"], compiled.report.kernel_table()
    assert not compiled.report.fallbacks, compiled.report.fallbacks


class LinearAct(nn.Module):
    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(k, n)

    def forward(self, x: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
        return F.silu(self.lin(x)) + 0.5 * res


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mkn", [(33, 70, 45), (5, 16, 300)])
def test_gemm_epilogue(dtype: torch.dtype, mkn: tuple[int, int, int], device: torch.device) -> None:
    m, k, n = mkn
    _check(LinearAct(k, n), [torch.randn(m, k), torch.randn(m, n)], dtype, device, {"gemm"})


class Batched(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.relu(torch.bmm(a, b.transpose(1, 2)) * 0.25)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bmm_transposed_operand(dtype: torch.dtype, device: torch.device) -> None:
    _check(Batched(), [torch.randn(3, 21, 24), torch.randn(3, 18, 24)], dtype, device, {"gemm"})


class Mlp(nn.Module):
    """A tiny-cuda-nn style MLP with ragged widths and biases."""

    def __init__(self, widths: list[int]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x) if i % 2 else torch.relu(x)
        return x


@pytest.mark.parametrize("dtype", DTYPES)
def test_chain_keeps_intermediates_on_chip(dtype: torch.dtype, device: torch.device) -> None:
    model = Mlp([20, 40, 24, 64, 10])
    compiled = _check(model, [torch.randn(70, 20)], dtype, device, {"chain"})
    chains = [k for k in compiled.report.kernels if k.template == "chain"]
    assert sum(k.primitives.count("mm") for k in chains) >= 2


class Cat(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cat([a, b.transpose(1, 2), a * 2], dim=1) + 1  # (2, 3+5+3, 4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cat_of_strided_pieces(dtype: torch.dtype, device: torch.device) -> None:
    compiled = _check(Cat(), [torch.randn(2, 3, 4), torch.randn(2, 4, 5)], dtype, device, set())
    assert [k.executor for k in compiled.report.kernels if "cat" in k.primitives] == ["native"]


class Attention(nn.Module):
    """Multi-head attention written out, as models do: scaled scores, an additive mask
    broadcast over heads, softmax, values."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.heads = heads

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5 + mask  # (b, h, t, t)
        return (torch.softmax(s, dim=-1) @ v).transpose(1, 2).reshape(b, t, d)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_fused_with_scale_and_mask(dtype: torch.dtype, device: torch.device) -> None:
    mask = torch.zeros(1, 1, 19, 19)
    mask[..., 15:] = -1e4  # padding keys
    compiled = _check(
        Attention(48, 3), [torch.randn(1, 19, 48), mask], dtype, device, {"attention"}
    )
    assert sum(k.template == "attention" for k in compiled.report.kernels) == 1


def test_long_rows_fall_back_to_aten_and_say_so(device: torch.device) -> None:
    compiled = kiln.compile(
        nn.Softmax(dim=-1), [torch.randn(2, 20000, device=device)], backend="triton", cache=False
    )
    assert any("20000 elements" in f.reason for f in compiled.report.fallbacks)
    x = torch.randn(2, 20000, device=device)
    assert compare(compiled(x), torch.softmax(x, -1)).ok


def test_triton_backend_without_gpu_or_interpreter_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kiln.compile(nn.ReLU(), [torch.randn(4)], backend="triton", cache=False)


def test_new_input_shapes_compile_up_to_the_cap(device: torch.device) -> None:
    model = LinearAct(8, 16).eval().to(device)
    compiled = kiln.compile(
        model,
        [torch.randn(4, 8, device=device), torch.randn(4, 16, device=device)],
        backend="triton",
        cache=False,
        max_shapes=2,
    )
    x, r = torch.randn(7, 8, device=device), torch.randn(7, 16, device=device)
    with torch.no_grad():
        assert compare(compiled(x, r), model(x, r)).ok  # a second program, for 7 rows
    assert len(compiled.shapes) == 1
    with pytest.raises(ShapeMismatch, match="max_shapes=2"):
        compiled(torch.randn(9, 8, device=device), torch.randn(9, 16, device=device))


def test_bool_outputs_and_where(device: torch.device) -> None:
    class Masks(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            keep = (x > 0) & ~(x > 1.5)
            return keep, torch.where(keep, x, -x)

    x = torch.randn(5, 33, device=device)
    compiled = kiln.compile(Masks(), [x], backend="triton", cache=False)
    keep, y = compiled(x)
    assert keep.dtype == torch.bool
    assert torch.equal(keep, (x > 0) & ~(x > 1.5))
    assert torch.equal(y, torch.where(keep, x, -x))
