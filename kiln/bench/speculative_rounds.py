"""Speculative decoding across many prompts: how often the draft is right, what it buys.

``python -m kiln.bench.speculative_rounds --prompts 8 --guesses 2,4,6``

``kiln.bench.llm_decode`` times one prompt; a speculative decoder's speed depends on the text
(how often the INT8 draft guesses the fp32 model's next token). Here each of ``prompts``
windows of *Pride and Prejudice* (the evaluation novel, ``prompt_len`` tokens each, spread
over its first 20,000 tokens) is continued by ``n_new`` greedy tokens of SmolLM2 fp32, in one
process on 2 threads, alternating per prompt: the plain fast step (``FastDecoder``, one
token a step) and ``SpeculativeDecoder`` with each number of guesses. Every contender runs
each prompt ``repeats`` times after a warm-up; its figure is the best run. Per prompt:
decode tokens/s (prefill excluded, as in ``kiln.bench.llm_decode``), the speed-up over the plain
step, the draft's acceptance, tokens per round, and whether the tokens equal the plain
step's (they must: the draft changes the speed, never the text). Results go to
``results/speculative-<device-slug>-<yyyymmdd>.{json,md}``. Ratios to Hugging
Face ``generate`` come from ``kiln.bench.llm_decode`` (own processes), not from here.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kiln.bench import RESULTS_DIR, system

THREADS = 2


def prompt_windows(ids: torch.Tensor, n: int, length: int) -> list[torch.Tensor]:
    """``n`` windows (1, length) of ``ids`` at evenly spaced starts."""
    if n < 1 or length < 1 or ids.numel() < length:
        raise ValueError(f"cannot cut {n} windows of {length} from {ids.numel()} tokens")
    step = (ids.numel() - length) // max(n - 1, 1)
    return [ids[i * step : i * step + length].view(1, length) for i in range(n)]


def run(prompts: int, guesses: Sequence[int], n_new: int, prompt_len: int, repeats: int,
        out_dir: Path, log: Any = print) -> dict[str, Any]:  # fmt: skip
    """Measure, write JSON + markdown, return the result (``result["path"]``)."""
    from kiln.llm.fast_decoder import FastDecoder
    from kiln.llm.generate import generate
    from kiln.llm.speculative import SpeculativeDecoder, quantized_draft
    from kiln.models.load import load_model
    from kiln.quality.corpus import evaluation_tokens

    torch.set_num_threads(THREADS)
    loaded = load_model("smollm2", torch.float32, packed=False)
    model = loaded.model.eval()
    if loaded.tokenizer is None:
        raise RuntimeError("SmolLM2's GGUF loaded without its tokenizer")
    windows = prompt_windows(evaluation_tokens(loaded.tokenizer, 20_000), prompts, prompt_len)
    max_len = prompt_len + n_new
    plain = FastDecoder(model, 1, max_len)
    target = FastDecoder(model, 1, max_len, max_chunk=max(guesses) + 1)
    draft = FastDecoder(quantized_draft(model), 1, max_len)
    specs = {k: SpeculativeDecoder(target, draft, k) for k in guesses}
    rows: list[dict[str, Any]] = []
    for i, prompt in enumerate(windows):
        generate(plain, prompt, n_new)  # warm-up, not recorded
        base = min((generate(plain, prompt, n_new) for _ in range(repeats)),
                   key=lambda g: sum(g.step_s))  # fmt: skip
        row: dict[str, Any] = {"prompt": i, "plain_tokens_per_s": base.tokens_per_s, "spec": {}}
        for k, spec in specs.items():
            generate(spec, prompt, n_new)  # warm-up
            gen = min((generate(spec, prompt, n_new) for _ in range(repeats)),
                      key=lambda g: sum(g.step_s))  # fmt: skip
            st = gen.speculation
            assert st is not None
            row["spec"][str(k)] = {
                "tokens_per_s": gen.tokens_per_s,
                "speedup": gen.tokens_per_s / base.tokens_per_s,
                "acceptance": st.acceptance,
                "tokens_per_round": st.tokens_per_round,
                "same_tokens": bool(torch.equal(gen.tokens, base.tokens)),
            }
        rows.append(row)
        log(f"prompt {i}: plain {base.tokens_per_s:.1f} tok/s; " + ", ".join(
            f"k={k} {s['tokens_per_s']:.1f} tok/s ({s['acceptance']:.0%} accepted)"
            for k, s in row["spec"].items()))  # fmt: skip
    cpu, now = system.cpu_info(), dt.datetime.now(dt.timezone.utc)
    summary = {
        str(k): {
            "median_speedup": statistics.median(r["spec"][str(k)]["speedup"] for r in rows),
            "min_speedup": min(r["spec"][str(k)]["speedup"] for r in rows),
            "median_acceptance": statistics.median(r["spec"][str(k)]["acceptance"] for r in rows),
            "all_same_tokens": all(r["spec"][str(k)]["same_tokens"] for r in rows),
        }
        for k in guesses
    }
    device = {**cpu, "slug": system.device_slug(cpu)}
    result: dict[str, Any] = {
        "kind": "speculative", "date": now.isoformat(timespec="seconds"),
        "device": device, "threads": THREADS,
        "model": "SmolLM2-135M fp32 (GGUF Q4_1 dequantized), draft INT8 per channel",
        "prompts": prompts, "prompt_len": prompt_len, "n_new": n_new, "repeats": repeats,
        "text": "Pride and Prejudice, first 20,000 tokens", "rows": rows, "summary": summary,
    }  # fmt: skip
    name = f"speculative-{device['slug']}-{now:%Y%m%d}.json"
    system.write_result(result, out_dir, name, render_markdown(result))
    return result


def render_markdown(result: dict[str, Any]) -> str:
    ks = list(result["summary"])
    lines = [
        f"Speculative decoding, {result['device']['name']} ({result['threads']} threads), "
        f"{result['date'][:10]}: {result['model']}; {result['prompts']} prompts of "
        f"{result['prompt_len']} tokens from {result['text']}, {result['n_new']} new tokens, "
        f"best of {result['repeats']}.",
        "",
        "| prompt | plain tok/s | " + " | ".join(f"k={k} tok/s (x, accepted)" for k in ks) + " |",
        "|--:|--:|" + "--:|" * len(ks),
    ]
    for r in result["rows"]:
        cells = [f"{s['tokens_per_s']:.1f} ({s['speedup']:.2f}x, {s['acceptance']:.0%})"
                 for s in (r["spec"][k] for k in ks)]  # fmt: skip
        lines.append(f"| {r['prompt']} | {r['plain_tokens_per_s']:.1f} | {' | '.join(cells)} |")
    lines.append("")
    for k, s in result["summary"].items():
        lines.append(f"- k={k}: median speed-up {s['median_speedup']:.2f}x (least "
                     f"{s['min_speedup']:.2f}x), median acceptance {s['median_acceptance']:.0%}, "
                     f"tokens equal to the plain step's on every prompt: {s['all_same_tokens']}")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kiln.bench.speculative_rounds", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--guesses", default="2,4,6", help="comma list of guesses per round")
    p.add_argument("--n-new", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS_DIR))
    args = p.parse_args(argv)
    guesses = [int(k) for k in args.guesses.split(",") if k]
    result = run(args.prompts, guesses, args.n_new, args.prompt_len, args.repeats, Path(args.out))
    print(f"wrote {result['path']}")
    print(render_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
