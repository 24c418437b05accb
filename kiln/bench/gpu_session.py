"""Everything a GPU session measures, in ONE command: ``python -m kiln.bench.gpu_session --out $OUT``.

Made for a lent GPU machine that runs one command of at most 10 minutes and copies back at
most 8 files written under ``$OUT``. Steps, in order, each a subprocess with its own time
budget (killed with its whole process group when over it), so a hung or failed step still
leaves the other steps' files:

1. ``env``: ``env.json`` -- ``nvidia-smi -q``, torch's CUDA device properties, versions;
2. ``plan``: ``kiln.bench.plan_accuracy --gpu``: the planner's one-GPU plans executed on
   the device, predicted vs measured: ``plan-accuracy-gpu-<device>-<date>.json``;
3. ``tests``: ``pytest -m gpu`` (the GPU-only tests, all of ``tests``), then every test of
   the Triton code generator and kernels (``tests/compiler/codegen/gpu``,
   ``tests/kernels/gpu``: on the CPU they run under the interpreter), natively, with
   ``TRITON_INTERPRET`` unset; the pass / fail counts and the failed tests in ``tests.json``;
4. ``suite``: ``kiln.bench.gpu_suite`` on a few models (``--models``), given its budget so it
   stops starting models in time: ``gpu-suite-<device>-<date>.json``;
5. ``mlp``: ``kiln.bench.gpu_mlp``: ``gpu-mlp-<device>-<date>.json``.

``summary.json`` (rewritten after every step: rc, seconds, timed out, headline figures) and
``session.log`` (every step's output, also echoed to stdout) complete the files: at most 8
come back from such a machine, so the steps' markdown tables go into the log (each is
made again from its JSON) and the junit XML stays behind.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[2]
STEPS = ("env", "plan", "tests", "suite", "mlp")
SUITE_MODELS = "tcnn_mlp,nerf_mlp,swiglu_tower,bert_small,resnet18"
BUDGETS_S = {
    "env": 15,
    "plan": 200,
    "tests_gpu": 90,
    "tests_compiler": 100,
    "suite": 110,
    "mlp": 40,
}


def child_env() -> dict[str, str]:
    """The steps' environment: no Triton interpreter, the repo importable, unbuffered."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def shown(cmd: list[str]) -> str:
    """``cmd`` as a result records it: folders dropped from absolute paths."""
    return " ".join(re.sub(r"/\S*/", "", c) for c in cmd)


def run_step(name: str, cmd: list[str], timeout_s: float, log: IO[str]) -> dict[str, Any]:
    """Run ``cmd`` in its own process group, echoing its output (to stdout and ``log``);
    kill the group after ``timeout_s``. Returns rc, seconds, timed_out and the output's tail."""
    t0, tail = time.monotonic(), []
    log.write(f"\n===== {name}: {shown(cmd)} (budget {timeout_s:.0f} s)\n")
    log.flush()
    try:
        proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace",
                                start_new_session=True)  # fmt: skip
    except OSError as e:
        return {"cmd": shown(cmd), "rc": None, "wall_s": 0.0, "timed_out": False, "error": str(e)}

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line)
            del tail[:-60]
            for f in (sys.stdout, log):
                f.write(f"[{name}] {line}")
                f.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=max(timeout_s, 1.0))
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the step's own process group
        except (ProcessLookupError, PermissionError):
            proc.kill()
        proc.wait()
    reader.join(timeout=5)
    rc = proc.returncode
    log.write(f"===== {name}: rc={rc}{' (timed out)' if timed_out else ''}\n")
    log.flush()
    return {"cmd": shown(cmd), "rc": rc, "wall_s": round(time.monotonic() - t0, 1),
            "timed_out": timed_out, "tail": "".join(tail)[-3000:]}  # fmt: skip


