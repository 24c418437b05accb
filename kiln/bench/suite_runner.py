"""The side-by-side runner (protocol: docs/benchmarks.md, "Timing protocol").

For each model, one worker process per contender (``python -m kiln.bench.suite_worker``)
is started and prepared in turn (so each compile time is cold and uncontended);
all of them stay alive while the runner interleaves rounds -- round r times every
contender once, in an order rotated each round -- and a contender's figure is its
best round's median. Workers save their outputs, and the runner compares them
with eager's (max abs / max rel error), computes a roofline floor, and records
device, versions, load, shapes, compile times, errors and ratios.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln.bench import RESULTS_DIR, system
from kiln.bench import output_errors as errors
from kiln.bench.contenders import canonical
from kiln.bench.roofline import device_peak, model_roofline
from kiln.bench.suite import get
from kiln.bench.suite_worker import THREADS
from kiln.core.offline import offline_env

REPO = Path(__file__).resolve().parents[2]  # the folder holding the kiln package
PEERS = ("eager", "inductor", "ort", "openvino")
Event = Callable[[str, dict[str, Any]], None]


class Worker:
    """A running worker process with a reader thread feeding its reply lines to a queue."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str],
        log: Path,
        module: str = "kiln.bench.suite_worker",
    ) -> None:
        self.log = log
        self._err = open(log, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=REPO, env=env, text=True, bufsize=1,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err,
        )  # fmt: skip
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout_s: float) -> dict[str, Any]:
        """The next JSON reply, or ``{"error": ...}`` on timeout or exit."""
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            self.close()
            return {"error": f"timeout after {timeout_s:.0f} s"}
        if line is None:
            rc = self.proc.wait()
            tail = self.log.read_text(errors="replace")[-600:] if self.log.exists() else ""
            return {"error": f"worker exited (rc={rc}) without replying: {tail}"}
        try:
            msg: dict[str, Any] = json.loads(line)
        except json.JSONDecodeError:
            return {"error": f"bad reply {line[:200]!r}"}
        return msg

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                if self.proc.stdin:
                    self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._err.close()


def timed_request(
    w: Worker, command: str, opts: dict[str, Any]
) -> tuple[dict[str, Any], float, float]:
    """Wait for a quiet moment, send ``command`` and wait for the reply; return ``(reply,
    co-tenants' share of all CPUs meanwhile, share just before)``. The co-tenant share is
    busy time minus our own processes' (jiffies: coarse for short requests)."""
    quiet = system.wait_quiet(opts["quiet_wait_s"], opts["quiet_busy"])
    b0, t0 = system.busy_jiffies()
    own0 = system.process_jiffies(w.proc.pid) + system.process_jiffies(os.getpid())
    w.send(command)
    msg = w.recv(opts["round_timeout_s"])
    b1, t1 = system.busy_jiffies()
    own1 = system.process_jiffies(w.proc.pid) + system.process_jiffies(os.getpid())
    return msg, round(max(0, (b1 - b0) - (own1 - own0)) / max(t1 - t0, 1), 3), quiet


