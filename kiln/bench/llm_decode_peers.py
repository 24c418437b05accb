"""Decode-speed contenders for ``kiln.bench.llm_decode``, and the worker process that runs one.

A contender generates ``n_new`` tokens greedily after a prompt and times itself:

* ``ttft_s``   -- time to first token: prefill of the prompt + choosing the first new token,
* ``decode_s`` -- the ``n_new - 1`` later steps (one forward pass + choosing a token each).

It is anything with ``prepare(batches, max_len) -> facts`` and ``generate(prompt, n_new,
batch) -> Generation`` (the ``DecodeContender`` protocol), built by a no-argument factory; a
factory with a ``gguf`` keyword also runs on another GGUF file of the model (``--gguf``).
Factories are named in ``CONTENDERS`` or given as a callable path ``"package.module:factory"``,
so a new decoder plugs in without touching this file. ``prepare``'s facts must include
``weight_bytes`` (bytes a decode step reads from the weights) and ``kv_bytes_per_position``
(bytes of one sequence's key/value cache per position, all layers); ``unsupported`` maps a
batch size the contender cannot run to the reason.

Greedy means argmax with no end-of-sequence stop: every contender produces exactly ``n_new``
tokens, so the same number of steps is timed. Nothing here imports torch, transformers or
llama_cpp at module level: each worker process loads only its own runtime (their thread pools
stall each other on 2 cores).

Worker: ``python -m kiln.bench.llm_decode_peers --contender NAME --prompt-ids 1,2,3 --n-new 64
--batches 1,4 [--gguf FILE]`` replies on stdout with one JSON line per command read from stdin:
first ``{"ready": true, "load_s": ..., <facts>}`` (or ``{"error": ...}``), then for
``round B`` the timings and tokens of one generation at batch ``B``, for ``finish``
``{"ok": true}``. The contender ``bandwidth`` instead replies to ``round`` with the best
read bandwidth of a 256 MB float32 sum.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import IO, TYPE_CHECKING, Any, Protocol

from kiln.bench.channel import reply_channel, send

if TYPE_CHECKING:
    import torch

THREADS = 2

CONTENDERS: dict[str, str] = {
    "hf": "kiln.bench.contenders.llm_hf:HFGenerate",
    "hf-bf16": "kiln.bench.contenders.llm_hf:hf_bf16",
    "llamacpp": "kiln.bench.llm_decode_peers:LlamaCpp",
    "kiln-eager": "kiln.bench.contenders.llm_kiln:kiln_eager",
    "kiln-fast": "kiln.bench.contenders.llm_kiln:kiln_fast",
    "kiln-int4": "kiln.bench.contenders.llm_kiln:kiln_int4",
    "kiln-bf16": "kiln.bench.contenders.llm_kiln:kiln_bf16",
    "kiln-spec": "kiln.bench.contenders.llm_kiln:kiln_spec",
}


@dataclass
class Generation:
    """One timed greedy generation: ``tokens`` is (batch, n_new) token ids."""

    ttft_s: float
    decode_s: float
    total_s: float
    tokens: list[list[int]]
    extra: dict[str, Any] = field(default_factory=dict)


class DecodeContender(Protocol):
    """What the decode worker drives (see the module docstring)."""

    def prepare(self, batches: Sequence[int], max_len: int) -> dict[str, Any]: ...

    def generate(self, prompt: Sequence[int], n_new: int, batch: int) -> Generation: ...


def resolve(name: str) -> Callable[[], DecodeContender]:
    """The factory for a registered name or a ``"package.module:callable"`` path."""
    path = CONTENDERS.get(name, name)
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        known = ", ".join(CONTENDERS)
        raise KeyError(f"unknown decode contender {name!r}: known {known}, or 'module:callable'")
    factory: Callable[[], DecodeContender] = getattr(importlib.import_module(module), attr)
    return factory


def build(name: str, gguf: str | None = None) -> DecodeContender:
    """The contender ``name`` on the model's catalog file, or on the GGUF file ``gguf``
    (its factory must take a ``gguf`` keyword: a contender that cannot read the file is
    refused rather than run on other weights)."""
    factory: Callable[..., DecodeContender] = resolve(name)
    if gguf is None:
        return factory()
    if "gguf" not in inspect.signature(factory).parameters:
        raise ValueError(f"decode contender {name!r} cannot run on a given GGUF file (--gguf)")
    return factory(gguf=gguf)


def unique_tensor_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of ``tensors`` with shared storage counted once (a tied head and embedding)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()))
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def state_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters and persistent buffers (packed weights included),
    shared tensors once: what a decode step reads when it touches every weight once."""
    return unique_tensor_bytes(list(model.state_dict(keep_vars=True).values()))


def kv_position_bytes(layers: int, kv_heads: int, head_dim: int, elem_bytes: int) -> int:
    """Key + value bytes of one position of one sequence, all layers."""
    return 2 * layers * kv_heads * head_dim * elem_bytes


# ---------------------------------------------------------------- llama.cpp