def write_env(path: Path) -> int:
    """``env.json``: nvidia-smi -q, torch's view of the CUDA devices, versions (in-process)."""
    import torch

    from kiln.bench import system

    env: dict[str, Any] = {"python": sys.version, "cpu": system.cpu_info(),
                           "versions": system.versions(), "cuda_build": torch.version.cuda,
                           "cuda_available": torch.cuda.is_available(), "devices": []}  # fmt: skip
    try:
        import triton

        env["versions"]["triton"] = triton.__version__
    except ImportError:
        env["versions"]["triton"] = None
    try:
        smi = subprocess.run(["nvidia-smi", "-q"], capture_output=True, text=True, timeout=20)
        env["nvidia_smi_q"] = smi.stdout or smi.stderr
    except (OSError, subprocess.SubprocessError) as e:
        env["nvidia_smi_q"] = f"unavailable: {e}"
    if env["cuda_available"]:
        env["cudnn"] = torch.backends.cudnn.version()
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            env["devices"].append({k: getattr(p, k) for k in dir(p) if not k.startswith("_")
                                   and isinstance(getattr(p, k), str | int | float | bool)})  # fmt: skip
    path.write_text(json.dumps(env, indent=1, default=str))
    return 0


def junit_counts(path: Path) -> dict[str, Any]:
    """Totals of a junit xml (tests, failures, errors, skipped, passed) and the failed tests."""
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed: list[str] = []
    root = ET.parse(path).getroot()
    for suite in root.iter("testsuite"):
        for k in counts:
            counts[k] += int(suite.get(k, 0))
        for case in suite.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(f"{case.get('classname')}::{case.get('name')}")
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "passed": passed, "failed_tests": failed[:100]}


def merge_junit(parts: dict[str, Path], dest: Path) -> None:
    """One ``<testsuites>`` holding every part's ``<testsuite>`` (each named after its part)."""
    merged = ET.Element("testsuites")
    for label, path in parts.items():
        if path.exists():
            for suite in ET.parse(path).getroot().iter("testsuite"):
                suite.set("name", label)
                merged.append(suite)
    ET.ElementTree(merged).write(dest, encoding="utf-8", xml_declaration=True)


def run_tests(out: Path, budgets: dict[str, float], left: float, log: IO[str]) -> dict[str, Any]:
    """The two pytest runs; ``tests.json`` under ``out``."""
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kiln-gpu-tests-") as tmp:
        parts = {"gpu": Path(tmp) / "gpu.xml", "compiler": Path(tmp) / "compiler.xml"}
        # the Triton tests on eight workers: their compiles spread over the host's cores
        args = {"gpu": ["-m", "gpu", "tests", "--continue-on-collection-errors"],
                "compiler": ["tests/compiler/codegen/gpu", "tests/kernels/gpu", "-n", "8"]}  # fmt: skip
        t0 = time.monotonic()
        for label, extra in args.items():
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                   f"--junitxml={parts[label]}", *extra]  # fmt: skip
            budget = min(budgets[f"tests_{label}"], left - (time.monotonic() - t0))
            runs[label] = run_step(f"tests-{label}", cmd, budget, log)
            if not runs[label]["timed_out"]:  # else the tail is all there is: no junit xml
                runs[label].pop("tail", None)
            if parts[label].exists():
                runs[label]["counts"] = junit_counts(parts[label])
        merge_junit(parts, Path(tmp) / "junit.xml")
    keys = ("tests", "passed", "failures", "errors", "skipped")
    totals = {k: sum(r.get("counts", {}).get(k, 0) for r in runs.values()) for k in keys}
    result = {"runs": runs, "totals": totals, "TRITON_INTERPRET": "unset"}
    (out / "tests.json").write_text(json.dumps(result, indent=1))
    return result


