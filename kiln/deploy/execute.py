"""Execute a plan on this CPU and measure it: the check behind ``kiln plan --verify``.

``run_layout`` loads the checkpoint, stores its block weights in the plan's format (kiln's
INT8 / INT4 kernels, bf16, or fp32), streams them from disk when the plan offloads, and
decodes a batch of prompts of the plan's length with kiln's one generation loop (the fast
C++ step where it runs, else eager), greedy. ``measure`` runs that in a fresh process
(``python -m kiln.deploy.execute``) so its peak resident memory is the plan's alone.

This increment executes single-process plans (tp = pp = 1); a plan with more ranks is
refused with that reason.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kiln.models.transformer import Transformer

FORMAT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Measured:
    """What one executed plan did (times in ms, memory in bytes)."""

    ms_per_token: float
    ttft_ms: float
    tokens_per_s: float
    peak_rss_bytes: int
    engine: str


def store_in_format(model: Transformer, fmt: str) -> Transformer:
    """Store ``model``'s block weights in the plan format ``fmt`` in place: bf16, or kiln's
    INT8 / INT4 kernels (then the head too is INT8, as ``kiln generate`` runs a compressed
    model); fp32 leaves it as it is."""
    from kiln.compress import Int4WeightOnly, Int8WeightOnly, quantize_
    from kiln.llm.fast_decoder import quantize_head_

    if fmt in FORMAT_DTYPES:
        return model.to(FORMAT_DTYPES[fmt])
    blocks = lambda _m, name: name.startswith("layers.")  # noqa: E731
    if fmt == "int8":
        quantize_(model, Int8WeightOnly(), filter_fn=blocks)
    elif fmt.startswith("int4-g"):
        quantize_(model, Int4WeightOnly(group_size=int(fmt[len("int4-g") :])), filter_fn=blocks)
    else:
        raise ValueError(f"kiln cannot store weights as {fmt!r} on this CPU")
    quantize_head_(model, Int8WeightOnly())
    return model


def run_layout(
    model: str, layout: dict[str, Any], fmt: str, prompt_len: int, gen_len: int
) -> dict[str, Any]:
    """Execute in this process; return the timings (no memory figure: see ``measure``)."""
    from kiln.deploy.generate_job import GenerateRequest, choose_decoder
    from kiln.llm.generate import EagerDecoder, Sampling, generate
    from kiln.models.load import load_model

    if layout["tp"] * layout["pp"] != 1:
        raise ValueError("this increment executes single-process plans only (tp = pp = 1)")
    batch = int(layout["batch"])
    loaded = load_model(model, FORMAT_DTYPES.get(fmt, torch.float32), packed=False,
                        with_tokenizer=False)  # fmt: skip
    store_in_format(loaded.model, fmt)
    request = GenerateRequest(checkpoint=model, prompt="", head="auto")
    gen_tokens = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, loaded.config.vocab_size, (batch, prompt_len), generator=gen_tokens)
    max_len = prompt_len + gen_len
    with tempfile.TemporaryDirectory(prefix="kiln-plan-") as store:
        if layout["offload"] != "none":
            from kiln.llm.offload import offload_

            offload_(loaded.model, Path(store), tier="disk")
            decoder: Any = EagerDecoder(loaded.model, batch, max_len)
            engine = "eager, blocks streamed from disk"
        else:
            decoder, engine = choose_decoder(loaded.model, request, batch, max_len)
        generate(decoder, prompt[:, :8], 2, Sampling())  # warm-up (prefill rewrites the cache)
        t0 = time.perf_counter()
        out = generate(decoder, prompt, gen_len, Sampling())
        total = time.perf_counter() - t0
    ms = statistics.median(out.step_s) * 1e3 if out.step_s else total * 1e3
    return {"ms_per_token": ms, "ttft_ms": out.ttft_s * 1e3,
            "tokens_per_s": batch * 1e3 / ms, "engine": engine}  # fmt: skip


def measure(
    model: str, layout: dict[str, Any], fmt: str, prompt_len: int, gen_len: int
) -> Measured:
    """``run_layout`` in a fresh process, which reports its own peak RSS (the kernel's
    high-water mark of its resident memory, loading included)."""
    args = json.dumps({"model": model, "layout": layout, "fmt": fmt,
                       "prompt_len": prompt_len, "gen_len": gen_len})  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "kiln.deploy.execute", args],
                          capture_output=True, text=True, timeout=1800)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"executing the plan failed:\n{proc.stderr[-2000:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    return Measured(got["ms_per_token"], got["ttft_ms"], got["tokens_per_s"],
                    got["peak_rss_bytes"], got["engine"])  # fmt: skip


def peak_rss_bytes() -> int:
    """This process's resident-memory high-water mark: ``VmHWM`` of /proc/self/status.
    (Not getrusage's ru_maxrss, which on Linux carries over the parent's peak through
    fork + exec, so a child started by a large process reports the parent's.)"""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError("no VmHWM in /proc/self/status: peak memory cannot be measured here")


def main() -> int:
    spec = json.loads(sys.argv[1])
    torch.set_num_threads(2)
    result = run_layout(
        spec["model"], spec["layout"], spec["fmt"], spec["prompt_len"], spec["gen_len"]
    )
    result["peak_rss_bytes"] = peak_rss_bytes()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
