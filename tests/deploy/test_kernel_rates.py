"""The CPU engine-cost table the planner reads: the two-shape fit, lookup, caching, timers,
and the CPU cost model that prices a layout with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.deploy import estimate_cpu, kernel_rates, rates_table
from kiln.deploy.architecture import read_architecture
from kiln.deploy.kernel_rates import (
    Cost,
    fit,
    fit_at_rate,
    prefill_seconds,
    rate_at,
    step_seconds,
)
from kiln.deploy.rank_rates import layout_engine, layouts_of, measure_collective, measure_layouts
from kiln.deploy.rates_table import load_rates
from kiln.llm.generate import EagerDecoder
from kiln.models.config import ModelConfig
from tests.support.host_load import FixedLoad
from tests.support.models import tiny_transformer

TABLE = {"fast-int8": {1: Cost(20.0, 1e-5), 4: Cost(12.0, 2e-5)}, "eager-int8": {1: Cost(7.0, 0)}}


def test_fit_recovers_a_fixed_cost_per_block_and_a_rate() -> None:
    true = Cost(rate=25.0, layer_s=40e-6)
    narrow = (24, 300e6, true.seconds(300e6, 24))
    wide = (4, 500e6, true.seconds(500e6, 4))
    got = fit(narrow, wide)
    assert got.rate == pytest.approx(25.0) and got.layer_s == pytest.approx(40e-6)


def test_fit_at_a_known_rate_solves_only_the_fixed_cost() -> None:
    """t = layers x 2 ms + bytes / 20 GB/s, with noise on both points: the fixed cost comes
    back within the noise, where the free fit's rate moves far more."""
    points = [(24, 60e6, 24 * 2e-3 + 60e6 / 20e9), (4, 300e6, 4 * 2e-3 + 300e6 / 20e9)]
    exact = fit_at_rate(points, 20.0)
    assert exact.rate == 20.0 and exact.layer_s == pytest.approx(2e-3)
    noisy = [(layers, amount, t * f) for (layers, amount, t), f in zip(points, (1.05, 0.95))]
    assert fit_at_rate(noisy, 20.0).layer_s == pytest.approx(2e-3, rel=0.06)
    assert abs(fit(*noisy).rate / 20.0 - 1) > 0.1  # the free fit: twice the noise in its rate
    assert fit_at_rate([(4, 1e9, 1e-3)], 1.0).layer_s == 0.0  # faster than the rate: no fixed cost


def test_fit_never_returns_a_negative_fixed_cost() -> None:
    # the narrow model ran "too fast" (noise): no fixed cost, the pooled rate instead
    got = fit((24, 300e6, 0.010), (4, 500e6, 0.030))
    assert got.layer_s == 0.0 and got.rate == pytest.approx(800e6 / 0.040 / 1e9)


def test_rate_at_takes_the_nearest_measured_rows_below() -> None:
    assert rate_at(TABLE, "fast-int8", 1) == Cost(20.0, 1e-5)
    assert rate_at(TABLE, "fast-int8", 3) == Cost(20.0, 1e-5)
    assert rate_at(TABLE, "fast-int8", 8) == Cost(12.0, 2e-5)
    assert rate_at(TABLE, "eager-int8", 4) == Cost(7.0, 0)
    assert rate_at(TABLE, "fast-fp32", 1) is None


