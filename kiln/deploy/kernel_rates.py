"""How fast kiln's decode-step kernels stream weights on this CPU, per weight format.

The CPU cost model needs more than the machine's bandwidth: each kernel family (fp32 and
16-bit GEMV, INT8 and INT4 weight-only) reaches its own share of it, and the share moves
with the number of activation rows. ``measure_rates`` times kiln's whole decode step (the
C++ ``FastDecoder``) on a random-weight model of SmolLM2's block shapes in each format,
larger than the last-level cache in every format, so its weights stream from memory as in
a real step; the figure is the weight bytes one step reads per second. ``eager-<format>``
entries time the eager module instead (batch 1), the engine of plans that stream their
blocks from disk; ``prefill-<format>`` entries are GFLOP/s of a 64-token prefill. ``load_rates`` caches
the table per CPU (model name and ISA flags) and thread count; ``kiln calibrate`` refreshes
it.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping

import torch

from kiln.core.cache import cache_dir
from kiln.core.hardware import cpu_model
from kiln.core.native import cpu_flags
from kiln.llm.generate import Decoder
from kiln.models.transformer import Transformer

FORMATS = ("fp32", "bf16", "int8", "int4-g32", "int4-g64", "int4-g128")
ROWS = (1, 4)
PREFILL_TOKENS = 64  # prompts over 32 rows prefill through the eager module

Rates = Mapping[str, Mapping[int, float]]  # format -> rows -> GB/s of weight bytes


def _model(fmt: str) -> Transformer:
    """A random-weight transformer of SmolLM2's block shapes (30 layers, hidden 576), its
    blocks stored in ``fmt`` (kiln's kernels), its head INT8 when the blocks are compressed
    (as ``kiln generate`` runs a compressed model)."""
    from kiln.deploy.execute import store_in_format
    from kiln.models.config import ModelConfig

    cfg = ModelConfig(family="llama", vocab_size=4096, hidden_size=576, n_layers=30,
                      n_heads=9, n_kv_heads=3, head_dim=64, intermediate_size=1536,
                      max_positions=256)  # fmt: skip
    torch.manual_seed(0)
    return store_in_format(Transformer(cfg).eval(), fmt)


def measure_rates(threads: int = 2) -> dict[str, dict[int, float]]:
    """GB/s of weight bytes kiln's whole decode step streams, per format and batch rows:
    the bytes one step reads (``weight_bytes_per_token``) over the step's best median time."""
    from kiln.deploy.generate_job import weight_bytes_per_token
    from kiln.llm.fast_decoder import FastDecoder
    from kiln.llm.generate import EagerDecoder

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    out: dict[str, dict[int, float]] = {}
    # FLOPs count the dense parameters (compressed layers keep their weights as buffers)
    dense_params = sum(p.numel() for p in _model("fp32").parameters())
    try:
        for fmt in FORMATS:
            model = _model(fmt)
            nbytes = weight_bytes_per_token(model)
            out[fmt] = {
                rows: nbytes / step_seconds(FastDecoder(model, rows, 64), rows, 16, 3) / 1e9
                for rows in ROWS
            }
            eager = step_seconds(EagerDecoder(model, 1, 64), 1, 8, 2)  # offloaded plans' engine
            out[f"eager-{fmt}"] = {1: nbytes / eager / 1e9}
            out[f"prefill-{fmt}"] = {PREFILL_TOKENS: prefill_gflops(model, dense_params)}
    finally:
        torch.set_num_threads(before)
    return out


def step_seconds(decoder: Decoder, rows: int, steps: int, repeats: int) -> float:
    """Best over ``repeats`` of the median of ``steps`` decode steps after a short prefill."""
    tok = torch.zeros(rows, dtype=torch.long)
    decoder.prefill(torch.zeros(rows, 4, dtype=torch.long))
    best = float("inf")
    for _ in range(repeats):
        times = []
        for pos in range(4, 4 + steps):
            t0 = time.perf_counter()
            decoder.step(tok, pos)
            times.append(time.perf_counter() - t0)
        best = min(best, sorted(times)[len(times) // 2])
    return best


def prefill_gflops(model: Transformer, params: int, tokens: int = PREFILL_TOKENS) -> float:
    """GFLOP/s of a ``tokens``-token prefill at batch 1 (2 x ``params`` x tokens, ``params``
    the model's dense parameter count), best of 3."""
    from kiln.deploy.generate_job import GenerateRequest, choose_decoder

    request = GenerateRequest(checkpoint="", prompt="")
    best = float("inf")
    for _ in range(3):
        dec, _ = choose_decoder(model, request, 1, tokens + 4)
        t0 = time.perf_counter()
        dec.prefill(torch.zeros(1, tokens, dtype=torch.long))
        best = min(best, time.perf_counter() - t0)
    return 2 * params * tokens / best / 1e9


def rates_path(threads: int) -> str:
    key = hashlib.sha256(f"{cpu_model()}|{' '.join(cpu_flags())}".encode()).hexdigest()[:12]
    return str(cache_dir("kernel-rates") / f"rates-{key}-{threads}t.json")


def load_rates(threads: int = 2, refresh: bool = False) -> dict[str, dict[int, float]]:
    """This CPU's table (cached JSON), measured now (a few seconds) when missing."""
    path = rates_path(threads)
    if not refresh and os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
            return {fmt: {int(r): float(v) for r, v in by.items()} for fmt, by in raw.items()}
        except (ValueError, KeyError, TypeError, AttributeError):
            pass  # a stale or corrupt entry: measure again
    rates = measure_rates(threads)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(rates, f, indent=1)
    os.replace(tmp, path)
    return rates


def rate_at(rates: Rates, fmt: str, rows: int) -> float | None:
    """The GB/s for ``fmt`` at ``rows`` activation rows: measured at the nearest measured
    row count not above it (more rows only raise the rate of a streaming kernel)."""
    by = rates.get(fmt)
    if not by:
        return None
    fits = [r for r in by if r <= rows] or [min(by)]
    return by[max(fits)]
