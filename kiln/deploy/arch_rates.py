"""The planner's engine costs on this CPU, measured on the model's own block shape.

The calibration table (``kernel_rates``, ``rank_rates``) fits each engine through two made-up
shapes (SmolLM2-like narrow blocks, 1.5B-like wide ones, a 4096-token vocabulary). That is
what a shape-independent engine needs, and not what this CPU's kernels are: on an Intel
Xeon with AMX, a (256, 896) x (896, 4864) bf16 product runs at 390 GFLOP/s where
(256, 6144) x (6144, 1536) runs at 950; bf16 SiLU over a (4, 64, 4864) activation costs
1.7 ms, a cost per activation element that neither a per-block constant nor a FLOP rate
is; and a 152k-row head streams 30% slower than the blocks. A fit through the two made-up
shapes put Qwen2-0.5B's bf16 prefill at 228 ms where it took 577.

So a CPU plan is priced with each engine timed on *the model's own architecture*
(``measure_arch_rates``): random weights, its real vocabulary and block, once with one
block and once with as many as weigh about its head (``probe_layers``: 3 to 8), the two in
turn, best of three. The two timings give, for that shape, a time per block and a
time for the rest (embedding, final norm, head, the call); ``split_fit`` writes each as a
``Cost`` over its own amount (``<engine>`` for the blocks, ``<engine>+head`` for the rest),
and the CPU cost model (``estimate_cpu``) prices a stage's blocks and the last stage's head
with them. A tensor-parallel rank's engine is timed on
its own shard of the block (its query/kv heads and MLP features, the whole head), at the
thread count a rank runs with. What running as several ranks adds on top of that — the
messages and hand-offs of every block — comes from the calibration's layouts: the layout's
fixed cost per block above the one-process eager engine's, both fitted at the same rate
(``with_layouts``).

Timing one architecture takes a few minutes per thread count (Qwen2-0.5B's about five);
the result is cached per CPU, thread count and shape, unless other processes used more
than ``rates_table.MAX_OTHER_LOAD`` of the CPU meanwhile: such timings came out
3-6x slow on a 2-core host and, cached, mispriced that model's plans on every later run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import TYPE_CHECKING

import torch

from kiln.core.cache import cache_dir
from kiln.core.calibrate import cache_bytes
from kiln.core.host_load import OtherLoad
from kiln.deploy.kernel_rates import (
    DECODE_ROWS,
    FORMATS,
    PREFILL_ROWS,
    CacheEvictor,
    Cost,
    Rates,
    Timings,
    matmul_params,
    prefill_flops,
    prefill_shape,
    record,
    step_seconds,
)
from kiln.deploy.rank_rates import layouts_of
from kiln.deploy.rates_table import cache_if_quiet, cpu_key, read_table
from kiln.models.config import ModelConfig

if TYPE_CHECKING:
    from kiln.llm.generate import Decoder
    from kiln.models.transformer import Transformer

VERSION = 6  # of the cached file's layout or method (6: the rest of the model between steps)
MAX_PROBE_LAYERS = 8  # blocks of the larger probe, at most
PROBE_POSITIONS = 320  # rows of the rotary / learned position tables the probes need
ROUNDS = 3  # timings of each probe, the models in turn


def probe_layers(cfg: ModelConfig) -> tuple[int, int]:
    """Blocks of the two timed models: one, and enough that the blocks added weigh about
    as much as the head (at least 3, at most ``MAX_PROBE_LAYERS`` and the model's own).
    A block is the difference of the two timings, so each timing's noise lands on it
    divided by the blocks added: with three blocks of Qwen2-0.5B beside its 136M-weight
    head, a 10% slower one-block run moved the per-block time by a quarter."""
    from kiln.deploy.architecture import Architecture

    arch = Architecture.from_model_config(cfg, "probe", "")
    head = max(arch.embedding_params, arch.head_params)  # what a step reads besides blocks
    added = -(-head // max(1, arch.params_per_layer))  # ceil
    return 1, max(3, min(MAX_PROBE_LAYERS, cfg.n_layers, 1 + added))


def probe_config(cfg: ModelConfig, layers: int, tp: int = 1) -> ModelConfig:
    """``cfg`` cut to ``layers`` blocks (its first layers' attention windows) and, for
    ``tp`` > 1, to the block shard tensor-parallel rank 0 holds: its query and kv heads
    (``partition_heads``: kv heads replicated below tp) and MLP features."""
    from kiln.parallel.tp import partition_features, partition_heads

    windows = cfg.sliding_windows[:layers] if cfg.sliding_windows else ()
    heads, kv_heads, features = cfg.n_heads, cfg.n_kv_heads, cfg.intermediate_size
    if tp > 1:
        shard = partition_heads(cfg.n_heads, cfg.n_kv_heads, tp)[0]
        heads, kv_heads = shard.q_stop - shard.q_start, shard.kv_stop - shard.kv_start
        f0, f1 = partition_features(cfg.intermediate_size, tp)[0]
        features = f1 - f0
    return dataclasses.replace(
        cfg, n_layers=layers, sliding_windows=windows, n_heads=heads, n_kv_heads=kv_heads,
        intermediate_size=features, max_positions=max(PROBE_POSITIONS, cfg.learned_offset + 1),
    )  # fmt: skip


def split_fit(
    one: tuple[int, float, float], three: tuple[int, float, float]
) -> tuple[Cost, Cost] | None:
    """The blocks' and the rest's ``Cost`` from two (layers, amount, seconds) timings of one
    block shape with the same head: a block is the difference of the two over the blocks
    added, the rest (embedding, final norm, head, the call) what remains of the smaller.
    Each is a rate over its own amount (a block's bytes or FLOPs; the head's) with no
    fixed part, so it scales with the rows of another prefill and prices a tensor-parallel
    shard's own probe. None when the timings do not grow with the blocks (noise)."""
    (l1, a1, t1), (l3, a3, t3) = one, three
    block_s, block_amount = (t3 - t1) / (l3 - l1), (a3 - a1) / (l3 - l1)
    if block_s <= 0 or block_amount <= 0:
        return None
    rest_s, rest_amount = t1 - l1 * block_s, a1 - l1 * block_amount
    blocks = Cost(block_amount / block_s / 1e9, 0.0)
    if rest_s <= 1e-3 * t1 or rest_amount <= 0:  # lost in the noise: priced as a block
        return blocks, blocks
    return blocks, Cost(rest_amount / rest_s / 1e9, 0.0)


Probe = tuple[str, int, list[float], list[Callable[[], float]]]  # engine, rows, per model


def _probes(
    models: list[Transformer], fmt: str, tp: int, fast: bool,
    evicts: list[CacheEvictor | None],
) -> Iterator[Probe]:  # fmt: skip
    """The timings of one format and shard: per engine and rows, each model's amount
    (weight bytes a step reads, or prefill FLOPs) and a call timing it once (a decode
    step's median over a few steps, each after its model's ``evicts``; one prefill)."""
    from kiln.deploy.generate_job import GenerateRequest, choose_decoder, weight_bytes_per_token
    from kiln.llm.fast_decoder import FastDecoder
    from kiln.llm.generate import EagerDecoder

    nbytes = [float(weight_bytes_per_token(m)) for m in models]
    for rows in DECODE_ROWS:
        kinds = [("fast", FastDecoder)] if fast and tp == 1 else []
        for kind, make in [*kinds, ("eager", EagerDecoder)]:
            decs = [make(m, rows, 64) for m in models]
            engine = f"fast-{fmt}" if kind == "fast" else shard_engine("eager", tp, fmt)
            steps: list[Callable[[], float]] = [
                partial(step_seconds, d, rows, 6, 1, e) for d, e in zip(decs, evicts, strict=True)
            ]
            yield engine, rows, nbytes, steps
    request = GenerateRequest(checkpoint="", prompt="")
    for rows in PREFILL_ROWS:
        batch, tokens = prefill_shape(rows)
        decs = [choose_decoder(m, request, batch, tokens + 4)[0] for m in models]
        flops = [prefill_flops(rows, *matmul_params(m.cfg)) for m in models]
        timers: list[Callable[[], float]] = [partial(prefill_once, d, rows) for d in decs]
        yield shard_engine("prefill", tp, fmt), rows, flops, timers


def probe_evictors(
    cfg: ModelConfig, probes: list[Transformer], layers: tuple[int, int], tp: int = 1
) -> list[CacheEvictor | None]:  # fmt: skip
    """For each probe, what the whole model streams through the caches between two of
    its steps: the weights of the model's other blocks (all ``tp`` ranks' shards: they
    share this host's caches), read before each timed step (``CacheEvictor``; None when
    the probe is the whole model). Past four times the last-level cache more traffic
    evicts nothing more, so it stops there."""
    from kiln.deploy.generate_job import weight_bytes_per_token

    full, cap = model_bytes(cfg, probes, layers) * tp, 4 * cache_bytes()[2] or 2**28
    out: list[CacheEvictor | None] = []
    for probe in probes:
        rest = full - float(weight_bytes_per_token(probe)) * tp
        out.append(CacheEvictor(min(rest, cap)) if rest > 0 else None)
    return out


def model_bytes(cfg: ModelConfig, probes: list[Transformer], layers: tuple[int, int]) -> float:
    """Weight bytes a decode step of the whole model (``cfg``'s blocks) reads, from the two
    probes' (``layers`` blocks each): the smaller one's, plus a block's for every further
    block."""
    from kiln.deploy.generate_job import weight_bytes_per_token

    small, large = (float(weight_bytes_per_token(m)) for m in probes)
    per_block = (large - small) / max(1, layers[1] - layers[0])
    return small + (cfg.n_layers - layers[0]) * per_block


def prefill_once(decoder: Decoder, rows: int) -> float:
    """Seconds of one prefill of ``rows`` rows (``prefill_shape``) by ``decoder``."""
    prompt = torch.zeros(*prefill_shape(rows), dtype=torch.long)
    t0 = time.perf_counter()
    decoder.prefill(prompt)
    return time.perf_counter() - t0


def build_in_format(shape: ModelConfig, fmt: str) -> Transformer:
    """A random-weight model of ``shape`` stored in ``fmt`` (as a plan's load stores it)."""
    from kiln.deploy.weights import store_in_format
    from kiln.models.transformer import Transformer

    torch.manual_seed(0)
    return store_in_format(Transformer(shape).eval(), fmt)


def head_engine(engine: str) -> str:
    """The table name of what ``engine`` spends outside its blocks (head and the rest)."""
    return f"{engine}+head"


def shard_engine(kind: str, tp: int, fmt: str) -> str:
    """The table name of one-process ``kind`` (``eager``/``prefill``) on a tp shard."""
    return f"{kind}-{fmt}" if tp == 1 else f"{kind}-tp{tp}-{fmt}"


def measure_arch_rates(
    cfg: ModelConfig, threads: int, fast: bool, shards: tuple[int, ...],
    note: Callable[[str], None] = lambda _: None,
) -> dict[str, dict[int, Cost]]:  # fmt: skip
    """Every engine's ``Cost`` on ``cfg``'s block shape at ``threads`` threads: with
    ``fast``, kiln's C++ decode step (``fast-<fmt>``); the eager decode step and the prefill
    of the whole block (``eager-<fmt>``, ``prefill-<fmt>``) and of each tensor-parallel
    degree's shard in ``shards`` (``eager-tp<T>-<fmt>``, ``prefill-tp<T>-<fmt>``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    runs: Timings = {}
    try:
        for fmt in FORMATS:
            note(f"timing {fmt} engines on this model's blocks ({threads} thread(s))")
            for tp in shards:
                counts = probe_layers(cfg)
                shapes = [probe_config(cfg, layers, tp) for layers in counts]
                try:
                    models = [build_in_format(shape, fmt) for shape in shapes]
                except ValueError as err:  # a format this shape cannot take (its group size)
                    note(f"{fmt}: not timed on this model's blocks ({err})")
                    break
                evicts = probe_evictors(cfg, models, counts, tp)
                for engine, rows, amounts, timers in _probes(models, fmt, tp, fast, evicts):
                    # the two models in turn, best of ROUNDS each: a drift of this shared
                    # host then hits both, and their difference is what a block costs
                    best = [float("inf")] * len(timers)
                    for timer in timers:  # first calls allocate (and JIT oneDNN's kernels)
                        timer()
                    for _ in range(ROUNDS):
                        best = [min(b, timer()) for b, timer in zip(best, timers, strict=True)]
                    for layers, amount, t in zip(counts, amounts, best, strict=True):
                        record(runs, engine, rows, layers, amount, t)
                del models
    finally:
        torch.set_num_threads(before)
    out: dict[str, dict[int, Cost]] = {}
    for engine, by in runs.items():
        for rows, points in by.items():
            fitted = split_fit(*points)
            if fitted is not None:
                out.setdefault(engine, {})[rows] = fitted[0]
                out.setdefault(head_engine(engine), {})[rows] = fitted[1]
    return out


def with_layouts(
    table: Rates, arch: Mapping[str, Mapping[int, Cost]]
) -> dict[str, dict[int, Cost]]:
    """``table`` (the calibration's, at one thread count) with ``arch``'s engines in place
    of its one-process ones, and each tensor- / pipeline-parallel layout re-based on the
    architecture: its rank's engine (the shard's eager decode or prefill) plus what the
    layout's fitted fixed cost per block adds over the calibration's one-process engine."""
    out = {engine: dict(by) for engine, by in table.items()}
    out.update({engine: dict(by) for engine, by in arch.items()})
    for engine, by in table.items():
        layout = _parse_layout(engine)
        if layout is None:
            continue
        kind, tp, fmt = layout
        base, own = table.get(f"{kind}-{fmt}", {}), arch.get(shard_engine(kind, tp, fmt), {})
        head = arch.get(head_engine(shard_engine(kind, tp, fmt)), {})
        for rows, cost in by.items():
            if rows in base and rows in own and rows in head:
                added = max(0.0, cost.layer_s - base[rows].layer_s)
                out[engine][rows] = Cost(own[rows].rate, own[rows].layer_s + added)
                out.setdefault(head_engine(engine), {})[rows] = head[rows]
    return out


def _parse_layout(engine: str) -> tuple[str, int, str] | None:
    """(``eager``/``prefill``, tp, format) of a layout engine ``[prefill-]tp<T>-pp<P>-<fmt>``."""
    kind, name = ("prefill", engine[8:]) if engine.startswith("prefill-") else ("eager", engine)
    parts = name.split("-", 2)
    if len(parts) < 3 or not parts[0].startswith("tp") or not parts[1].startswith("pp"):
        return None
    if not parts[0][2:].isdigit() or parts[2] not in FORMATS:
        return None
    return kind, int(parts[0][2:]), parts[2]


def arch_rates_path(cfg: ModelConfig, threads: int) -> str:
    """The cache file of ``cfg``'s engines at ``threads`` threads on this CPU."""
    key = f"{cpu_key()}|{probe_config(cfg, 1)!r}|{torch.__version__}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return str(cache_dir("kernel-rates") / f"arch-v{VERSION}-{digest}-{threads}t.json")


def load_arch_rates(
    cfg: ModelConfig, threads: int, cores: int, note: Callable[[str], None] = lambda _: None
) -> dict[str, dict[int, Cost]]:
    """``cfg``'s engines at ``threads`` threads (cached JSON; measured now when missing):
    the fast step where one process has every core, and the shards of the tensor-parallel
    degrees that ``cores // threads`` ranks can form."""
    path = arch_rates_path(cfg, threads)
    cached = read_table(path)
    if cached is not None:
        return cached
    ranks = max(1, cores // threads)
    shards = tuple(sorted({tp for tp, _ in layouts_of(ranks)}))
    with OtherLoad() as load:
        rates = measure_arch_rates(cfg, threads, fast=ranks == 1, shards=shards, note=note)
    cache_if_quiet(path, rates, load.share, "this model's blocks", note)
    return rates
