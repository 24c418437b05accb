"""kiln beside llama.cpp on Q4_0, Q8_0 and Q4_K_M files of SmolLM2: decode and prefill speed.

``python -m kiln.bench.gguf_quants [--qtypes q4_0,q8_0,q4_k_m] [--repeats 3]``

For each quant type, on the same file (``kiln.bench.gguf_variants``): the decode benchmark
(``kiln.bench.llm_decode``: ``llamacpp`` and ``kiln-int4``, which keeps the file's tensors
packed as stored; batch 1, ``--n-new`` tokens, best of ``--repeats`` rounds) and the prefill
benchmark (``kiln.bench.prefill``: ``llamacpp`` and ``kiln-after``, the same packed load;
a ``--length``-token prompt, least TTFT of ``--prefill-repeats`` rounds). Each writes its own
result (``decode-...-q8_0``, ``prefill-...-q8_0``); this collects their tokens/s into one
table, ratio = kiln's tokens/s over llama.cpp's (> 1: kiln is faster), in
``results/gguf-quants-<device>-<date>.json`` with a markdown table beside it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kiln.bench import RESULTS_DIR, system
from kiln.bench.gguf_variants import QTYPES, format_types, gguf_arg
from kiln.bench.llm_decode import run_decode
from kiln.bench.prefill import run_prefill

DECODE = ("llamacpp", "kiln-int4")
PREFILL = ("llamacpp", "kiln-after")
PEERS = {"llamacpp": "llamacpp", "kiln-int4": "kiln", "kiln-after": "kiln"}


def _pair(rates: dict[str, float]) -> dict[str, float | None]:
    """llama.cpp's and kiln's tokens/s (None where one did not run) and kiln / llama.cpp."""
    llama, kiln = rates.get("llamacpp"), rates.get("kiln")
    ratio = kiln / llama if llama and kiln else None
    return {"llamacpp": llama, "kiln": kiln, "ratio": ratio}


def _errors(result: dict[str, Any]) -> list[str]:
    """Every contender or entry error of a decode or prefill result, named."""
    out = [f"{name}: {f['error']}" for name, f in result["contenders"].items() if "error" in f]
    out += [f"{e['contender']}: {e['error']}" for e in result["results"] if "error" in e]
    return out


def collect(qtype: str, decode: dict[str, Any], prefill: dict[str, Any]) -> dict[str, Any]:
    """One table row from a quant type's decode result (batch 1) and prefill result (its one
    length): both runtimes' tokens/s and the ratios, the file, kiln's packed layer types."""
    dec = {PEERS[e["contender"]]: e["decode_tokens_per_s"] for e in decode["results"]
           if "error" not in e and e["batch"] == 1 and e["contender"] in PEERS}  # fmt: skip
    pre = {PEERS[e["contender"]]: e["tokens_per_s"] for e in prefill["results"]
           if "tokens_per_s" in e and e["contender"] in PEERS}  # fmt: skip
    return {
        "qtype": qtype, **decode["gguf"],
        "kiln_dtype": decode["contenders"].get("kiln-int4", {}).get("dtype"),
        "decode": _pair(dec), "prefill": _pair(pre),
        "sources": [system.portable_path(decode["path"]), system.portable_path(prefill["path"])],
        "errors": _errors(decode) + _errors(prefill),
    }  # fmt: skip


def run_quants(
    qtypes: Sequence[str] = tuple(QTYPES),
    n_new: int = 64,
    repeats: int = 3,
    length: int = 512,
    prefill_repeats: int = 5,
    out_dir: str | Path = RESULTS_DIR,
    *,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run both benchmarks on every quant type (module doc), write JSON + markdown, return
    the result (``result["path"]``, ``result["markdown_path"]``)."""
    from kiln.core import native

    cpu = system.cpu_info()
    now = dt.datetime.now(dt.timezone.utc)
    result: dict[str, Any] = {
        "schema": 1, "kind": "gguf-quants", "date": now.isoformat(timespec="seconds"),
        "device": {**cpu, "slug": system.device_slug(cpu), "isa": native.isa()},
        "threads": 2, "batch": 1, "n_new": n_new, "repeats": repeats, "length": length,
        "prefill_repeats": prefill_repeats, "decode_contenders": list(DECODE),
        "prefill_contenders": list(PREFILL), "rows": [],
    }  # fmt: skip
    for qtype in qtypes:
        log(f"== {qtype}: decode")
        decode = run_decode(DECODE, [1], n_new, repeats, out_dir=out_dir, gguf=qtype, log=log)
        log(f"== {qtype}: prefill of {length} tokens")
        prefill = run_prefill(PREFILL, [length], prefill_repeats, out_dir, gguf=qtype, log=log)
        result["rows"].append(collect(qtype, decode, prefill))
    name = f"gguf-quants-{result['device']['slug']}-{now:%Y%m%d}.json"
    return system.write_result(result, out_dir, name, render_markdown(result))


def _fmt(v: float | None, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def render_markdown(result: dict[str, Any]) -> str:
    """One row per quant type: decode and prefill tokens/s of both runtimes, the ratios."""
    dev, n = result["device"], result["length"]
    lines = [
        f"kiln beside llama.cpp on GGUF quant types of SmolLM2-135M-Instruct, {dev['name']} "
        f"({dev['isa']}, {result['threads']} threads), {result['date'][:10]}: decode at batch "
        f"{result['batch']}, {result['n_new']} new tokens, best of {result['repeats']} rounds; "
        f"prefill of {n} tokens, least of {result['prefill_repeats']} rounds. Ratio: kiln's "
        "tokens/s over llama.cpp's (> 1: kiln is faster).",
        "",
        "| quant type | decode llama.cpp tok/s | decode kiln tok/s | decode ratio "
        f"| prefill-{n} llama.cpp tok/s | prefill-{n} kiln tok/s | prefill ratio |",
        "|---|--:|--:|--:|--:|--:|--:|",
    ]
    for r in result["rows"]:
        d, p = r["decode"], r["prefill"]
        lines.append(
            f"| {r['file_type']} | {_fmt(d['llamacpp'], '.1f')} | {_fmt(d['kiln'], '.1f')} "
            f"| {_fmt(d['ratio'], '.2f')} | {_fmt(p['llamacpp'], '.0f')} "
            f"| {_fmt(p['kiln'], '.0f')} | {_fmt(p['ratio'], '.2f')} |"
        )
    lines.append("")
    for r in result["rows"]:
        lines.append(f"* {r['file']}: {format_types(r['tensor_types'])}; kiln: {r['kiln_dtype']}; "
                     f"from {', '.join(r['sources'])}.")  # fmt: skip
        lines += [f"  * error: {e[:200]}" for e in r["errors"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kiln.bench.gguf_quants", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--qtypes", default=",".join(QTYPES),
                   type=lambda s: [gguf_arg(q) for q in s.split(",") if q],
                   help="comma list of quant types or GGUF files")  # fmt: skip
    p.add_argument("--n-new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="decode rounds")
    p.add_argument("--length", type=int, default=512, help="prefill prompt tokens")
    p.add_argument("--prefill-repeats", type=int, default=5)
    p.add_argument("--out", default=str(RESULTS_DIR))
    p.add_argument("--from-result", default=None, help="render this result JSON, run nothing")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.from_result:
        result = json.loads(Path(args.from_result).read_text())
    else:
        result = run_quants(args.qtypes, args.n_new, args.repeats, args.length,
                            args.prefill_repeats, args.out)  # fmt: skip
        print(f"wrote {result['path']} and {result['markdown_path']}")
    print(render_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
