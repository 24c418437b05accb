"""Side-by-side decode speed on the real model (docs/benchmarks.md, "Large-model measurements").

``python -m kiln.bench.llm_decode --contenders hf,llamacpp,kiln-fast --batches 1,4 --n-new 64``

One worker process per contender (``kiln.bench.llm_decode_peers``; their thread pools stall each
other on 2 cores) plus one that measures the machine's read bandwidth. All load and warm up
first, then ``repeats`` interleaved rounds: round r runs every (contender, batch) once, in an
order rotated each round, each after a wait for co-tenants to go quiet, and the bandwidth
worker once. Each contender's figure is its best round (least decode time; TTFT is the least
TTFT of any round); the bandwidth is the best of all its sums.

Per (contender, batch): TTFT, per-step latency = decode_s / (n_new - 1), decode tokens/s =
batch * (n_new - 1) / decode_s (prefill excluded), and the step's share of the measured
bandwidth. **Bytes per step convention**: every stored weight tensor read once (a tied
embedding/head table once: the head GEMV reads all of it, the embedding lookup only ``batch``
rows, which are not counted) plus the key/value cache the step attends over, on average
``prompt + n_new / 2`` positions per sequence. HF: unique parameter bytes (fp32); llama.cpp:
the GGUF file's tensor bytes (Q4_1 / Q8_0 blocks as stored) and an f16 cache; kiln: its model's
parameters and persistent buffers (packed INT4 included). Ratios are decode tokens/s over HF
``generate`` (on the same weight dtype: ``hf-bf16`` for ``kiln-bf16``) and over llama.cpp at
the same batch. The result goes to
``results/decode-<device-slug>-<yyyymmdd>.json`` with a markdown table beside it.

``--gguf q8_0`` (or ``q4_0``, ``q4_k_m``, ``q4_1``, or a path) runs the contenders that read a
GGUF file on that file instead of the catalog's Q4_1 one (``kiln.bench.gguf_variants``):
llama.cpp and every kiln variant (``kiln-int4`` keeps it packed as stored); the file, its
tensor types and its quant type (in the file name too, ``decode-...-q8_0``) are recorded.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import signal
import sys
import tempfile
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from kiln.bench import RESULTS_DIR, system
from kiln.bench.gguf_variants import describe, format_types, gguf_arg, gguf_file
from kiln.bench.llm_decode_peers import CONTENDERS
from kiln.bench.suite_runner import Worker, timed_request, worker_env
from kiln.core.offline import hub_offline

DEFAULT_PROMPT = "The old lighthouse keeper climbed the narrow stairs every evening to light the lamp, and one stormy night he saw"
DEFAULT_CONTENDERS = ("hf", "llamacpp", "kiln-eager", "kiln-fast", "kiln-int4")
RESULT_KEYS = ("schema", "kind", "date", "device", "versions", "threads", "prompt", "n_new",
               "batches", "repeats", "protocol", "conventions", "bandwidth", "contenders",
               "results", "load_before", "load_after")  # fmt: skip
ENTRY_KEYS = ("contender", "batch", "ttft_ms", "per_token_ms", "decode_tokens_per_s",
              "bytes_per_step", "achieved_gbs", "bandwidth_share", "vs_hf", "vs_llamacpp",
              "rounds")  # fmt: skip


def tokenize_prompt(text: str) -> list[int]:
    """Token ids of ``text`` with SmolLM2's tokenizer (read from the GGUF file, offline)."""
    from kiln.models.catalog import smollm2_gguf_path

    hub_offline()
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ids: list[int] = tok(text)["input_ids"]
    return ids


def kv_bytes_per_step(kv_bytes_per_position: int, batch: int, prompt_len: int, n_new: int) -> float:
    """Mean cache bytes a decode step attends over: step j (1..n_new-1) reads prompt_len + j
    positions per sequence, so the mean is prompt_len + n_new / 2."""
    return kv_bytes_per_position * batch * (prompt_len + n_new / 2)


def bandwidth_share(bytes_per_step: float, step_s: float, bandwidth_gbs: float) -> float:
    """Fraction of the measured bandwidth a step reaches: bytes / time / bandwidth."""
    if step_s <= 0 or bandwidth_gbs <= 0:
        raise ValueError(f"step time {step_s} s and bandwidth {bandwidth_gbs} GB/s must be > 0")
    return bytes_per_step / step_s / (bandwidth_gbs * 1e9)