def worker_env(cache_dir: Path) -> dict[str, str]:
    """Environment for workers: 2 threads for every runtime, private inductor and kiln
    program/capture caches (cold per model: every contender's compile is timed cold),
    offline hubs, the repo on the path."""
    env = dict(os.environ)
    for var in (
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "NUMEXPR_NUM_THREADS",
    ):
        env[var] = str(THREADS)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    env["KILN_PROGRAMS_DIR"] = str(cache_dir / "kiln-programs")
    env["KILN_CAPTURES_DIR"] = str(cache_dir / "kiln-captures")
    env = offline_env(env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num and den else None


def geomean(values: list[float]) -> float | None:
    vals = [v for v in values if v and v > 0]
    return math.exp(sum(map(math.log, vals)) / len(vals)) if vals else None


def _bench_model(
    name: str, contenders: list[str], rounds: int, reps: int, workdir: Path, opts: dict[str, Any],
    emit: Event,
) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Prepare every contender's worker, run the interleaved rounds, collect outputs."""
    env = worker_env(workdir / "inductor-cache")
    base = ["--model", name, "--workdir", str(workdir), "--warmup-s", str(opts["warmup_s"]),
            "--rep-ms", str(opts["rep_ms"])]  # fmt: skip
    res: dict[str, dict[str, Any]] = {c: {} for c in contenders}
    workers: dict[str, Worker] = {}
    for c in contenders:
        emit("prepare", {"model": name, "contender": c})
        w = Worker([*base, "--contender", c], env, workdir / f"{c}.log")
        msg = w.recv(opts["prepare_timeout_s"])
        if "error" in msg:
            res[c]["error"] = msg["error"]
            w.close()
        else:
            res[c].update({k: v for k, v in msg.items() if k != "ready"})
            workers[c] = w
        emit("prepared", {"model": name, "contender": c, **res[c]})
    medians: dict[str, list[float]] = {c: [] for c in workers}
    # Each round entry: the worker's per-call median; 'round_cotenant_busy' is
    # the share of all CPUs other processes used meanwhile (jiffies: coarse).
    for r in range(rounds):
        order = list(workers)
        order = order[r % len(order) :] + order[: r % len(order)] if order else order
        for c in order:
            w = workers[c]
            msg, other, quiet = timed_request(w, f"round {reps}", opts)
            res[c].setdefault("round_busy_before", []).append(quiet)
            if "error" in msg:
                res[c]["error"] = f"round {r}: {msg['error']}"
                w.close()
                del workers[c]
                continue
            medians[c].append(statistics.median(msg["times_s"]))
            res[c].setdefault("round_cotenant_busy", []).append(other)
            time.sleep(0.05)  # let the idle workers' thread pools park before the next one runs
        emit("round", {"model": name, "round": r + 1, "rounds": rounds})
    for c, w in workers.items():
        w.send("finish")
        msg = w.recv(opts["round_timeout_s"])
        if "error" in msg:
            res[c]["error"] = f"finish: {msg['error']}"
        w.close()
    for c, meds in medians.items():
        if meds and "error" not in res[c]:
            res[c]["round_medians_ms"] = [m * 1e3 for m in meds]
            res[c]["ms"] = min(meds) * 1e3
            res[c]["best_round_cotenant_busy"] = res[c]["round_cotenant_busy"][
                meds.index(min(meds))
            ]
    if opts["warm_compile"]:
        for c in [c for c in contenders if c != "eager" and "ms" in res[c]]:
            w = Worker([*base, "--contender", c, "--compile-only"], env, workdir / f"{c}.warm.log")
            msg = w.recv(opts["prepare_timeout_s"])
            w.close()
            res[c]["compile_warm_s"] = msg.get("compile_s")
    return res


def _summarise(models: dict[str, Any], contenders: list[str]) -> dict[str, Any]:
    """Geomean speed-ups over eager and of kiln over each peer, with counts."""
    speed = {c: [m["speedup_vs_eager"].get(c) for m in models.values()] for c in contenders}
    kiln = {p: [m["kiln_vs"].get(p) for m in models.values()] for p in PEERS}
    shares = [
        v
        for m in models.values()
        for r in m["results"].values()
        for v in r.get("round_cotenant_busy", [])
    ]
    return {
        "cotenant_busy_median": statistics.median(shares) if shares else None,
        "cotenant_busy_max": max(shares) if shares else None,
        "geomean_speedup_vs_eager": {c: geomean([v for v in s if v]) for c, s in speed.items()},
        "n_models_vs_eager": {c: sum(1 for v in s if v) for c, s in speed.items()},
        "geomean_kiln_vs": {p: geomean([v for v in s if v]) for p, s in kiln.items()},
    }


def run_suite(
    models: list[str],
    contenders: list[str],
    rounds: int = 3,
    reps: int = 10,
    out_dir: str | Path = RESULTS_DIR,
    *,
    warmup_s: float = 0.3,
    rep_ms: float = 5.0,
    warm_compile: bool = False,
    quiet_wait_s: float = 1.0,
    quiet_busy: float = 0.25,
    prepare_timeout_s: float = 600.0,
    round_timeout_s: float = 300.0,
    on_event: Event | None = None,
    tag: str = "",
) -> dict[str, Any]:
    """Benchmark ``models`` x ``contenders`` side by side; write and return the result.

    ``rounds`` interleaved rounds of ``reps`` repetitions each (a repetition is
    sized to last ``rep_ms``); eager is always included as the reference. Before
    each contender's round the runner waits up to ``quiet_wait_s`` for the share of
    CPUs busy (co-tenants) to drop to ``quiet_busy``, and records it. The
    result goes to ``out_dir/<device-slug>-<yyyymmdd>[-<tag>].json`` (same-day runs on
    the same device with the same ``tag`` overwrite it); its path is in ``result["path"]``.
    """
    emit: Event = on_event or (lambda kind, info: None)
    names = [get(m).name for m in models]
    cons = ["eager"] + [c for c in dict.fromkeys(canonical(c) for c in contenders) if c != "eager"]
    cpu = system.cpu_info()
    peak = device_peak(cpu["avx512f"])
    now = dt.datetime.now(dt.timezone.utc)
    opts = {"warmup_s": warmup_s, "rep_ms": rep_ms, "warm_compile": warm_compile,
            "quiet_wait_s": quiet_wait_s, "quiet_busy": quiet_busy,
            "prepare_timeout_s": prepare_timeout_s, "round_timeout_s": round_timeout_s}  # fmt: skip
    result: dict[str, Any] = {
        "schema": 1,
        "date": now.isoformat(timespec="seconds"),
        "device": {**cpu, "slug": system.device_slug(cpu)},
        "versions": system.versions(),
        "threads": THREADS,
        "dtype": "float32",
        "protocol": {"rounds": rounds, "reps": reps, **opts, "statistic": "best round's median"},
        "roofline": {"peak_gflops": peak.gflops, "mem_bw_gbs": peak.bw_gbs, "source": peak.source},
        "contenders": cons,
        "load_before": system.load_snapshot(),
        "models": {},
    }
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp:
        for i, name in enumerate(names):
            emit("model_start", {"model": name, "index": i, "total": len(names)})
            spec = get(name)
            workdir = Path(tmp) / name
            workdir.mkdir()
            load = os.getloadavg()
            res = _bench_model(name, cons, rounds, reps, workdir, opts, emit)
            module, inputs = spec.build()
            entry: dict[str, Any] = {
                "kind": spec.kind,
                "config": spec.config,
                "batch": spec.cpu_batch,
                "input_shapes": [list(t.shape) for t in inputs],
                "input_dtypes": [str(t.dtype).removeprefix("torch.") for t in inputs],
                "loadavg_at_start": list(load),
                **model_roofline(module, inputs, peak),
                "fp32_vs_fp64_rel_err": errors.fp64_error(module, inputs),
                "results": res,
            }
            errors.attach_errors(res, workdir)
            eager_ms = res["eager"].get("ms")
            entry["speedup_vs_eager"] = {c: _ratio(eager_ms, res[c].get("ms")) for c in cons}
            kiln_ms = res.get("kiln", {}).get("ms")
            entry["kiln_vs"] = {p: _ratio(res.get(p, {}).get("ms"), kiln_ms) for p in PEERS}
            entry["floor_fraction_eager"] = _ratio(entry["floor_ms"], eager_ms)
            result["models"][name] = entry
            emit("model_done", {"model": name, **entry})
            del module, inputs
    result["load_after"] = system.load_snapshot()
    result["summary"] = _summarise(result["models"], cons)
    suffix = f"-{tag}" if tag else ""
    name = f"{result['device']['slug']}-{now:%Y%m%d}{suffix}.json"
    return system.write_result(result, out_dir, name)
