"""Hugging Face ``generate`` as a decode contender (see ``kiln.bench.llm_decode_peers``).

Greedy (``do_sample=False``, one beam), KV cache on, fp32, 2 threads, on SmolLM2 as
``kiln.models.catalog.load_smollm2()`` returns it (the GGUF's Q4_1 weights dequantized to
fp32). Any batch: the prompt is repeated, so no padding is involved.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kiln.bench.llm_decode_peers import THREADS, Generation, kv_position_bytes, state_bytes


class _TimestampStreamer:
    """A transformers streamer that notes when each new token arrives (the first ``put``
    is the prompt itself)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFGenerate:
    """Hugging Face ``generate`` (greedy, KV cache on) on SmolLM2 dequantized to fp32.

    ``loader`` returns the ``PreTrainedModel`` to run (default: ``load_smollm2()``'s model).
    TTFT runs from the ``generate`` call to the streamer's ``put`` of the first new token;
    decode from there to the last token's ``put``. The end-of-sequence id is cleared from
    the generation config so that exactly ``n_new`` tokens come out.
    """

    def __init__(
        self, loader: Callable[[], Any] | None = None, dtype: torch.dtype = torch.float32
    ) -> None:
        self._loader, self._dtype = loader, dtype
        self.model: Any = None

    def prepare(self, batches: Sequence[int], max_len: int) -> dict[str, Any]:
        import transformers

        torch.set_num_threads(THREADS)
        if self._loader is None:
            from kiln.models.catalog import load_smollm2

            self.model = load_smollm2(self._dtype)[0]
        else:
            self.model = self._loader()
        cfg = self.model.config
        # No end-of-sequence stop: exactly n_new tokens, plain argmax.
        self.model.generation_config.eos_token_id = None
        self.model.generation_config.pad_token_id = 0
        dtype = next(self.model.parameters()).dtype
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv = kv_position_bytes(
            cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, dtype.itemsize
        )
        return {
            "runtime": f"transformers {transformers.__version__} generate, torch {torch.__version__}",
            "dtype": str(dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(),
            "weight_bytes": state_bytes(self.model),
            "kv_bytes_per_position": kv,
        }

    def generate(self, prompt: Sequence[int], n_new: int, batch: int) -> Generation:
        ids = torch.tensor([list(prompt)] * batch, dtype=torch.long)  # (B, T)
        streamer = _TimestampStreamer()
        t_call = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                do_sample=False, num_beams=1, streamer=streamer,
            )  # fmt: skip
        t_end = time.perf_counter()
        stamps = streamer.times[1:]  # one per new token
        if len(stamps) != n_new or out.shape[1] != len(prompt) + n_new:
            raise RuntimeError(
                f"HF generate made {out.shape[1] - len(prompt)} tokens and {len(stamps)} "
                f"stream events, expected {n_new}"
            )
        return Generation(
            ttft_s=stamps[0] - t_call,
            decode_s=stamps[-1] - stamps[0],
            total_s=t_end - t_call,
            tokens=out[:, len(prompt) :].tolist(),
        )


def hf_bf16() -> HFGenerate:
    """HF ``generate`` on the same weights cast to bfloat16 (the peer of ``kiln-bf16``)."""
    return HFGenerate(dtype=torch.bfloat16)