def summarize(
    name: str, batch: int, facts: dict[str, Any], rounds: list[dict[str, Any]],
    prompt_len: int, n_new: int, bandwidth_gbs: float,
) -> dict[str, Any]:  # fmt: skip
    """One result entry from a contender's facts and its rounds (see the module docstring)."""
    entry: dict[str, Any] = {"contender": name, "batch": batch, "rounds": rounds}
    done = [r for r in rounds if "error" not in r]
    if not done:
        entry["error"] = rounds[-1]["error"] if rounds else "no rounds ran"
        return entry
    best = min(done, key=lambda r: r["decode_s"])
    step_s = best["decode_s"] / (n_new - 1)
    weights = int(facts["weight_bytes"])
    kv = kv_bytes_per_step(int(facts["kv_bytes_per_position"]), batch, prompt_len, n_new)
    entry.update(
        ttft_ms=min(r["ttft_s"] for r in done) * 1e3,
        per_token_ms=step_s * 1e3,
        decode_tokens_per_s=batch / step_s,
        total_s=best["total_s"],
        weight_bytes=weights,
        kv_bytes_per_step=kv,
        bytes_per_step=weights + kv,
        achieved_gbs=(weights + kv) / step_s / 1e9,
        bandwidth_share=bandwidth_share(weights + kv, step_s, bandwidth_gbs),
        best_round_cotenant_busy=best.get("cotenant_busy"),
        tokens=best["tokens"],
        extra=best.get("extra", {}),
    )
    return entry


