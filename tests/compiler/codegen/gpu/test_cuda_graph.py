"""GPU only (skipped without CUDA): the program replays as one CUDA graph, results survive
the next call, launch configurations are tuned once and then read from the disk cache,
and the program's own buffers stay within eager's peak memory."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kiln
from kiln.core.compare import compare

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(64, 64), nn.ReLU()]
    return nn.Sequential(*layers[:-1]).eval().cuda()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_program_replays_as_one_cuda_graph(dtype: torch.dtype) -> None:
    model = _mlp().to(dtype)
    x = torch.randn(4096, 64, device="cuda", dtype=dtype)
    compiled = kiln.compile(model, [x], cache=False)
    assert compiled.report.graph_captured, compiled.report.summary()
    assert compiled.report.executor == "triton + CUDA graph"
    first = compiled(x)
    second = compiled(torch.randn_like(x))  # overwrites the static buffers
    with torch.no_grad():
        assert compare(first, model(x)).ok  # ...but not the result already returned
        assert not torch.equal(first, second)


@pytest.mark.gpu
@gpu
def test_launch_configurations_are_tuned_once(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    model = _mlp()
    x = torch.randn(1000, 64, device="cuda")
    first = kiln.compile(model, [x], cache=False)
    again = kiln.compile(model, [x], cache=False)
    assert first.report.timings_s.get("tuned kernels", 0) >= 1
    assert "tuned kernels" not in again.report.timings_s


@pytest.mark.gpu
@gpu
def test_program_memory_within_eager_peak() -> None:
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).eval().cuda()
    x = torch.randn(8192, 256, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        model(x)
    eager_peak = torch.cuda.max_memory_allocated() - base
    compiled = kiln.compile(model, [x], cache=False)
    assert compiled.report.arena_bytes <= eager_peak
