"""Disk offloading on the real model: peak resident memory and tokens/s.

    python -m kiln.bench.offload_memory [--unpacked] [--new-tokens 32] [--prefetch 1]

Generates greedily with SmolLM2-135M resident, then with every block's weights streamed
from a disk store (``kiln.llm.offload``) in the same process, and reports the peak
resident-memory increase while generating offloaded (VmHWM reset after offloading, minus
VmRSS then) against the blocks' bytes. Run in a fresh process for a clean figure. The
whole process's peak, loading included (the blocks streamed into the store as they are
read), is ``kiln.bench.load_memory``'s.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from kiln.llm.generate import EagerDecoder, generate
from kiln.llm.offload import offload_
from kiln.llm.offload_store import block_state
from kiln.models.load import load_model
from kiln.models.transformer import Transformer


def _status_kib(key: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{key}:\s+(\d+) kB", text, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {key} (not Linux?)")
    return int(match.group(1))


def _reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS


def measure_offload(
    model: Transformer,
    prompt: Tensor,
    new_tokens: int,
    store: Path,
    prefetch: int = 1,
    evict_page_cache: bool = False,
) -> dict[str, Any]:
    """Greedy generation resident, then offloaded to disk in this process: tokens/s of
    each, and the peak resident-memory increase while generating offloaded (VmHWM reset
    after offloading, minus VmRSS then). Run it in a fresh process for a clean figure."""
    max_len = prompt.shape[1] + new_tokens
    tensors = {t.data_ptr(): t for t in model.state_dict().values()}  # tied weights once
    weights = sum(t.numel() * t.element_size() for t in tensors.values())
    blocks = sum(
        t.numel() * t.element_size() for b in model.layers for t in block_state(b).values()
    )
    generate(EagerDecoder(model, prompt.shape[0], max_len), prompt, 2)  # warm-up
    resident = generate(EagerDecoder(model, prompt.shape[0], max_len), prompt, new_tokens)
    handle = offload_(model, store, prefetch=prefetch, evict_page_cache=evict_page_cache)
    gc.collect()
    before = _status_kib("VmRSS")
    _reset_peak_rss()
    offloaded = generate(EagerDecoder(model, prompt.shape[0], max_len), prompt, new_tokens)
    peak = _status_kib("VmHWM") - before
    result = {
        "model_bytes": weights,
        "block_bytes": blocks,
        "staging_bytes": handle.staging_bytes,
        "peak_rss_increase_bytes": peak * 1024,
        "same_tokens": bool(torch.equal(resident.tokens, offloaded.tokens)),
        "resident_tokens_per_s": resident.tokens_per_s,
        "offloaded_tokens_per_s": offloaded.tokens_per_s,
        "offloaded_wait_s": handle.wait_s,
        "torch_threads": torch.get_num_threads(),
    }
    handle.close()
    return result


def main(argv: Sequence[str] | None = None) -> None:
    """Measure offloading on SmolLM2-135M: prints measure_offload's JSON."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--unpacked", action="store_true", help="fp32 instead of 4-bit layers")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--evict-page-cache", action="store_true")
    args = parser.parse_args(argv)
    model = load_model("smollm2", packed=not args.unpacked, with_tokenizer=False).model
    gc.collect()
    prompt = torch.tensor([[1, 504, 2260, 3162, 282, 253, 1782, 3484, 1386, 28]])
    with tempfile.TemporaryDirectory(prefix="kiln-offload-") as tmp:
        result = measure_offload(
            model, prompt, args.new_tokens, Path(tmp), args.prefetch, args.evict_page_cache
        )
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