def headline(out: Path) -> dict[str, Any]:
    """The figures a reader wants first, from the suite's and the MLP's JSON."""
    found: dict[str, Any] = {}
    for key, pattern in (("suite", "gpu-suite-*.json"), ("mlp", "gpu-mlp-*.json"),
                         ("plan", "plan-accuracy-gpu-*.json")):  # fmt: skip
        for path in sorted(out.glob(pattern))[-1:]:
            try:
                r = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                found[key] = {"file": path.name, "error": str(e)}
                continue
            if key == "suite":
                s = r.get("summary", {})
                found[key] = {"file": path.name, "complete": r.get("complete"),
                              "models": list(r.get("models", {})),
                              "geomean_speedup_vs_eager": s.get("geomean_speedup_vs_eager"),
                              "geomean_kiln_vs_best_torch_compile": s.get("geomean_kiln_vs_best_torch_compile")}  # fmt: skip
            elif key == "plan":
                found[key] = {"file": path.name, "summary": r.get("summary")}
            else:
                found[key] = {"file": path.name, "geomean_kiln_vs_cublas": r.get("geomean_kiln_vs_cublas"),
                              "all_targets_met": r.get("all_targets_met"),
                              "cases": [{k: c.get(k) for k in ("rows", "dtype", "kiln_vs_cublas", "kiln_basis")}
                                        for c in r.get("cases", [])]}  # fmt: skip
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kiln.bench.gpu_session", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out", required=True, help="folder for the (at most 8) result files")
    p.add_argument("--steps", default=",".join(STEPS), help=f"subset / order of {STEPS}")
    p.add_argument("--models", default=SUITE_MODELS, help="the GPU suite's models")
    p.add_argument("--total-s", type=float, default=570.0, help="the whole session's budget")
    for k, v in BUDGETS_S.items():
        p.add_argument(f"--budget-{k.replace('_', '-')}", type=float, default=v, dest=k)
    p.add_argument("--step", choices=("env",), help=argparse.SUPPRESS)  # internal: one step
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.step == "env":
        return write_env(out / "env.json")
    budgets = {k: getattr(args, k) for k in BUDGETS_S}
    t0, py = time.monotonic(), sys.executable
    summary: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "steps": {}}
    with open(out / "session.log", "a") as log:
        for step in [s.strip() for s in args.steps.split(",") if s.strip()]:
            left = args.total_s - (time.monotonic() - t0)
            try:
                if step not in STEPS:
                    raise ValueError(f"unknown step {step!r}; known: {', '.join(STEPS)}")
                if left < 5:
                    summary["steps"][step] = {"skipped": "session budget spent"}
                elif step == "env":
                    cmd = [py, "-m", "kiln.bench.gpu_session", "--step", "env", "--out", str(out)]
                    summary["steps"][step] = run_step(step, cmd, min(budgets["env"], left), log)
                elif step == "tests":
                    tests = run_tests(out, budgets, left, log)
                    summary["steps"][step] = {"runs": tests["runs"], "totals": tests["totals"]}
                else:
                    budget = min(budgets[step], left)
                    cmd = [py, "-m", f"kiln.bench.gpu_{step}", "--out", str(out)]
                    if step == "suite":
                        cmd += ["--models", args.models, "--budget-s", str(max(budget - 25, 10))]
                    if step == "plan":
                        cmd = [py, "-m", "kiln.bench.plan_accuracy", "--gpu", "--rounds", "2",
                               "--budget-s", str(max(budget - 40, 10)), "--out", str(out)]  # fmt: skip
                    summary["steps"][step] = run_step(step, cmd, budget, log)
            except Exception as e:  # noqa: BLE001 - one step's failure never stops the others
                summary["steps"][step] = {"error": f"{type(e).__name__}: {e}"}
            for table in out.glob("*.md"):  # into the log: the files that come back are few
                log.write(f"\n===== {table.name}\n{table.read_text(encoding='utf-8')}")
                table.unlink()
            summary.update(wall_s=round(time.monotonic() - t0, 1), headline=headline(out))
            summary["files"] = sorted({*(f.name for f in out.iterdir()), "summary.json"})
            summary["files_over_copy_limit"] = len(summary["files"]) > 8
            (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps({"wall_s": summary["wall_s"], "headline": summary["headline"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
