"""The llama.cpp prefill contenders of ``kiln.bench.prefill`` (llama-cpp-python and the
``llama-bench`` binary), and the prompt every contender is timed on."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Sequence
from typing import Any

THREADS = 2
SEED = 1234


def prompt_ids(length: int, vocab: int = 49152) -> list[int]:
    """``length`` token ids, drawn with a fixed seed in [100, vocab) (the same for all)."""
    import random

    rng = random.Random(SEED)
    return [rng.randrange(100, vocab) for _ in range(length)]


class LlamaCppPrefill:
    """llama.cpp via llama-cpp-python: TTFT of a one-token generation."""

    def __init__(self, gguf: str | None = None) -> None:
        self.gguf = gguf

    def prepare(self, lengths: Sequence[int]) -> dict[str, Any]:
        from kiln.bench.llm_decode_peers import LlamaCpp

        self.llm = LlamaCpp(self.gguf)
        facts = self.llm.prepare([1], max(lengths) + 8)
        for n in lengths:
            self.ttft(n)
        return {k: facts[k] for k in ("runtime", "dtype", "threads")}

    def ttft(self, n: int) -> dict[str, Any]:
        gen = self.llm.generate(prompt_ids(n), 1, 1)
        return {"ttft_s": gen.ttft_s, "token": gen.tokens[0][0], **gen.extra}


class LlamaBench:
    """llama.cpp's ``llama-bench`` binary: prompt processing time as it reports it."""

    def __init__(self, gguf: str | None = None) -> None:
        self.gguf = gguf

    def prepare(self, lengths: Sequence[int]) -> dict[str, Any]:
        from kiln.models.catalog import smollm2_gguf_path

        self.exe, self.path = shutil.which("llama-bench"), self.gguf or str(smollm2_gguf_path())
        if self.exe is None:
            raise FileNotFoundError("llama-bench is not on PATH")
        return {"runtime": "llama-bench", "threads": THREADS}

    def ttft(self, n: int) -> dict[str, Any]:
        assert self.exe is not None
        cmd = [self.exe, "-m", self.path, "-p", str(n), "-n", "0", "-t", str(THREADS),
               "-r", "1", "-o", "json"]  # fmt: skip
        out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
        return {"ttft_s": float(out[0]["avg_ns"]) / 1e9, "token": None}
