"""How fast kiln's engines run on this CPU, per weight format: the planner's measured costs.

A datasheet bandwidth says little about a decode step: each kernel family (fp32 and 16-bit
GEMV, INT8 and INT4 weight-only) reaches its own share of it, the share moves with the
number of activation rows, and every block also pays a fixed cost (dispatch, norms,
rotary embedding, attention at a short context) that a narrow model feels more than a wide
one. So each engine's time is modelled as

    t = layers x layer_s + amount / rate

(``amount``: weight bytes for a decode step, dense FLOPs for a prefill) and both terms are
*measured*: the engine is timed on two random-weight models of the same format, one of many
narrow blocks (SmolLM2's shape) and one of a few wide ones (a 1.5B model's), and the two
equations are solved for ``layer_s`` and ``rate`` (``fit``). Engines (``Cost`` per engine
and rows):

* ``fast-<fmt>``: kiln's C++ decode step (``FastDecoder``), 1 and 4 rows;
* ``eager-<fmt>``: the eager module's decode step, 1 and 4 rows (the engine of every
  tensor- / pipeline-parallel rank);
* ``offload-<fmt>``: the eager module with its blocks streamed from a disk store
  (``kiln.llm.offload``), 1 and 4 rows;
* ``prefill-<fmt>``: a prompt through the eager module, 64 and 256 rows, in GFLOP/s (the
  blocks' FLOPs for every row, the head's for each prompt's last position);
* ``gloo``: a collective between two ranks of this host (all-reduce, broadcast, send),
  ``rate`` in GB/s and ``layer_s`` the per-message latency;
* ``tp<T>-pp<P>-<fmt>`` and ``prefill-tp<T>-pp<P>-<fmt>``: the ranks of a layout sharing
  this host, timed as launched (``rank_rates``), in the table of the thread count each
  rank runs with.

``rates_table.load_rates(threads)`` caches the table per CPU (model name and ISA flags) and
thread count (a tensor-parallel rank runs with ``cores // ranks`` threads, so its table is
another); ``kiln calibrate`` refreshes it.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from kiln.llm.generate import Decoder
from kiln.models.config import ModelConfig
from kiln.models.transformer import Transformer

FORMATS = ("fp32", "bf16", "int8", "int4-g32", "int4-g64", "int4-g128")
DECODE_ROWS = (1, 4)
PREFILL_ROWS = (64, 256)  # one 64-token prompt, and four
VERSION = 4  # of the cached table (layout, or how it is fitted); an older file is measured again

# The two calibration shapes: many narrow blocks (SmolLM2's), a few wide ones (a 1.5B
# model's), the same small vocabulary; both larger than the last-level cache in every format.
NARROW = ModelConfig(family="llama", vocab_size=4096, hidden_size=576, n_layers=24, n_heads=9,
                     n_kv_heads=3, head_dim=64, intermediate_size=1536, max_positions=320)  # fmt: skip
WIDE = ModelConfig(family="llama", vocab_size=4096, hidden_size=1536, n_layers=4, n_heads=12,
                   n_kv_heads=2, head_dim=128, intermediate_size=6144, max_positions=320)  # fmt: skip


@dataclass(frozen=True)
class Cost:
    """An engine's measured cost: ``rate`` per second (GB/s of weights for a step, GFLOP/s
    for a prefill, GB/s of message for a collective) and a fixed ``layer_s`` per block
    (per message for a collective)."""

    rate: float
    layer_s: float

    def seconds(self, amount: float, layers: int = 1) -> float:
        """Time for ``amount`` (bytes or FLOPs) over ``layers`` blocks."""
        return layers * self.layer_s + amount / (self.rate * 1e9)


Rates = Mapping[str, Mapping[int, Cost]]  # engine -> rows -> cost


def fit(narrow: tuple[int, float, float], wide: tuple[int, float, float]) -> Cost:
    """Solve ``t = layers x layer_s + amount / rate`` through two (layers, amount, seconds)
    timings. Timing noise can make the fixed term come out negative (the narrow model ran
    relatively fast): then it is 0 and the rate is the two runs' combined amount over time."""
    (l1, a1, t1), (l2, a2, t2) = narrow, wide
    det = l1 * a2 - l2 * a1
    layer_s = (t1 * a2 - t2 * a1) / det if det else 0.0
    per_unit = (t2 - l2 * layer_s) / a2
    if layer_s < 0 or per_unit <= 0:
        layer_s, per_unit = 0.0, (t1 + t2) / (a1 + a2)
    return Cost(1 / per_unit / 1e9, layer_s)


