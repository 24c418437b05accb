"""Executing a plan on this CPU: the measured figures ``kiln plan --verify`` compares with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.deploy.architecture import read_architecture
from kiln.deploy.estimate import FORMATS, Layout, Measurements
from kiln.deploy.execute import measure, run_layout
from kiln.deploy.hardware import parse_hardware
from kiln.deploy.plan_quality import checkpoint_bytes
from kiln.deploy.planner import Request, activation_bytes, evaluate
from tests.models.families import write_checkpoint

LAYOUT = {"tp": 1, "pp": 1, "batch": 2, "offload": "none"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "int4-g32"])
def test_every_cpu_format_runs(checkpoint: Path, fmt: str) -> None:
    got = run_layout(str(checkpoint), LAYOUT, fmt, prompt_len=6, gen_len=5)
    assert got["ms_per_token"] > 0 and got["ttft_ms"] > 0
    assert got["tokens_per_s"] == pytest.approx(2 * 1e3 / got["ms_per_token"])


def test_offloaded_plan_streams_from_disk(checkpoint: Path) -> None:
    got = run_layout(str(checkpoint), {**LAYOUT, "offload": "disk"}, "fp32", 6, 5)
    assert "disk" in got["engine"]


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_parallel_plans_run_on_ranks(checkpoint: Path, tp: int, pp: int) -> None:
    got = run_layout(str(checkpoint), {**LAYOUT, "tp": tp, "pp": pp}, "int8", 6, 5)
    assert f"tp {tp}, pp {pp}" in got["engine"]
    assert got["ms_per_token"] > 0 and got["ttft_ms"] > 0
    assert len(got["rank_peak_rss_bytes"]) == 2 and min(got["rank_peak_rss_bytes"]) > 100e6


def test_a_parallel_plan_is_measured_in_a_fresh_process(checkpoint: Path) -> None:
    got = measure(str(checkpoint), {**LAYOUT, "tp": 2}, "fp32", 6, 5)
    assert "tp 2" in got.engine and got.peak_rss_bytes > 3 * 100e6  # launcher + 2 ranks


def test_offloaded_parallel_plans_are_refused(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="one process"):
        run_layout(str(checkpoint), {**LAYOUT, "tp": 2, "offload": "disk"}, "fp32", 6, 5)


def test_measured_peak_memory_is_within_the_prediction(checkpoint: Path) -> None:
    """The predicted peak bounds the measured RSS of the executing process from above."""
    arch, hw = read_architecture(str(checkpoint)), parse_hardware("cpu")
    lay = Layout(FORMATS["fp32"], 1, 1, 1, 2, 6, 5, "none", activation_bytes(hw, "fp32"))
    est = evaluate(arch, hw, lay, Request(batch=2, prompt_len=6, gen_len=5),
                   Measurements(checkpoint_bytes(str(checkpoint)))).estimate  # fmt: skip
    got = measure(str(checkpoint), LAYOUT, "fp32", 6, 5)
    assert got.peak_rss_bytes > 100e6  # torch alone is resident: the figure is real
    assert est.peak_device_bytes >= 0.95 * got.peak_rss_bytes, (est.peak_device_bytes, got)


def test_gpu_plans_run_on_one_device_only(checkpoint: Path) -> None:
    for layout in ({"tp": 2}, {"pp": 2}, {"offload": "disk"}):
        with pytest.raises(ValueError, match="one device"):
            run_layout(str(checkpoint), {**LAYOUT, **layout, "device": "cuda"}, "bf16", 6, 5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4-g32"])
def test_a_gpu_plan_runs_on_the_gpu_within_its_predicted_memory(checkpoint: Path, fmt: str) -> None:
    """Loaded straight onto the GPU, decoded with the CUDA-graph step (the INT8 / INT4
    layers' Triton kernels inside the graph), its GPU memory at most the prediction."""
    got = measure(str(checkpoint), {**LAYOUT, "device": "cuda"}, fmt, 6, 5)
    assert "CUDA graph" in got.engine and got.device_name != "cpu"
    assert got.peak_device_bytes is not None and got.peak_bytes == got.peak_device_bytes
    arch, hw = read_architecture(str(checkpoint)), parse_hardware("1xH100")
    lay = Layout(FORMATS[fmt], 1, 1, 1, 2, 6, 5, "none", 2)
    est = evaluate(arch, hw, lay, Request(batch=2, prompt_len=6, gen_len=5),
                   Measurements(checkpoint_bytes(str(checkpoint)))).estimate  # fmt: skip
    assert 0 < got.peak_device_bytes <= est.peak_device_bytes