def test_rates_are_cached_per_machine_and_thread_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    calls = []

    def fake(threads: int = 2, note: object = None) -> dict[str, dict[int, Cost]]:
        calls.append(threads)
        return {"fast-fp32": {1: Cost(25.0, 1e-5), 4: Cost(19.0, 2e-5)}}

    def fake_layouts(
        ranks: int, formats: object, gloo: Cost, note: object, one_process: object
    ) -> dict:
        calls.append(-ranks)
        assert one_process == {"fast-fp32": {1: Cost(25.0, 1e-5), 4: Cost(19.0, 2e-5)},
                               "gloo": {2: Cost(1.0, 5e-5)}}  # fmt: skip
        return {"tp2-pp1-fp32": {1: Cost(3.0, 1e-3)}}

    monkeypatch.setattr(rates_table, "measure_rates", fake)
    monkeypatch.setattr(rates_table, "measure_collective", lambda world: Cost(1.0, 5e-5))
    monkeypatch.setattr(rates_table, "measure_layouts", fake_layouts)
    monkeypatch.setattr(rates_table.os, "sched_getaffinity", lambda pid: {0, 1})  # 2 cores
    monkeypatch.setattr(rates_table, "OtherLoad", FixedLoad)  # a quiet host
    want = {"fast-fp32": {1: Cost(25.0, 1e-5), 4: Cost(19.0, 2e-5)}, "gloo": {2: Cost(1.0, 5e-5)}}
    assert load_rates(2) == want and calls == [2]
    assert load_rates(2) == want and calls == [2]  # from the file
    # another thread count, another table: 1 thread a rank is 2 ranks here, timed launched
    assert load_rates(1) == {**want, "tp2-pp1-fp32": {1: Cost(3.0, 1e-3)}}
    assert calls == [2, 1, -2]
    path = Path(rates_table.rates_path(2))
    assert json.loads(path.read_text())["fast-fp32"]["4"] == [19.0, 2e-5]
    path.write_text("{broken")
    load_rates(2)
    assert calls == [2, 1, -2, 2]  # a corrupt entry is measured again
    # timed while other processes used half the CPU: used, said, and not cached
    path.unlink()
    monkeypatch.setattr(FixedLoad, "share", 0.5)
    warnings: list[str] = []
    assert load_rates(2, warn=warnings.append) == want
    assert not path.exists() and "50% of the CPU" in warnings[0]


def test_step_and_prefill_timers_time_real_work() -> None:
    model = tiny_transformer()
    assert 0 < step_seconds(EagerDecoder(model, 2, 32), 2, 4, 1) < 1.0
    assert 0 < prefill_seconds(model, 64, repeats=1) < 5.0


def test_a_gloo_all_reduce_between_two_ranks_is_measured() -> None:
    cost = measure_collective(2, sizes=(4096, 1 << 18))
    assert cost.layer_s < 0.05 and cost.rate > 0.01  # a loopback message: under 50 ms


TINY_SHAPES = (
    ("narrow", ModelConfig(family="llama", vocab_size=256, hidden_size=64, n_layers=6, n_heads=4,
                           n_kv_heads=2, head_dim=16, intermediate_size=128, max_positions=128)),
    ("wide", ModelConfig(family="llama", vocab_size=256, hidden_size=256, n_layers=2, n_heads=4,
                         n_kv_heads=2, head_dim=64, intermediate_size=512, max_positions=128)),
)  # fmt: skip


def test_layouts_of_two_ranks_are_timed_launched() -> None:
    assert layouts_of(2) == [(1, 2), (2, 1)] and layouts_of(4) == [(1, 4), (2, 2), (4, 1)]
    one = {"eager-int8": {1: Cost(5.0, 0.0), 4: Cost(4.0, 0.0)}}  # no prefill-int8: free fit
    got = measure_layouts(2, ("int8",), Cost(1.0, 1e-4), shapes=TINY_SHAPES, one_process=one)
    want = {layout_engine(tp, pp, "int8", prefill) for tp, pp in ((2, 1), (1, 2))
            for prefill in (False, True)}  # fmt: skip
    assert set(got) == want
    assert {rows: c.rate for rows, c in got["tp2-pp1-int8"].items()} == {1: 5.0, 4: 4.0}
    for engine, by_rows in got.items():
        assert set(by_rows) == ({64, 256} if engine.startswith("prefill-") else {1, 4})
        assert all(c.rate > 0 and c.layer_s >= 0 for c in by_rows.values())