def _leading_agreement(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def add_ratios(results: list[dict[str, Any]]) -> None:
    """Set ``vs_hf`` / ``vs_llamacpp`` (decode tokens/s over the peer's at the same batch;
    the HF peer of a ``-bf16`` contender is ``hf-bf16``, of the others fp32 ``hf``)
    and ``same_tokens_as_hf`` (leading tokens of sequence 0 equal to HF's) on each entry."""
    by_key = {(r["contender"], r["batch"]): r for r in results if "error" not in r}
    for r in results:
        bf16 = r["contender"].endswith("-bf16") and r["contender"] != "hf-bf16"
        hf_peer = "hf-bf16" if bf16 else "hf"  # the same weight dtype (hf-bf16: over fp32)
        for peer, key in ((hf_peer, "vs_hf"), ("llamacpp", "vs_llamacpp")):
            p = by_key.get((peer, r["batch"]))
            ok = p is not None and "error" not in r
            r[key] = r["decode_tokens_per_s"] / p["decode_tokens_per_s"] if ok and p else None
        hf = by_key.get(("hf", r["batch"]))
        if hf is not None and "tokens" in r:
            r["same_tokens_as_hf"] = _leading_agreement(r["tokens"][0], hf["tokens"][0])


def check_schema(result: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the first key a decode result or one of its entries lacks."""
    for key in RESULT_KEYS:
        if key not in result:
            raise ValueError(f"decode result lacks {key!r}")
    for i, entry in enumerate(result["results"]):
        for key in ("contender", "batch", "rounds") if "error" in entry else ENTRY_KEYS:
            if key not in entry:
                raise ValueError(
                    f"decode result entry {i} ({entry.get('contender')}) lacks {key!r}"
                )


def _versions() -> dict[str, str | None]:
    out = system.versions()
    for pkg in ("transformers", "llama_cpp_python", "gguf"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _start(name: str, args: list[str], env: dict[str, str], tmp: Path, timeout_s: float
           ) -> tuple[Worker | None, dict[str, Any]]:  # fmt: skip
    """Start one worker and wait for its ready line: (worker or None, facts or error)."""
    w = Worker(["--contender", name, *args], env, tmp / f"{name.replace(':', '_')}.log",
               module="kiln.bench.llm_decode_peers")  # fmt: skip
    msg = w.recv(timeout_s)
    if "error" in msg:
        w.close()
        return None, msg
    msg.pop("ready", None)
    return w, msg


def _interleave(
    workers: dict[str, Worker], rounds: dict[tuple[str, int], list[dict[str, Any]]],
    bw_rounds: list[float], repeats: int, opts: dict[str, Any], n_new: int, log: Any,
) -> None:  # fmt: skip
    """``repeats`` rounds: the bandwidth worker once, then every (contender, batch) once in an
    order rotated each round; replies are appended to ``rounds`` / ``bw_rounds``. A worker
    whose round fails is closed and dropped."""
    units = [u for u in rounds if u[0] in workers]
    for r in range(repeats):
        k = r % max(len(units), 1)
        if "bandwidth" in workers:
            msg, _, _ = timed_request(workers["bandwidth"], "round 0", opts)
            if "gbs" in msg:
                bw_rounds.append(msg["gbs"])
        for name, b in units[k:] + units[:k]:
            if name not in workers:
                continue
            msg, other, quiet = timed_request(workers[name], f"round {b}", opts)
            msg.update(round=r, cotenant_busy=other, busy_before=quiet)
            rounds[(name, b)].append(msg)
            if "error" in msg:
                log(f"  {name} b{b} round {r}: {msg['error'][:300]}")
                workers.pop(name).close()
            else:
                log(f"  round {r} {name} b{b}: ttft {msg['ttft_s'] * 1e3:.1f} ms, "
                    f"{b * (n_new - 1) / msg['decode_s']:.1f} tok/s")  # fmt: skip


def run_decode(
    contenders: Sequence[str] = DEFAULT_CONTENDERS,
    batches: Sequence[int] = (1, 4),
    n_new: int = 64,
    repeats: int = 3,
    prompt: str = DEFAULT_PROMPT,
    out_dir: str | Path = RESULTS_DIR,
    *,
    prompt_ids: list[int] | None = None,
    bandwidth_mb: int = 256,
    quiet_wait_s: float = 2.0,
    quiet_busy: float = 0.25,
    prepare_timeout_s: float = 900.0,
    round_timeout_s: float = 600.0,
    tag: str = "",
    gguf: str | None = None,
    log: Any = print,
) -> dict[str, Any]:
    """Run the side-by-side decode benchmark, write JSON + markdown, return the result
    (``result["path"]`` and ``result["markdown_path"]`` name the files: decode-DEVICE-DATE,
    then the quant type of ``gguf`` (a ``gguf_arg`` value) and ``-tag`` when given, so a
    second run the same day keeps the first)."""
    if n_new < 2:
        raise ValueError(f"n_new must be >= 2 to time a decode step, got {n_new}")
    ids = prompt_ids if prompt_ids is not None else tokenize_prompt(prompt)
    batches = list(batches)
    cpu = system.cpu_info()
    now = dt.datetime.now(dt.timezone.utc)
    opts = {"quiet_wait_s": quiet_wait_s, "quiet_busy": quiet_busy,
            "round_timeout_s": round_timeout_s}  # fmt: skip
    result: dict[str, Any] = {
        "schema": 1, "kind": "decode", "date": now.isoformat(timespec="seconds"),
        "device": {**cpu, "slug": system.device_slug(cpu)}, "versions": _versions(),
        "threads": 2, "prompt": {"text": prompt if prompt_ids is None else None,
                                 "ids": ids, "n_tokens": len(ids)},
        "n_new": n_new, "batches": batches, "repeats": repeats,
        "protocol": {**opts, "statistic": "best round (least decode time); TTFT least of rounds",
                     "greedy": "argmax, no end-of-sequence stop", "order": "rotated each round"},
        "conventions": {
            "bytes_per_step": "every stored weight tensor once (tied embedding/head once) + KV "
                              "cache over prompt + n_new/2 positions per sequence",
            "per_token_ms": "decode_s / (n_new - 1): one step, all sequences of the batch",
            "decode_tokens_per_s": "batch * (n_new - 1) / decode_s (prefill excluded)"},
        "load_before": system.load_snapshot(), "contenders": {},
    }  # fmt: skip
    common = ["--prompt-ids", ",".join(map(str, ids)), "--n-new", str(n_new),
              "--batches", ",".join(map(str, batches)), "--bandwidth-mb", str(bandwidth_mb)]  # fmt: skip
    if gguf is not None:  # made here, once, before any worker reads it
        path = gguf_file(gguf)
        result["gguf"] = describe(path)
        common += ["--gguf", str(path)]
        tag = "-".join(filter(None, (result["gguf"]["file_type"], tag)))
    rounds: dict[tuple[str, int], list[dict[str, Any]]] = {}
    bw_rounds: list[float] = []
    with tempfile.TemporaryDirectory(prefix="kiln-decode-") as tmp:
        env = worker_env(Path(tmp) / "inductor-cache")
        workers: dict[str, Worker] = {}
        for name in ["bandwidth", *contenders]:
            log(f"preparing {name}")
            w, facts = _start(name, common, env, Path(tmp), prepare_timeout_s)
            result["contenders"][name] = facts
            if w is None:
                log(f"  {name}: {facts['error'][:300]}")
                continue
            workers[name] = w
            if name == "bandwidth":
                bw_rounds.append(facts["gbs"])
            else:
                skip = facts.get("unsupported", {})
                rounds.update({(name, b): [] for b in batches if str(b) not in skip})
        try:
            _interleave(workers, rounds, bw_rounds, repeats, opts, n_new, log)
        finally:
            for w in workers.values():  # each asked to finish; closed (killed if stuck)
                if w.proc.poll() is None:
                    w.send("finish")
                    w.recv(30.0)
                w.close()
    if not bw_rounds:
        raise RuntimeError(f"bandwidth worker failed: {result['contenders']['bandwidth']}")
    gbs = max(bw_rounds)
    result["bandwidth"] = {"gbs": gbs, "rounds_gbs": bw_rounds, "threads": 2,
                           "method": f"sum of a {bandwidth_mb} MB float32 tensor, best of all"}  # fmt: skip
    result["results"] = [
        summarize(name, b, result["contenders"][name], rs, len(ids), n_new, gbs)
        for (name, b), rs in rounds.items()
    ]
    result["load_after"] = system.load_snapshot()
    add_ratios(result["results"])
    check_schema(result)
    name = f"decode-{result['device']['slug']}-{now:%Y%m%d}{'-' + tag if tag else ''}.json"
    return system.write_result(result, out_dir, name, render_markdown(result))


def _fmt(v: float | None, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def _gguf_line(result: dict[str, Any]) -> list[str]:
    """The GGUF file line of a result run with ``--gguf`` (none otherwise)."""
    g = result.get("gguf")
    if g is None:
        return []
    return [f"GGUF file {g['file']} ({g['file_type']}): {format_types(g['tensor_types'])}."]


def render_markdown(result: dict[str, Any]) -> str:
    """A markdown table of a decode result, one row per (contender, batch)."""
    lines = [
        f"Decode speed, {result['device']['name']} ({result['threads']} threads), "
        f"{result['date'][:10]}: prompt {result['prompt']['n_tokens']} tokens, "
        f"{result['n_new']} new tokens, greedy, best of {result['repeats']} rounds; "
        f"read bandwidth {result['bandwidth']['gbs']:.1f} GB/s.",
        *_gguf_line(result),
        "",
        "| contender | batch | TTFT ms | ms/step | decode tok/s | vs HF | vs llama.cpp "
        "| MB/step | GB/s | bandwidth share | co-tenant busy |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for e in result["results"]:
        if "error" in e:
            lines.append(f"| {e['contender']} | {e['batch']} | error: {e['error'][:80]} |")
            continue
        lines.append(
            f"| {e['contender']} | {e['batch']} | {e['ttft_ms']:.1f} | {e['per_token_ms']:.2f} "
            f"| {e['decode_tokens_per_s']:.1f} | {_fmt(e['vs_hf'], '.2f')} "
            f"| {_fmt(e['vs_llamacpp'], '.2f')} | {e['bytes_per_step'] / 1e6:.1f} "
            f"| {e['achieved_gbs']:.1f} | {e['bandwidth_share']:.1%} "
            f"| {_fmt(e.get('best_round_cotenant_busy'), '.0%')} |"
        )
    for name, facts in result["contenders"].items():
        if "error" in facts:
            lines.append(f"\n{name}: not run ({facts['error'][:200]})")
        elif facts.get("unsupported"):
            lines.append(f"\n{name}: batches {', '.join(facts['unsupported'])} not run "
                         f"({next(iter(facts['unsupported'].values()))})")  # fmt: skip
        if facts.get("bytes_note"):
            lines.append(f"\n{name}: MB/step and bandwidth share are {facts['bytes_note']}")
    for e in result["results"]:
        acc = e.get("extra", {}).get("acceptance")
        if acc is not None:
            lines.append(f"\n{e['contender']} b{e['batch']}: {acc:.0%} of the draft's guesses "
                         f"accepted, {e['extra']['tokens_per_round']:.2f} tokens a round")  # fmt: skip
    lines.append(f"\nBytes per step: {result['conventions']['bytes_per_step']}. Co-tenant busy: "
                 "share of all CPUs other processes used during the best round.")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kiln.bench.llm_decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--contenders", default=",".join(DEFAULT_CONTENDERS),
                   help=f"comma list of {', '.join(CONTENDERS)} or 'module:callable' paths")  # fmt: skip
    p.add_argument("--batches", default="1,4")
    p.add_argument("--n-new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--out", default=str(RESULTS_DIR))
    p.add_argument("--tag", default="", help="file name suffix: decode-DEVICE-DATE-TAG.json")
    p.add_argument("--gguf", type=gguf_arg, default=None,
                   help="a GGUF file, or q4_0 / q8_0 / q4_k_m (made from the catalog's) / q4_1")  # fmt: skip
    p.add_argument("--from-result", default=None, help="render this result JSON, run nothing")
    args = p.parse_args(argv)
    # SIGTERM ends the run through SystemExit, so the workers are closed on the way out
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.from_result:
        result = json.loads(Path(args.from_result).read_text())
    else:
        result = run_decode(
            [c for c in args.contenders.split(",") if c],
            [int(b) for b in args.batches.split(",") if b],
            args.n_new, args.repeats, args.prompt, args.out, tag=args.tag, gguf=args.gguf,
        )  # fmt: skip
        print(f"wrote {result['path']} and {result['markdown_path']}")
    print(render_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