def gguf_tensor_bytes(path: str) -> int:
    """Bytes of every tensor stored in a GGUF file (quantized blocks as stored)."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors)


class LlamaCpp:
    """llama.cpp through ``llama_cpp.Llama`` on the SmolLM2 GGUF file (or the file ``gguf``):
    one sequence only (the high-level ``Llama`` object decodes batch 1), greedy sampling
    (``temp=0``).
    Times are stream timestamps around ``Llama.generate``'s yields; llama.cpp's own
    prompt/eval timers are recorded beside them in ``extra``."""

    def __init__(self, gguf: str | None = None) -> None:
        self.path = gguf
        self.llm: Any = None

    def prepare(self, batches: Sequence[int], max_len: int) -> dict[str, Any]:
        import llama_cpp

        from kiln.bench.gguf_variants import format_types, tensor_types

        if self.path is None:
            from kiln.models.catalog import smollm2_gguf_path

            self.path = str(smollm2_gguf_path())
        self.llm = llama_cpp.Llama(
            model_path=self.path, n_ctx=max(512, max_len), n_batch=512, n_threads=THREADS,
            n_threads_batch=THREADS, verbose=False, logits_all=False,
        )  # fmt: skip
        meta = self.llm.metadata
        arch = meta.get("general.architecture", "llama")
        heads = int(meta[f"{arch}.attention.head_count"])
        kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
        head_dim = int(meta[f"{arch}.embedding_length"]) // heads
        layers = int(meta[f"{arch}.block_count"])
        return {
            "runtime": f"llama-cpp-python {llama_cpp.__version__}",
            "dtype": f"GGUF as stored ({format_types(tensor_types(self.path))}; f16 KV cache)",
            "threads": THREADS,
            "weight_bytes": gguf_tensor_bytes(self.path),
            "kv_bytes_per_position": kv_position_bytes(layers, kv_heads, head_dim, 2),
            "unsupported": {
                str(b): "llama_cpp.Llama decodes one sequence" for b in batches if b != 1
            },
        }

    def _perf(self) -> dict[str, float]:
        import llama_cpp

        data = llama_cpp.llama_perf_context(self.llm.ctx)
        return {
            "llama_prompt_ms": float(data.t_p_eval_ms),
            "llama_prompt_tokens": float(data.n_p_eval),
            "llama_eval_ms": float(data.t_eval_ms),
            "llama_eval_tokens": float(data.n_eval),
        }

    def generate(self, prompt: Sequence[int], n_new: int, batch: int) -> Generation:
        import llama_cpp

        if batch != 1:
            raise ValueError(f"llama_cpp.Llama decodes one sequence, not batch {batch}")
        self.llm.reset()  # no prompt-prefix reuse from the previous round
        llama_cpp.llama_perf_context_reset(self.llm.ctx)
        tokens: list[int] = []
        stamps: list[float] = []
        t0 = time.perf_counter()
        for tok in self.llm.generate(list(prompt), top_k=1, top_p=1.0, temp=0.0, reset=True):
            stamps.append(time.perf_counter())
            tokens.append(int(tok))
            if len(tokens) == n_new:
                break
        return Generation(
            ttft_s=stamps[0] - t0,
            decode_s=stamps[-1] - stamps[0],
            total_s=stamps[-1] - t0,
            tokens=[tokens],
            extra=self._perf(),
        )


# ---------------------------------------------------------------- bandwidth and the worker


def read_bandwidth_gbs(mbytes: int = 256, repeats: int = 5) -> float:
    """Best read bandwidth (GB/s) over ``repeats`` sums of a float32 tensor of ``mbytes``
    MB with ``THREADS`` threads (docs/benchmarks.md's measurement)."""
    import torch

    torch.set_num_threads(THREADS)
    big = torch.ones(mbytes * 1024 * 1024 // 4)  # (N,) float32
    big.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - t0)
    return big.nbytes / best / 1e9


def _error(e: BaseException) -> dict[str, Any]:
    traceback.print_exc()
    return {"error": f"{type(e).__name__}: {e}"[:2000]}


def serve(args: argparse.Namespace, chan: IO[str]) -> int:
    """Load (and warm up once per batch), then answer ``round B`` / ``finish`` lines."""
    prompt = [int(t) for t in args.prompt_ids.split(",") if t]
    batches = [int(b) for b in args.batches.split(",") if b]
    contender: DecodeContender | None = None
    try:
        if args.contender == "bandwidth":
            facts: dict[str, Any] = {"gbs": read_bandwidth_gbs(args.bandwidth_mb)}
        else:
            contender = build(args.contender, args.gguf)
            t0 = time.perf_counter()
            facts = contender.prepare(batches, len(prompt) + args.n_new)
            facts["load_s"] = time.perf_counter() - t0
            for b in batches:
                if str(b) not in facts.get("unsupported", {}):
                    contender.generate(prompt, args.n_new, b)  # warm-up, not recorded
    except Exception as e:  # noqa: BLE001 - every failure becomes a recorded error
        send(chan, _error(e))
        return 1
    send(chan, {"ready": True, **facts})
    for line in sys.stdin:
        cmd = line.split()
        try:
            if cmd[:1] == ["round"] and contender is None:
                send(chan, {"gbs": read_bandwidth_gbs(args.bandwidth_mb)})
            elif cmd[:1] == ["round"] and contender is not None:
                gen = contender.generate(prompt, args.n_new, int(cmd[1]))
                send(chan, asdict(gen))
            elif cmd[:1] == ["finish"]:
                send(chan, {"ok": True})
                return 0
            else:
                send(chan, {"error": f"unknown command {line.strip()!r}"})
        except Exception as e:  # noqa: BLE001
            send(chan, _error(e))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--contender", required=True, help="a CONTENDERS name, 'module:callable' or 'bandwidth'")  # fmt: skip
    p.add_argument("--prompt-ids", default="", help="comma-separated token ids")
    p.add_argument("--n-new", type=int, default=64)
    p.add_argument("--batches", default="1")
    p.add_argument("--bandwidth-mb", type=int, default=256)
    p.add_argument("--gguf", default=None, help="the GGUF file to run (default: the catalog's)")
    args = p.parse_args(argv)
    return serve(args, reply_channel())


if __name__ == "__main__":
    sys.exit(main())