def fit_at_rate(points: Sequence[tuple[int, float, float]], rate: float) -> Cost:
    """``t = layers x layer_s + amount / rate`` through (layers, amount, seconds) timings
    with the rate known (per second, as ``Cost.rate``): the least-squares fixed cost per
    block, at least 0. Two shapes pin a rate and a fixed cost only as well as their timings
    agree; when the fixed cost dominates both (ranks exchanging messages every block) a few
    percent of noise moves the fitted rate by tens of percent, and the model it prices
    streams far more bytes per block than the shapes did."""
    per_unit = 1 / (rate * 1e9)
    num = sum(layers * (t - amount * per_unit) for layers, amount, t in points)
    den = sum(layers * layers for layers, _, _ in points)
    return Cost(rate, max(0.0, num / den))


def _model(cfg: ModelConfig, fmt: str) -> Transformer:
    """A random-weight transformer of ``shape``, blocks stored in ``fmt`` as a plan stores
    them (``weights.store_in_format``: kiln's kernels, an INT8 head when compressed)."""
    from kiln.deploy.weights import store_in_format

    torch.manual_seed(0)
    return store_in_format(Transformer(cfg).eval(), fmt)


def matmul_params(cfg: ModelConfig) -> tuple[int, int]:
    """Parameters a prefill row multiplies by: the blocks', and the head's (not the
    embedding lookup)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    blocks = sum(p.numel() for p in model.layers.parameters())
    return blocks, sum(p.numel() for p in model.lm_head.parameters())


def prefill_flops(rows: int, blocks: int, head: int) -> float:
    """FLOPs of a prefill of ``rows`` rows in 64-token prompts: every row through the
    blocks, each prompt's last row through the head (all a generation needs)."""
    return 2.0 * (rows * blocks + prefill_shape(rows)[0] * head)


