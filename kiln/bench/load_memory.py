"""Peak resident memory of ``kiln generate`` on SmolLM2-135M fp32, loading included.

    python -m kiln.bench.load_memory [--new-tokens 4] [--compare-full-loads] [--out results]

Each case runs in a fresh process (``--worker CASE``) through the same library call as
``kiln generate smollm2 --unpacked`` (``kiln.deploy.generate_job.generate_text``: the
GGUF's Q4_1 layers dequantized to ~540 MB of fp32 weights) and reports its own peak RSS
(``VmHWM``); a parallel case also every rank's, and the job's total is their sum (an
upper bound of the moment they peak together):

* ``imports``: python, torch and kiln imported, nothing loaded (the floor of every case);
* ``resident``: the whole model in memory, default engine;
* ``offload``: ``--offload DIR``: blocks streamed into the store as they are loaded;
* ``tp2`` / ``pp2``: ``--tp 2`` / ``--pp 2``: each rank reads only its part;
* with ``--compare-full-loads``, the paths that build the whole model first, as kiln did
  before loads streamed: ``offload-full-load`` (load, then ``offload_`` writes the store)
  and ``tp2-full-load`` / ``pp2-full-load`` (every rank builds the model, then keeps its
  part: ``run_parallel`` with a factory of the whole model).

Writes ``results/load-memory-<device>-<yyyymmdd>.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from kiln.bench import RESULTS_DIR, system

CHECKPOINT = "smollm2"
PROMPT = "Once upon a time"
CASES = ("imports", "resident", "offload", "tp2", "pp2")
FULL_LOAD_CASES = ("offload-full-load", "tp2-full-load", "pp2-full-load")
COMMANDS = {
    "imports": "python -c 'import torch, kiln.deploy.generate_job'",
    "resident": "kiln generate smollm2 --unpacked",
    "offload": "kiln generate smollm2 --unpacked --offload DIR",
    "tp2": "kiln generate smollm2 --unpacked --tp 2",
    "pp2": "kiln generate smollm2 --unpacked --pp 2",
    "offload-full-load": "load_model + offload_ (the whole model first)",
    "tp2-full-load": "run_parallel(factory of the whole model), tp 2",
    "pp2-full-load": "run_parallel(factory of the whole model), pp 2",
}


def _full_model(packed: bool) -> Any:
    """The whole model, for the ranks of a ``*-full-load`` case (module level: picklable)."""
    from kiln.models.load import load_model

    return load_model(CHECKPOINT, packed=packed, with_tokenizer=False).model


def run_case(case: str, new_tokens: int, store: Path) -> dict[str, Any]:
    """Run ``case`` in this process (a fresh one: the peak is the case's alone); returns
    its peak RSS, the ranks' peaks for parallel cases, the tokens and the load time."""
    from kiln.core.memory import peak_rss_bytes
    from kiln.deploy.generate_job import GenerateRequest, generate_text

    if case == "imports":
        return {"peak_rss_bytes": peak_rss_bytes()}
    if case.endswith("-full-load"):
        return {**_run_full_load(case, new_tokens, store), "peak_rss_bytes": peak_rss_bytes()}
    request = GenerateRequest(
        checkpoint=CHECKPOINT, prompt=PROMPT, max_new_tokens=new_tokens, packed=False,
        offload=str(store) if case == "offload" else None, tp=2 if case == "tp2" else 1,
        pp=2 if case == "pp2" else 1,
    )  # fmt: skip
    result = generate_text(request)
    return {
        "peak_rss_bytes": peak_rss_bytes(),
        "rank_peak_rss_bytes": [r.peak_rss_bytes for r in result.ranks],
        "load_s": result.load_s,
        "tokens": result.generation.tokens[0].tolist(),
        "engine": result.engine,
        "weight_bytes": result.weight_bytes,
    }


def _run_full_load(case: str, new_tokens: int, store: Path) -> dict[str, Any]:
    """The whole-model-first paths, which still exist for models already in memory."""
    from kiln.deploy.generate_job import encode_prompt
    from kiln.models.load import open_checkpoint

    t0 = time.perf_counter()
    checkpoint = open_checkpoint(CHECKPOINT, packed=False)
    prompt = encode_prompt(checkpoint.tokenizer(), PROMPT, chat=False)
    if case == "offload-full-load":
        from kiln.llm.generate import EagerDecoder, Sampling, generate
        from kiln.llm.offload import offload_

        model = _full_model(packed=False)
        offload_(model, store, tier="disk")
        load_s = time.perf_counter() - t0
        decoder = EagerDecoder(model, 1, prompt.shape[1] + new_tokens)
        gen = generate(decoder, prompt, new_tokens, Sampling())
        return {"load_s": load_s, "tokens": gen.tokens[0].tolist(), "rank_peak_rss_bytes": []}
    from kiln.parallel.mesh import run_parallel_job

    tp, pp = (2, 1) if case.startswith("tp2") else (1, 2)
    run = run_parallel_job(partial(_full_model, False), prompt, new_tokens, tp, pp, timeout_s=300)
    return {
        "load_s": max(r.load_s for r in run.ranks),
        "tokens": run.generation.tokens[0].tolist(),
        "rank_peak_rss_bytes": [r.peak_rss_bytes for r in run.ranks],
    }


def _spawn(case: str, new_tokens: int, store: Path) -> dict[str, Any]:
    """``run_case`` in a fresh process; its JSON line, or the error."""
    cmd = [sys.executable, "-m", "kiln.bench.load_memory", "--worker", case,
           "--new-tokens", str(new_tokens), "--store", str(store)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip()[-2000:]}
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def measure(
    new_tokens: int = 4, compare_full_loads: bool = False, out_dir: str | Path = RESULTS_DIR,
    log: Any = print,
) -> dict[str, Any]:  # fmt: skip
    """Run every case, each in its own process; write JSON + markdown; return the result."""
    cpu, now = system.cpu_info(), dt.datetime.now(dt.timezone.utc)
    cases = [*CASES, *(FULL_LOAD_CASES if compare_full_loads else ())]
    entries = []
    for case in cases:
        log(f"running {case}")
        with tempfile.TemporaryDirectory(prefix="kiln-load-memory-") as tmp:
            got = _spawn(case, new_tokens, Path(tmp) / "store")
        ranks = [r for r in got.get("rank_peak_rss_bytes", []) if r is not None]
        total = got.get("peak_rss_bytes", 0) + sum(ranks) if "error" not in got else None
        entries.append(
            {"case": case, "command": COMMANDS[case], **got, "total_peak_rss_bytes": total}
        )
    result: dict[str, Any] = {
        "schema": 1, "kind": "load-memory", "date": now.isoformat(timespec="seconds"),
        "device": {**cpu, "slug": system.device_slug(cpu)}, "versions": system.versions(),
        "model": "SmolLM2-135M-Instruct GGUF (Q4_1), --unpacked: fp32 weights",
        "prompt": PROMPT, "new_tokens": new_tokens, "load": system.load_snapshot(),
        "conventions": {
            "peak_rss_bytes": "VmHWM of the process that ran the case (the launcher for "
                              "parallel cases), loading included",
            "total_peak_rss_bytes": "that plus every rank's VmHWM: an upper bound of the "
                                    "job's resident memory at its peak",
        },
        "cases": entries,
    }  # fmt: skip
    name = f"load-memory-{result['device']['slug']}-{now:%Y%m%d}.json"
    return system.write_result(result, out_dir, name, render_markdown(result))


def _mb(v: int | None) -> str:
    return "–" if v is None else f"{v / 1e6:.0f}"


def render_markdown(result: dict[str, Any]) -> str:
    """One row per case: its peak RSS, the ranks' and the total."""
    dev = result["device"]
    isa = "AVX-512" if dev["avx512f"] else ("AVX2" if dev["avx2"] else "no AVX2")
    lines = [
        f"Peak resident memory (VmHWM, MB), {result['model']}; {result['new_tokens']} new "
        f"tokens; {dev['name']} ({isa}), {result['date'][:10]}. Each case in a fresh "
        "process; a parallel job's total is the launcher's peak plus every rank's.",
        "",
        "| case | command | process | ranks | total | load s | tokens |",
        "| --- | --- | ---: | --- | ---: | ---: | --- |",
    ]
    for e in result["cases"]:
        if "error" in e:
            lines.append(f"| {e['case']} | {e['command']} | error | | | | |")
            continue
        ranks = " / ".join(_mb(r) for r in e.get("rank_peak_rss_bytes", []))
        load = f"{e['load_s']:.1f}" if "load_s" in e else "–"
        tokens = " ".join(map(str, e.get("tokens", [])))
        lines.append(
            f"| {e['case']} | `{e['command']}` | {_mb(e['peak_rss_bytes'])} | {ranks or '–'} "
            f"| {_mb(e['total_peak_rss_bytes'])} | {load} | {tokens} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kiln.bench.load_memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--compare-full-loads", action="store_true",
                        help="also run the whole-model-first paths")  # fmt: skip
    parser.add_argument("--out", default=str(RESULTS_DIR))
    parser.add_argument("--worker", choices=[*CASES, *FULL_LOAD_CASES], help=argparse.SUPPRESS)
    parser.add_argument("--store", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        # This module's importable copy, not __main__: ranks unpickle its factory by name.
        from kiln.bench.load_memory import run_case as run

        print(json.dumps(run(args.worker, args.new_tokens, Path(args.store))))
        return 0
    result = measure(args.new_tokens, args.compare_full_loads, args.out)
    print(Path(result["markdown_path"]).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
