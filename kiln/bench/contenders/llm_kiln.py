"""kiln as a decode contender (see ``kiln.bench.llm_decode_peers``).

Five variants on SmolLM2, all loaded through ``kiln.models.load.load_model("smollm2")``:
``kiln-eager`` (the ``Transformer`` module op by op, fp32 dequantized weights), ``kiln-fast``
(``kiln.llm.fast_decoder.FastDecoder``, the same weights), ``kiln-bf16`` (``FastDecoder`` on
those weights cast to bfloat16: 16-bit weights and cache, fp32 math), ``kiln-int4``
(``FastDecoder`` on the GGUF's Q4_1 weights kept packed, ``packed=True``, and the head
quantized to INT8 per channel as llama.cpp reads its Q8_0 table) and ``kiln-spec`` (the
``kiln-fast`` model's greedy text by ``kiln.llm.speculative``: an INT8 copy guesses
``SPEC_GUESSES`` tokens, the fp32 model checks them in one call; batch 1). Given another GGUF
file of the model (``gguf``), each loads that file instead: ``kiln-int4`` keeps every
quantized tensor packed as stored (``GgufLinear``, 8-bit activations as
llama.cpp), the others dequantize it. kiln modules
are imported when a contender is prepared, not before. ``timed_greedy`` times any ``prefill``/``step`` pair the
same way, so another decoder with those two methods plugs in through
``KilnDecode``'s ``model`` argument or a factory of its own.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from kiln.bench.llm_decode_peers import THREADS, Generation, kv_position_bytes
from kiln.bench.system import portable_path


def timed_greedy(
    prefill: Callable[[torch.Tensor], torch.Tensor],
    step: Callable[[torch.Tensor, int], torch.Tensor],
    prompt: Sequence[int],
    n_new: int,
    batch: int,
) -> Generation:
    """Greedy loop over a ``prefill(tokens (B, T)) -> logits (B, T, V)`` and a
    ``step(tokens (B,), pos) -> logits (B, V)`` pair: TTFT = prefill + first argmax, decode = the
    ``n_new - 1`` later steps (``kiln.bench.llm_decode_peers``'s definitions)."""
    tokens = torch.tensor([list(prompt)] * batch, dtype=torch.long)  # (B, T)
    out = torch.empty(batch, n_new, dtype=torch.long)  # (B, n_new)
    pos = tokens.shape[1]
    with torch.inference_mode():
        t0 = time.perf_counter()
        nxt = prefill(tokens)[:, -1].argmax(-1)  # (B,)
        out[:, 0] = nxt
        t1 = time.perf_counter()
        for i in range(1, n_new):
            nxt = step(nxt, pos).argmax(-1)  # (B,)
            out[:, i] = nxt
            pos += 1
        t2 = time.perf_counter()
    return Generation(t1 - t0, t2 - t1, t2 - t0, out.tolist())


Variant = Literal["eager", "fast", "int4", "bf16", "spec"]
SPEC_GUESSES = (
    8  # kiln-spec: guesses a round (6-8 best over 8 prompts: kiln.bench.speculative_rounds)
)


class KilnDecode:
    """kiln on SmolLM2: ``eager`` (the Transformer module, fp32 dequantized weights),
    ``fast`` (``FastDecoder``, same weights), ``bf16`` (``FastDecoder``, the weights in
    bfloat16), ``int4`` (``FastDecoder`` on the GGUF's packed 4-bit weights) or ``spec``
    (the fp32 ``fast`` model verifying an INT8 copy's guesses: ``SpeculativeDecoder``, batch
    1 only). ``model`` replaces the loaded SmolLM2 (tests use a tiny one); ``gguf`` names
    another GGUF file of it to load instead of the catalog's."""

    def __init__(self, variant: Variant, model: Any = None, gguf: str | None = None) -> None:
        self.variant, self.model, self.gguf = variant, model, gguf
        self.decoders: dict[int, Any] = {}
        self.spec: Any = None  # the SpeculativeDecoder of variant "spec"

    def prepare(self, batches: Sequence[int], max_len: int) -> dict[str, Any]:
        torch.set_num_threads(THREADS)
        source = "given model"
        if self.model is None:
            from kiln.models.load import load_model

            packed = self.variant == "int4"
            dtype = torch.bfloat16 if self.variant == "bf16" else torch.float32
            loaded = load_model(self.gguf or "smollm2", dtype, packed=packed, with_tokenizer=False)
            self.model, source = loaded.model, str(loaded.source)
        self.model.eval()
        # A float head becomes INT8 (113 MB fp32 else); the packed GGUF's own Q8_0 table,
        # already the head as stored (GgufLinear), is left as it is (quantize_ skips it).
        if self.variant == "int4":
            from kiln.compress.configs import Int8WeightOnly
            from kiln.llm.fast_decoder import quantize_head_

            quantize_head_(self.model, Int8WeightOnly())
        unsupported: dict[str, str] = {}
        if self.variant == "eager":
            from kiln.llm.generate import EagerDecoder

            self.decoders = {b: EagerDecoder(self.model, b, max_len) for b in batches}
        elif self.variant == "spec":
            from kiln.llm.fast_decoder import FastDecoder
            from kiln.llm.speculative import SpeculativeDecoder, quantized_draft

            target = FastDecoder(self.model, 1, max_len, max_chunk=SPEC_GUESSES + 1)
            draft = FastDecoder(quantized_draft(self.model), 1, max_len)
            self.decoders = {1: target}
            self.spec = SpeculativeDecoder(target, draft, SPEC_GUESSES)
            unsupported = {str(b): "speculative decoding runs one sequence" for b in batches
                           if b != 1}  # fmt: skip
        else:
            from kiln.llm.fast_decoder import FastDecoder

            self.decoders = {b: FastDecoder(self.model, b, max_len) for b in batches}
        from kiln.deploy.generate_job import weight_bytes_per_token

        cfg = self.model.cfg
        label = {"int4": "int4 packed", "bf16": "bfloat16"}.get(self.variant, "float32")
        if self.gguf is not None and self.variant == "int4":
            label = f"GGUF as stored, packed ({packed_layers(self.model)})"
        first = min(self.decoders)
        cache = getattr(self.decoders[first], "cache", None)
        if cache is not None and hasattr(cache, "nbytes"):
            kv = cache.nbytes() // (first * cache.max_len)
            kv_note = "measured from the decoder's cache"
        else:
            kv = kv_position_bytes(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 4)
            kv_note = "assumed fp32 (the decoder exposes no cache)"
        return {
            "runtime": f"kiln {self.variant}, torch {torch.__version__}",
            "source": portable_path(source),
            "dtype": label,
            "threads": torch.get_num_threads(),
            # What one step reads: blocks, final norm and head. An untied fp32 embedding
            # table (kiln-int4 reads the file's Q8_0 head instead) is looked up one row per token.
            "weight_bytes": weight_bytes_per_token(self.model),
            "kv_bytes_per_position": kv,
            "kv_note": kv_note,
            "unsupported": unsupported,
            **(
                {
                    "bytes_note": "the fp32 target's bytes per emitted token: a round reads the "
                    "INT8 draft k times and the target once for up to k + 1 tokens, so the "
                    "share is effective, not read"
                }
                if self.variant == "spec"
                else {}
            ),
        }

    def generate(self, prompt: Sequence[int], n_new: int, batch: int) -> Generation:
        if self.variant == "spec":
            return self._speculate(prompt, n_new)
        dec = self.decoders[batch]
        return timed_greedy(dec.prefill, dec.step, prompt, n_new, batch)

    def _speculate(self, prompt: Sequence[int], n_new: int) -> Generation:
        """One greedy generation by ``SpeculativeDecoder``: TTFT = both prefills, decode =
        the rounds after the first token."""
        from kiln.llm.generate import generate

        t0 = time.perf_counter()
        gen = generate(self.spec, torch.tensor([list(prompt)]), n_new)
        total = time.perf_counter() - t0
        st = gen.speculation
        assert st is not None
        extra = {"acceptance": st.acceptance, "tokens_per_round": st.tokens_per_round,
                 "guesses_per_round": self.spec.k, "draft": "INT8 per channel (head too)"}  # fmt: skip
        return Generation(gen.ttft_s, sum(gen.step_s), total, gen.tokens.tolist(), extra)


def packed_layers(model: torch.nn.Module) -> str:
    """The model's packed linear layers by type, most first ("Q5_0 x166, Q4_K x16"): a
    ``GgufLinear`` by the type it stores, an ``Int4Linear`` (kiln's own INT4) as "INT4",
    any other by its class."""
    from kiln.compress.modules import CompressedLinear, Int4Linear

    counts = Counter(
        "INT4" if isinstance(m, Int4Linear) else getattr(m, "type_name", type(m).__name__)
        for m in model.modules()
        if isinstance(m, CompressedLinear)
    )
    return ", ".join(f"{name} x{n}" for name, n in counts.most_common())


def kiln_eager(gguf: str | None = None) -> KilnDecode:
    return KilnDecode("eager", gguf=gguf)


def kiln_fast(gguf: str | None = None) -> KilnDecode:
    return KilnDecode("fast", gguf=gguf)


def kiln_int4(gguf: str | None = None) -> KilnDecode:
    return KilnDecode("int4", gguf=gguf)


def kiln_bf16(gguf: str | None = None) -> KilnDecode:
    return KilnDecode("bf16", gguf=gguf)


def kiln_spec(gguf: str | None = None) -> KilnDecode:
    return KilnDecode("spec", gguf=gguf)