def step_seconds(
    decoder: Decoder, rows: int, steps: int, repeats: int, evict: Callable[[], None] | None = None
) -> float:
    """Best over ``repeats`` of the median of ``steps`` decode steps after a short prefill;
    ``evict`` (untimed) before each step: the step then reads its weights from memory, as a
    model too large for the caches does (``CacheEvictor``)."""
    tok = torch.zeros(rows, dtype=torch.long)
    decoder.prefill(torch.zeros(rows, 4, dtype=torch.long))
    best = float("inf")
    for _ in range(repeats):
        times = []
        for pos in range(4, 4 + steps):
            if evict is not None:
                evict()
            t0 = time.perf_counter()
            decoder.step(tok, pos)
            times.append(time.perf_counter() - t0)
        best = min(best, sorted(times)[len(times) // 2])
    return best


class CacheEvictor:
    """Reads a buffer of ``nbytes`` (at most ``MAX_BYTES``) when called: the traffic that
    passes through the caches between two steps of a probe inside the whole model (its
    other blocks' weights), so the probe's weights are as cached as a block's in the whole
    model. A probe of a few blocks fits a 32 MB L3 that the whole model overflows: timed
    warm, its blocks stream from the cache (SmolLM2's INT4 blocks came out 41% slow, by
    difference against a one-block probe that ran from L3, on an AMD EPYC); timed after
    evicting everything, they stream from memory every step where the whole model keeps
    part of itself cached (15-33% slow). The hardware's own replacement policy decides
    what survives the traffic, as it does for the model."""

    MAX_BYTES = 512 * 2**20

    def __init__(self, nbytes: float) -> None:
        n = int(min(nbytes, self.MAX_BYTES)) // 4
        self.buffer = torch.ones(max(n, 1))  # (n,) fp32

    def __call__(self) -> None:
        self.buffer.sum()


def prefill_seconds(model: Transformer, rows: int, repeats: int = 3) -> float:
    """Best time of a prefill of ``rows`` prompt tokens (batches of 64-token prompts) through
    the engine ``kiln generate`` prefills with, after one untimed run."""
    from kiln.deploy.generate_job import GenerateRequest, choose_decoder

    batch, tokens = prefill_shape(rows)
    dec, _ = choose_decoder(model, GenerateRequest(checkpoint="", prompt=""), batch, tokens + 4)
    return decoder_prefill_seconds(dec, rows, repeats)


def prefill_shape(rows: int) -> tuple[int, int]:
    """(prompts, tokens each) of a calibration prefill of ``rows`` rows: 64-token prompts."""
    return max(1, rows // 64), min(rows, 64)


def decoder_prefill_seconds(decoder: Decoder, rows: int, repeats: int) -> float:
    """Best time of ``decoder``'s prefill of ``rows`` rows (``prefill_shape``; the decoder
    is made for that batch) over ``repeats``, after one untimed call (it allocates)."""
    prompt = torch.zeros(*prefill_shape(rows), dtype=torch.long)
    decoder.prefill(prompt)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        decoder.prefill(prompt)
        best = min(best, time.perf_counter() - t0)
    return best


Timings = dict[str, dict[int, list[tuple[int, float, float]]]]  # engine -> rows -> points


def record(
    runs: Timings, engine: str, rows: int, layers: int, amount: float, seconds: float
) -> None:
    """Add a timing point; one already taken (same blocks and amount: another round) keeps
    the faster of the two."""
    points = runs.setdefault(engine, {}).setdefault(rows, [])
    for i, (n, a, s) in enumerate(points):
        if (n, a) == (layers, amount):
            points[i] = (n, a, min(s, seconds))
            return
    points.append((layers, amount, seconds))


def measure_rates(
    threads: int = 2, note: Callable[[str], None] = lambda _: None, rounds: int = 2
) -> dict[str, dict[int, Cost]]:
    """Every engine's ``Cost`` per rows on this CPU at ``threads`` threads (a few minutes).
    Every format is timed ``rounds`` times, the formats in turn, and each point keeps its
    fastest round: co-tenants of a shared host slow memory-bound runs by up to ~30% for
    minutes at a time, and a fit through two points amplifies a slow one."""
    from kiln.deploy.generate_job import weight_bytes_per_token
    from kiln.llm.fast_decoder import FastDecoder
    from kiln.llm.generate import EagerDecoder
    from kiln.llm.offload import offload_

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    out: dict[str, dict[int, Cost]] = {}
    shapes = (NARROW, WIDE)
    params = [matmul_params(s) for s in shapes]  # (blocks, head)
    runs: Timings = {}
    timed = partial(record, runs)
    try:
        for fmt in [f for _ in range(rounds) for f in FORMATS]:
            note(f"timing the {fmt} engines")
            for shape, (blocks, head) in zip(shapes, params, strict=True):
                model, layers = _model(shape, fmt), shape.n_layers
                nbytes = weight_bytes_per_token(model)
                for rows in DECODE_ROWS:
                    fast = step_seconds(FastDecoder(model, rows, 64), rows, 12, 5)
                    timed(f"fast-{fmt}", rows, layers, nbytes, fast)
                    eager = step_seconds(EagerDecoder(model, rows, 64), rows, 6, 3)
                    timed(f"eager-{fmt}", rows, layers, nbytes, eager)
                for rows in PREFILL_ROWS:
                    timed(
                        f"prefill-{fmt}",
                        rows,
                        layers,
                        prefill_flops(rows, blocks, head),
                        prefill_seconds(model, rows),
                    )
                with tempfile.TemporaryDirectory(prefix="kiln-rates-") as store:
                    offload_(model, Path(store), tier="disk")
                    for rows in DECODE_ROWS:
                        streamed = step_seconds(EagerDecoder(model, rows, 64), rows, 4, 2)
                        timed(f"offload-{fmt}", rows, layers, nbytes, streamed)
                    del model
        for engine, by_rows in runs.items():
            out[engine] = {rows: fit(*pair) for rows, pair in by_rows.items()}
    finally:
        torch.set_num_threads(before)
    return out


def rate_at(rates: Rates, engine: str, rows: int) -> Cost | None:
    """``engine``'s cost at ``rows`` activation rows: the one measured at the nearest row
    count not above it (more rows only raise the rate of a streaming kernel), else the
    smallest measured."""
    by = rates.get(engine)
    if not by:
        return None
    fits = [r for r in by if r <= rows] or [min(by)]
    return by[max(fits)]
