"""Plans as torchrun and vllm launch lines, and what those engines cannot express."""

from __future__ import annotations

import shlex

import pytest

from kiln.deploy import architecture
from kiln.deploy.architecture import read_architecture
from kiln.deploy.emit import emit
from kiln.deploy.hardware import parse_hardware
from kiln.deploy.plan_schema import plan_to_dict
from kiln.deploy.planner import Request, plan

CONFIGS = architecture.CONFIGS
GLM = str(CONFIGS / "glm-130b.json")


def _doc(spec: str, **request: object) -> dict:
    arch = read_architecture(GLM)
    return plan_to_dict(plan(arch, parse_hardware(spec), Request(**request)), GLM)  # type: ignore[arg-type]


def test_torchrun_one_line_per_machine() -> None:
    doc = _doc("16xA100-80GB", formats=("fp16",), allow_offload=False, objective="latency")
    lay = doc["layout"]
    out = emit(doc, "torchrun")
    assert len(out.lines) == -(-lay["devices"] // 8)
    for rank, line in enumerate(out.lines):
        args = shlex.split(line)
        assert args[0] == "torchrun" and f"--node-rank={rank}" in args
        assert args[args.index("--tp") + 1] == str(lay["tp"])
        assert args[args.index("--split") + 1] == ",".join(map(str, lay["stage_layers"]))
    assert out.cannot_express == []  # fp16 on devices: kiln run takes it as it is


def test_vllm_quantized_plan_names_what_it_cannot_do() -> None:
    doc = _doc("4xRTX3090", formats=("int4-g128",), allow_offload=False)
    out = emit(doc, "vllm")
    args = shlex.split(out.lines[0])
    assert args[:3] == ["vllm", "serve", GLM]
    assert args[args.index("--tensor-parallel-size") + 1] == str(doc["layout"]["tp"])
    assert "--quantization" in args
    assert any("int4-g128" in gap for gap in out.cannot_express)


def test_vllm_host_offload_becomes_cpu_offload_gb() -> None:
    doc = _doc("A100-80GB", formats=("int4-g128",), prompt_len=1920, gen_len=128)
    assert doc["layout"]["offload"] == "host"
    args = shlex.split(emit(doc, "vllm").lines[0])
    assert int(args[args.index("--cpu-offload-gb") + 1]) >= 1


def test_unknown_engine_is_refused() -> None:
    with pytest.raises(ValueError, match="torchrun"):
        emit(_doc("4xRTX3090", formats=("int4-g128",)), "tgi")  # type: ignore[arg-type]
