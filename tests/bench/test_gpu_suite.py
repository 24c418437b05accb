"""The GPU benchmark harness on a machine without a GPU: the no-CUDA exits, the result
builder against hand arithmetic, the contender registries, the worker's refusal, the
session's step runner; plus one GPU run (skipped here)."""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.bench import gpu_mlp, gpu_session, gpu_suite
from kiln.bench.contenders import GPU_NAMES, NAMES, canonical, factory_path
from kiln.bench.contenders.kiln_contender import report_facts
from kiln.compiler.exec.report import CompileReport, Fallback

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
REPO = Path(__file__).resolve().parents[2]


@no_gpu
def test_benchmarks_exit_2_without_cuda(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_suite.main(["--models", "tcnn_mlp", "--out", str(tmp_path)]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
    assert gpu_mlp.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@no_gpu
def test_worker_refuses_cuda_cleanly(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "kiln.bench.suite_worker", "--model", "tcnn_mlp",
           "--contender", "eager", "--workdir", str(tmp_path), "--device", "cuda"]  # fmt: skip
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)  # fmt: skip
    assert p.returncode == 2
    reply = json.loads(p.stdout.strip().splitlines()[-1])
    assert reply["error"].startswith("no CUDA device: torch.cuda.is_available() is False")
    assert "Traceback" not in p.stderr


def test_registries() -> None:
    assert NAMES == ["eager", "inductor", "ort", "openvino", "kiln"]  # the CPU suite's, unchanged
    assert GPU_NAMES == ["eager", "inductor-default", "inductor-reduce-overhead",
                         "inductor-max-autotune", "kiln"]  # fmt: skip
    assert canonical("max-autotune", "cuda") == "inductor-max-autotune"
    assert (
        canonical("inductor", "cuda") == "inductor-default" and canonical("compile") == "inductor"
    )
    with pytest.raises(KeyError, match="known"):
        canonical("inductor-default")  # a GPU name is not a CPU contender
    for name in GPU_NAMES:
        module, fn = factory_path(name, "cuda")
        contender = getattr(importlib.import_module(module), fn)()
        assert isinstance(type(contender), type)
        assert all(callable(getattr(contender, m)) for m in ("prepare", "run", "outputs"))
    modes = [getattr(importlib.import_module(m), f)().mode for m, f in
             (factory_path(n, "cuda") for n in GPU_NAMES if n.startswith("inductor"))]  # fmt: skip
    assert modes == ["default", "reduce-overhead", "max-autotune"]
    assert factory_path("kiln", "cuda") == ("kiln.bench.contenders.kiln_gpu", "make")
    assert factory_path("kiln") == ("kiln.bench.contenders.kiln_contender", "make")


def test_kiln_report_facts() -> None:
    report = CompileReport(model="M", nodes=3, executor="triton")
    report.fallbacks.append(Fallback("aten.sort", "no kernel"))
    report.graph_captured = True
    report.arena_bytes = 4096
    facts = report_facts(report)
    assert facts["executor"] == "triton" and facts["graph_captured"] is True
    assert facts["fallbacks"] == ["aten.sort: no kernel"] and facts["arena_bytes"] == 4096
    assert facts["kiln_summary"].startswith("kiln: M")
    assert report_facts(None) == {"kiln_report": None}


def _results(ms: dict[str, float | None]) -> dict[str, dict[str, Any]]:
    return {c: ({"ms": v, "compile_s": 1.0} if v else {"error": "boom"}) for c, v in ms.items()}


def test_ratios_and_geomeans_by_hand() -> None:
    a = _results({"eager": 4.0, "inductor-default": 2.0, "inductor-reduce-overhead": 1.0,
                  "inductor-max-autotune": 1.6, "kiln": 0.5})  # fmt: skip
    b = _results({"eager": 9.0, "inductor-default": 3.0, "inductor-reduce-overhead": None,
                  "inductor-max-autotune": 4.5, "kiln": 1.0})  # fmt: skip
    ra, rb = gpu_suite.model_ratios(a), gpu_suite.model_ratios(b)
    assert ra["speedup_vs_eager"] == {"eager": 1.0, "inductor-default": 2.0,
        "inductor-reduce-overhead": 4.0, "inductor-max-autotune": 2.5, "kiln": 8.0}  # fmt: skip
    assert ra["best_torch_compile"] == "inductor-reduce-overhead"
    assert ra["kiln_vs_best_torch_compile"] == 2.0 and ra["kiln_vs"]["eager"] == 8.0
    assert rb["speedup_vs_eager"]["inductor-reduce-overhead"] is None
    assert (
        rb["best_torch_compile"] == "inductor-default" and rb["kiln_vs_best_torch_compile"] == 3.0
    )
    models = {"a": {"batch": 8, "results": a, **ra}, "b": {"batch": 16, "results": b, **rb}}
    s = gpu_suite.summarise(models, GPU_NAMES)
    g = s["geomean_speedup_vs_eager"]
    assert g["eager"] == pytest.approx(1.0) and g["kiln"] == pytest.approx(math.sqrt(72))
    assert g["inductor-default"] == pytest.approx(math.sqrt(6))
    assert g["inductor-reduce-overhead"] == pytest.approx(4.0)
    assert s["n_models_vs_eager"]["inductor-reduce-overhead"] == 1
    assert g["inductor-max-autotune"] == pytest.approx(math.sqrt(5))
    assert s["geomean_kiln_vs"]["inductor-default"] == pytest.approx(math.sqrt(12))
    assert s["geomean_kiln_vs_best_torch_compile"] == pytest.approx(math.sqrt(6))
    assert s["n_models_kiln_vs_best_torch_compile"] == 2
    result = {"contenders": GPU_NAMES, "device": {"name": "Test GPU"}, "date": "2026-01-01",
              "versions": {"torch": "2.x"}, "matmul_precision": "highest", "models": models,
              "summary": s}  # fmt: skip
    md = gpu_suite.render_markdown(result)
    assert "| a | 8 | 4.000 (1.00x) | 2.000 (2.00x) | 1.000 (4.00x) |" in md
    assert "| b | 16 | 9.000 (1.00x) | 3.000 (3.00x) | error |" in md
    assert "| geomean | | 1.00x | 2.45x | 4.00x | 2.24x | 8.49x | 2.45x |" in md
    assert "| b | inductor-reduce-overhead | - | - | - | - | boom |" in md
    assert gpu_suite.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def test_bench_model_protocol_on_cpu(tmp_path: Path) -> None:
    """The GPU runner's worker loop, driven on the CPU (eager only, tiny rounds)."""
    opts = {"device": "cpu", "rounds": 2, "reps": 3, "warmup_s": 0.05, "rep_ms": 1.0,
            "matmul_precision": "highest", "prepare_timeout_s": 120, "round_timeout_s": 60}  # fmt: skip
    lines: list[str] = []
    res = gpu_suite.bench_model("tcnn_mlp", ["eager"], tmp_path, opts, time.monotonic() + 300, lines.append)  # fmt: skip
    eager = res["eager"]
    assert "error" not in eager, eager
    assert len(eager["round_medians_ms"]) == 2 and eager["ms"] == min(eager["round_medians_ms"])
    assert eager["compile_s"] >= 0 and "peak_allocated_bytes" not in eager  # no GPU counters
    assert (tmp_path / "eager.pt").exists() and any("ready" in s for s in lines)


def test_mlp_chain_matches_module() -> None:
    torch.manual_seed(0)
    model, x = gpu_mlp.MLP64(bias=True).eval(), torch.randn(32, gpu_mlp.WIDTH)
    torch.testing.assert_close(gpu_mlp.cublas_chain(model)(x), model(x))
    assert gpu_mlp.find_cuda_graph(model) is None and gpu_mlp.find_cuda_graph(lambda: x) is None


def test_session_step_runner_and_junit(tmp_path: Path) -> None:
    log = (tmp_path / "log").open("w")
    ok = gpu_session.run_step("ok", [sys.executable, "-c", "print('hi')"], 30, log)
    assert ok["rc"] == 0 and not ok["timed_out"] and "hi" in ok["tail"]
    slow = [sys.executable, "-c", "import time; print('x', flush=True); time.sleep(60)"]
    hung = gpu_session.run_step("hung", slow, 1.5, log)
    assert hung["timed_out"] and hung["rc"] != 0 and hung["wall_s"] < 15
    log.close()
    assert "===== hung: rc=" in (tmp_path / "log").read_text()
    xml = ('<testsuites><testsuite name="pytest" tests="4" failures="1" errors="0" skipped="1">'
           '<testcase classname="t" name="a"/><testcase classname="t" name="b"><failure/></testcase>'
           "</testsuite></testsuites>")  # fmt: skip
    (tmp_path / "a.xml").write_text(xml)
    counts = gpu_session.junit_counts(tmp_path / "a.xml")
    assert counts["passed"] == 2 and counts["failures"] == 1 and counts["failed_tests"] == ["t::b"]
    gpu_session.merge_junit({"gpu": tmp_path / "a.xml", "compiler": tmp_path / "none.xml"}, tmp_path / "m.xml")  # fmt: skip
    assert gpu_session.junit_counts(tmp_path / "m.xml")["tests"] == 4
    suite = {
        "complete": True,
        "models": {"m": {}},
        "summary": {"geomean_speedup_vs_eager": {"kiln": 3.0}},
    }
    (tmp_path / "gpu-suite-x-1.json").write_text(json.dumps(suite))
    mlp = {
        "geomean_kiln_vs_cublas": 2.5,
        "cases": [{"rows": 8, "dtype": "float16", "kiln_vs_cublas": 2.5}],
    }
    (tmp_path / "gpu-mlp-x-1.json").write_text(json.dumps(mlp))
    head = gpu_session.headline(tmp_path)
    assert head["suite"]["geomean_speedup_vs_eager"] == {"kiln": 3.0} and head["suite"][
        "models"
    ] == ["m"]
    assert head["mlp"]["geomean_kiln_vs_cublas"] == 2.5 and head["mlp"]["cases"][0]["rows"] == 8


@no_gpu
def test_session_survives_failed_steps(tmp_path: Path) -> None:
    (tmp_path / "table.md").write_text("| a step's table |\n")  # goes into the log
    assert gpu_session.main(["--out", str(tmp_path), "--steps", "env,nonsense"]) == 0
    assert "| a step's table |" in (tmp_path / "session.log").read_text()
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["cuda_available"] is False and env["versions"]["torch"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"]["env"]["rc"] == 0
    assert "unknown step" in summary["steps"]["nonsense"]["error"]
    assert set(summary["files"]) == {"env.json", "session.log", "summary.json"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_suite_on_one_model(tmp_path: Path) -> None:
    """The whole GPU protocol on the smallest model; the slow max-autotune compile left out."""
    cons = ["eager", "inductor-reduce-overhead", "kiln"]
    argv = ["--models", "tcnn_mlp", "--contenders", ",".join(cons), "--rounds", "2", "--reps",
            "5", "--warmup-s", "0.2", "--rep-ms", "2", "--out", str(tmp_path)]  # fmt: skip
    assert gpu_suite.main(argv) == 0
    (path,) = tmp_path.glob("gpu-suite-*.json")
    result = json.loads(path.read_text())
    assert path.with_suffix(".md").exists() and result["complete"]
    assert result["device"]["name"] and result["versions"]["cuda"]
    m = result["models"]["tcnn_mlp"]
    assert list(m["results"]) == cons and m["batch"] == 262144
    eager = m["results"]["eager"]
    assert eager["ms"] > 0 and eager["peak_allocated_bytes"] > 0 and eager["reserved_bytes"] > 0
    assert m["fp32_vs_fp64_rel_err"] is not None
    for c, r in m["results"].items():
        assert "ms" in r or r["error"], c
        if "ms" in r and c != "eager":
            assert r["max_rel_err"] < 1e-2 and r["compile_s"] > 0, (c, r)
    assert "executor" in m["results"]["kiln"] or "error" in m["results"]["kiln"]