# --------------------------------------------------------------- the CPU cost model
RATES = {
    "fast-int8": {1: Cost(20.0, 10e-6)},
    "eager-int8": {1: Cost(8.0, 100e-6)},
    "prefill-int8": {64: Cost(100.0, 200e-6)},
    "gloo": {2: Cost(2.0, 50e-6)},
}


def _run(tp: int, pp: int) -> estimate_cpu.CpuRun:
    return estimate_cpu.CpuRun("int8", tp, pp, 1, 64, 96, "none", 4, [24 // pp] * pp, 4e6, 30e6)


def test_one_process_is_priced_as_the_fast_step_reads_its_weights() -> None:
    arch = read_architecture("qwen2-0.5b")
    run = _run(1, 1)
    kv = 24 * 96 * 2 * arch.n_kv_heads * arch.head_dim * 4  # every layer's cache, fp32
    want = 24 * 10e-6 + (24 * 4e6 + kv + 30e6) / 20e9
    assert estimate_cpu.decode_ms(arch, run, RATES) == pytest.approx(want * 1e3)


def test_tensor_parallel_ranks_pay_two_all_reduces_per_block_and_the_logits() -> None:
    arch = read_architecture("qwen2-0.5b")
    one, two = _run(1, 1), _run(2, 1)
    kv = 24 * 96 * 2 * arch.n_kv_heads * arch.head_dim * 4
    eager = 24 * 100e-6 + (24 * 4e6 / 2 + kv / 2 + 30e6) / 8e9
    reduce = 50e-6 + arch.hidden_size * 4 / 2e9
    logits = 50e-6 + arch.vocab_size * 4 / 2e9
    got = estimate_cpu.decode_ms(arch, two, RATES)
    assert got == pytest.approx((eager + 48 * reduce + logits) * 1e3)
    assert estimate_cpu.decode_ms(arch, one, RATES) < got  # 2 cores: TP does not pay here
    assert estimate_cpu.decode_ms(arch, _run(1, 1), {}) is None  # unmeasured: the roofline's


def test_a_layout_timed_launched_is_priced_by_its_own_engine() -> None:
    """Its all-reduces and contention are in the timing: only the critical path's bytes
    (stages in turn, a rank's shard, the whole head) and the vocabulary's logits remain."""
    arch = read_architecture("qwen2-0.5b")
    layout = Cost(4.0, 2e-3)
    rates = {**RATES, "tp1-pp2-int8": {1: layout}, "prefill-tp1-pp2-int8": {64: Cost(50.0, 1e-3)}}
    run = _run(1, 2)
    kv = 24 * 96 * 2 * arch.n_kv_heads * arch.head_dim * 4
    logits = 50e-6 + arch.vocab_size * 4 / 2e9
    want = layout.seconds(24 * 4e6 + kv + 30e6, 24) + logits
    assert estimate_cpu.decode_ms(arch, run, rates) == pytest.approx(want * 1e3)
    composite = estimate_cpu.decode_ms(arch, run, RATES)  # eager + gloo, as before
    assert composite is not None and composite < want * 1e3
    flops = 24 * (2 * 64 * arch.params_per_layer + 2 * 2 * arch.n_heads * arch.head_dim * 64**2 / 2)
    flops += 2 * arch.hidden_size * arch.vocab_size  # the head: the last position only
    ttft = Cost(50.0, 1e-3).seconds(flops, 24) + logits
    assert estimate_cpu.prefill_ms(arch, run, rates) == pytest.approx(ttft * 1e3)


def test_a_point_timed_in_two_rounds_keeps_the_faster() -> None:
    runs: kernel_rates.Timings = {}
    kernel_rates.record(runs, "fast-int8", 1, 24, 3e8, 0.012)
    kernel_rates.record(runs, "fast-int8", 1, 4, 5e8, 0.020)
    kernel_rates.record(runs, "fast-int8", 1, 24, 3e8, 0.010)  # the same point, a later round
    kernel_rates.record(runs, "fast-int8", 1, 4, 5e8, 0.025)
    assert runs == {"fast-int8": {1: [(24, 3e8, 0.010), (4, 5e8, 0.020)]}}
