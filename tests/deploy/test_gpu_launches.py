"""The planner's GPU launch term: kernels counted on the model's code, priced per kernel."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from kiln.deploy import gpu_launches
from kiln.deploy.architecture import Architecture, read_architecture
from kiln.deploy.estimate import FORMATS, Layout, estimate
from kiln.deploy.hardware import catalog_name, parse_hardware
from kiln.llm.graph_decoder import GraphDecoder
from tests.support.models import DECODE_CONFIGS, tiny_transformer


def executed(cfg: Any) -> tuple[int, int]:
    """(decode step, prefill) kernels of a real CPU run of ``cfg`` (the weights and inputs
    real, where the planner's count runs on the meta device)."""
    model = tiny_transformer(cfg)
    decoder = GraphDecoder(model, 1, 2 * gpu_launches.PROMPT, graphs=False)
    prompt = torch.zeros(1, gpu_launches.PROMPT, dtype=torch.long)
    token = torch.zeros(1, dtype=torch.long)
    counts = []
    for run in (lambda: decoder.prefill(prompt), lambda: decoder.step(token, gpu_launches.PROMPT)):
        counter = gpu_launches.KernelCounter()
        with counter:
            run()
        counts.append(counter.kernels)
    return counts[1], counts[0]


def architecture(cfg: Any) -> Architecture:
    return Architecture.from_model_config(cfg, "tiny", "")


@pytest.mark.parametrize("name", sorted(DECODE_CONFIGS))
def test_meta_counts_match_a_real_run(name: str) -> None:
    """Counted on the meta device, the kernels of a real CPU run (every feature: sliding
    windows beside global layers, soft-capping, learned positions, ...) come out exactly,
    and each block adds its own."""
    cfg = DECODE_CONFIGS[name]
    counts = gpu_launches.kernel_counts(architecture(cfg))
    assert counts.source == "counted"
    assert (counts.decode, counts.prefill) == executed(cfg)
    windows = cfg.sliding_windows[:2] if cfg.sliding_windows else ()
    deeper = replace(cfg, n_layers=cfg.n_layers + 2, sliding_windows=cfg.sliding_windows + windows)
    assert (gpu_launches.kernel_counts(architecture(deeper)).decode,) == executed(deeper)[:1]


def test_a_config_kiln_cannot_build_is_counted_as_assumed() -> None:
    glm = read_architecture("glm-130b")
    counts = gpu_launches.kernel_counts(glm)
    assert counts.source == "assumed"
    assert (
        counts.decode == glm.n_layers * gpu_launches.ASSUMED_PER_BLOCK + gpu_launches.ASSUMED_REST
    )
    qwen = read_architecture("qwen2-0.5b")  # the stand-in is what kiln's Qwen2 counts
    assert gpu_launches.kernel_counts(qwen).decode == (
        qwen.n_layers * gpu_launches.ASSUMED_PER_BLOCK + gpu_launches.ASSUMED_REST)  # fmt: skip


def test_gpu_estimate_adds_each_kernels_fixed_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode step grows by kernels x graph-node cost, the prefill is the larger of its
    roofline and the launches: checked against the same estimate with free launches."""
    arch: Architecture = read_architecture("qwen2-0.5b")
    hw = parse_hardware("1xH200")
    lay = Layout(FORMATS["bf16"], 1, 1, 1, 1, 64, 32)
    free = gpu_launches.LaunchCosts(0.0, 0.0, "test")
    costs = gpu_launches.LaunchCosts(2.5, 8.0, "test")
    monkeypatch.setattr(gpu_launches, "launch_costs", lambda _: free)
    base = estimate(arch, hw, lay)
    monkeypatch.setattr(gpu_launches, "launch_costs", lambda _: costs)
    got = estimate(arch, hw, lay)
    kernels = gpu_launches.kernel_counts(arch)
    assert got.ms_per_token == pytest.approx(base.ms_per_token + kernels.decode * 2.5e-3)
    assert got.ttft_ms == pytest.approx(max(base.ttft_ms, kernels.prefill * 8e-3))
    assert got.ttft_ms > base.ttft_ms  # 64 tokens of a 0.5B model: launch-bound
    cpu = estimate(arch, parse_hardware("cpu"), replace(lay, fmt=FORMATS["fp32"]))
    monkeypatch.setattr(gpu_launches, "launch_costs", lambda _: free)
    assert estimate(arch, parse_hardware("cpu"), replace(lay, fmt=FORMATS["fp32"])) == cpu


def test_launch_costs_without_a_calibration_are_the_planning_estimates() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine's GPU may have a calibration")
    costs = gpu_launches.launch_costs(parse_hardware("1xH100").device)
    assert costs.source == "planning estimate" and costs.graph_us > 0 and costs.launch_us > 0


@pytest.mark.parametrize(("driver", "catalog"), [
    ("NVIDIA H200", "H200"), ("NVIDIA H100 80GB HBM3", "H100"),
    ("NVIDIA A100-SXM4-40GB", "A100-40GB"), ("NVIDIA GeForce RTX 3090", "RTX3090"),
    ("Tesla T4", "T4"),
])  # fmt: skip
def test_driver_names_map_to_the_catalog(driver: str, catalog: str) -> None:
    assert catalog_name(driver) == catalog


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_counted_kernels_are_what_the_gpu_launches() -> None:
    """On a GPU, the kernels CUDA's profiler sees in one eager decode step are the count
    within a fifth (an operator may launch none, or two)."""
    from torch.profiler import ProfilerActivity, profile

    cfg = DECODE_CONFIGS["llama_gqa"]
    model = tiny_transformer(cfg).cuda().to(torch.bfloat16)
    decoder = GraphDecoder(model, 1, 2 * gpu_launches.PROMPT, graphs=False)
    decoder.prefill(torch.zeros(1, gpu_launches.PROMPT, dtype=torch.long))
    token = torch.zeros(1, dtype=torch.long, device="cuda")
    decoder.step(token, gpu_launches.PROMPT)  # warm
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        decoder.step(token, gpu_launches.PROMPT)
        torch.cuda.synchronize()
    launched = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
    counted = gpu_launches.kernel_counts(architecture(cfg)).decode
    assert abs(launched - counted) <= 0.2 * counted, (launched, counted)
