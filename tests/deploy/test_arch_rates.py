"""Engine costs timed on the model's own blocks: the split into blocks and head, the
tensor-parallel shard a rank times, layouts re-based on them, and the cost model's use."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from kiln.deploy import estimate_cpu
from kiln.deploy.arch_rates import (
    build_in_format,
    head_engine,
    measure_arch_rates,
    probe_config,
    probe_layers,
    split_fit,
    with_layouts,
)
from kiln.deploy.architecture import Architecture, read_architecture
from kiln.deploy.kernel_rates import FORMATS, Cost
from kiln.models.config import ModelConfig
from kiln.models.transformer import Transformer
from kiln.parallel.tp import shard_tensor_parallel
from tests.support.host_load import FixedLoad
from tests.support.models import TINY_LLAMA


def test_split_fit_recovers_the_blocks_and_the_head_rates() -> None:
    """t = layers x block / 30 GB/s + head / 9 GB/s: both rates come back, and they price a
    model of any depth of that block (here 24) as it would run."""
    block, head = 30e6, 272e6
    t = lambda n: n * block / 30e9 + head / 9e9  # noqa: E731
    got = split_fit((1, block + head, t(1)), (3, 3 * block + head, t(3)))
    assert got is not None
    blocks, rest = got
    assert blocks.rate == pytest.approx(30.0) and rest.rate == pytest.approx(9.0)
    assert blocks.layer_s == 0 and rest.layer_s == 0
    assert blocks.seconds(24 * block) + rest.seconds(head) == pytest.approx(t(24))


def test_split_fit_refuses_timings_that_do_not_grow_with_the_blocks() -> None:
    assert split_fit((1, 2e8, 0.020), (3, 4e8, 0.019)) is None
    # a rest lost in the noise is priced as more blocks, never at a negative time
    blocks, rest = split_fit((1, 2e8, 0.008), (3, 4e8, 0.030)) or (None, None)
    assert blocks is not None and rest == blocks and blocks.rate == pytest.approx(1e8 / 0.011 / 1e9)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_a_probe_holds_the_shard_a_tensor_parallel_rank_holds(tp: int) -> None:
    """Rank 0's block after ``shard_tensor_parallel`` has exactly the probe's parameters
    (kv heads replicated when fewer than the ranks: TINY_LLAMA has 2)."""
    cfg = dataclasses.replace(TINY_LLAMA, sliding_windows=(16, None))
    probe = probe_config(cfg, 1, tp)
    assert probe.n_layers == 1 and probe.sliding_windows == (16,)
    torch.manual_seed(0)
    sharded = shard_tensor_parallel(Transformer(cfg), 0, tp) if tp > 1 else Transformer(cfg)
    want = sum(p.numel() for p in sharded.layers[0].parameters())
    assert Architecture.from_model_config(probe, "p", "").params_per_layer == want


def test_layouts_are_re_based_on_the_models_own_engines() -> None:
    """A layout keeps what its ranks add per block over the calibration's eager engine and
    takes the rate and the head of the model's own (shard's) engine."""
    table = {
        "eager-fp32": {1: Cost(10.0, 1e-3)},
        "tp1-pp2-fp32": {1: Cost(10.0, 1.5e-3)},
        "tp2-pp1-fp32": {1: Cost(10.0, 3e-3)},
        "fast-fp32": {1: Cost(20.0, 1e-5)},
        "gloo": {2: Cost(0.5, 3e-4)},
    }
    arch = {
        "eager-fp32": {1: Cost(12.0, 0.0)}, head_engine("eager-fp32"): {1: Cost(6.0, 0.0)},
        "eager-tp2-fp32": {1: Cost(9.0, 0.0)}, head_engine("eager-tp2-fp32"): {1: Cost(5.0, 0.0)},
        "fast-fp32": {1: Cost(25.0, 0.0)},
    }  # fmt: skip
    got = with_layouts(table, arch)
    assert got["tp1-pp2-fp32"][1] == Cost(12.0, pytest.approx(0.5e-3))
    assert got["tp2-pp1-fp32"][1] == Cost(9.0, pytest.approx(2e-3))
    assert got[head_engine("tp1-pp2-fp32")][1] == Cost(6.0, 0.0)
    assert got[head_engine("tp2-pp1-fp32")][1] == Cost(5.0, 0.0)
    assert got["fast-fp32"][1] == Cost(25.0, 0.0) and got["gloo"] == table["gloo"]


def test_the_cost_model_prices_the_head_at_its_own_rate() -> None:
    arch = read_architecture("qwen2-0.5b")
    rates = {"fast-int8": {1: Cost(20.0, 0.0)}, head_engine("fast-int8"): {1: Cost(5.0, 0.0)},
             "prefill-int8": {64: Cost(100.0, 0.0)},
             head_engine("prefill-int8"): {64: Cost(2.0, 0.0)}}  # fmt: skip
    run = estimate_cpu.CpuRun("int8", 1, 1, 1, 64, 96, "none", 4, [24], 4e6, 30e6)
    kv = 24 * 96 * 2 * arch.n_kv_heads * arch.head_dim * 4
    want = (24 * 4e6 + kv) / 20e9 + 30e6 / 5e9
    assert estimate_cpu.decode_ms(arch, run, rates) == pytest.approx(want * 1e3)
    flops = 24 * (2 * 64 * arch.params_per_layer + 2 * 2 * arch.n_heads * arch.head_dim * 64**2 / 2)
    head = 2 * arch.hidden_size * arch.vocab_size
    ttft = flops / 100e9 + head / 2e9
    assert estimate_cpu.prefill_ms(arch, run, rates) == pytest.approx(ttft * 1e3)


def test_every_engine_is_timed_on_the_models_blocks_and_shards() -> None:
    """On a tiny model, one thread: the fast step, the eager step and the prefill of the
    whole block and of a 2-way shard, each with its head, in every format."""
    cfg = ModelConfig(family="llama", vocab_size=256, hidden_size=128, n_layers=2, n_heads=4,
                      n_kv_heads=2, head_dim=32, intermediate_size=512, max_positions=64)  # fmt: skip
    got = measure_arch_rates(cfg, 1, fast=True, shards=(1, 2))
    for fmt in FORMATS:
        engines = [f"fast-{fmt}", f"eager-{fmt}", f"prefill-{fmt}", f"eager-tp2-{fmt}",
                   f"prefill-tp2-{fmt}"]  # fmt: skip
        for engine in engines:
            # timings that did not grow with the blocks (noise) leave a row out, never all
            assert got.get(engine), (engine, sorted(got))
            for rows, cost in got[engine].items():
                assert cost.rate > 0 and cost.layer_s == 0
                assert head_engine(engine) in got and rows in got[head_engine(engine)]


def test_the_larger_probe_weighs_about_the_head() -> None:
    """Qwen2-0.5B: a 136M-weight table beside 15M-weight blocks, so the cap (8); SmolLM2:
    28M beside 3.4M, 1 + 9 capped; Qwen2-1.5B: 233M beside 47M, 1 + 5; a tiny model: its
    own depth, never under 3."""
    for name, want in (("qwen2-0.5b", 8), ("smollm2", 8), ("qwen2-1.5b", 6)):
        cfg = read_architecture(name).config
        assert cfg is not None and probe_layers(cfg) == (1, want), name
    assert probe_layers(TINY_LLAMA) == (1, 3)


def test_timings_taken_beside_other_work_are_not_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A busy host's timings price this plan but are never written to the cache.
    import kiln.deploy.arch_rates as ar

    path = tmp_path / "arch.json"
    timed = {"eager-fp32": {1: Cost(10.0, 0.0)}}
    calls: list[int] = []

    def measure(*_: object, **__: object) -> dict[str, dict[int, Cost]]:
        calls.append(1)
        return timed

    monkeypatch.setattr(ar, "arch_rates_path", lambda *_: str(path))
    monkeypatch.setattr(ar, "measure_arch_rates", measure)
    monkeypatch.setattr(ar, "OtherLoad", FixedLoad)
    notes: list[str] = []
    monkeypatch.setattr(FixedLoad, "share", 0.5)
    assert ar.load_arch_rates(TINY_LLAMA, 2, 2, notes.append) == timed
    assert not path.exists() and any("not cached" in n for n in notes)
    monkeypatch.setattr(FixedLoad, "share", 0.05)
    ar.load_arch_rates(TINY_LLAMA, 2, 2)
    assert path.exists() and len(calls) == 2
    ar.load_arch_rates(TINY_LLAMA, 2, 2)  # now read from the cache
    assert len(calls) == 2


def test_each_probe_follows_the_rest_of_the_models_traffic(monkeypatch: pytest.MonkeyPatch) -> None:
    """Between two of a probe's steps the whole model reads its other blocks: that many
    bytes pass through the caches (capped at four last-level caches); a probe as deep as
    the model reads nothing extra."""
    import kiln.deploy.arch_rates as arch_rates

    cfg = dataclasses.replace(TINY_LLAMA, n_layers=6)
    probes = [build_in_format(probe_config(cfg, n), "fp32") for n in (1, 3)]
    per_block = (nbytes(probes[1]) - nbytes(probes[0])) / 2
    whole = nbytes(probes[0]) + 5 * per_block
    monkeypatch.setattr(arch_rates, "cache_bytes", lambda: (0, 0, 2**30))
    small, large = arch_rates.probe_evictors(cfg, probes, (1, 3))
    assert small is not None and large is not None
    assert small.buffer.numel() == int(whole - nbytes(probes[0])) // 4
    assert large.buffer.numel() == int(whole - nbytes(probes[1])) // 4
    monkeypatch.setattr(arch_rates, "cache_bytes", lambda: (0, 0, 1024))  # a tiny LLC: capped
    assert arch_rates.probe_evictors(cfg, probes, (1, 3))[0].buffer.numel() == 1024  # type: ignore[union-attr]
    deep = [build_in_format(probe_config(cfg, n), "fp32") for n in (1, 6)]
    assert arch_rates.probe_evictors(cfg, deep, (1, 6))[1] is None


def nbytes(model: Transformer) -> float:
    from kiln.deploy.generate_job import weight_bytes_per_token

    return float(weight_bytes_per_token(model))
