"""How fast tensor- and pipeline-parallel ranks sharing this host run, timed as launched.

On a CPU the ranks of a layout are processes of one host. Pricing them from one process's
timings (each rank's share of the work at its thread count, plus collectives timed alone)
misses what dominates: a gloo all-reduce between two ranks costs ~0.4-0.6 ms in a decode
step here (a thread hand-off on each side, with every core busy), two per block, and a
pipeline's stages run one after another, so a rank's cores idle while the other computes.
So each layout's engine is *timed as it runs* — ``kiln.parallel.launch`` starts the ranks,
each builds its part of a random-weight model with ``rank_decoder`` (stage, tensor-parallel
shard) in the plan's format, and decodes — on the same two shapes as the one-process engines
(``kernel_rates.NARROW`` / ``WIDE``), and ``kernel_rates.fit`` solves for a cost per block
and a rate:

* ``tp<T>-pp<P>-<fmt>``: a decode step, 1 and 4 rows; ``amount`` is the bytes of weights the
  step reads along its critical path (every stage in turn, one rank's shard of each, the
  whole head on the last; ``estimate_cpu.decode_ms`` prices the same path);
* ``prefill-tp<T>-pp<P>-<fmt>``: a 64-token prompt, one and four of them; ``amount`` is the
  FLOPs along the same path (the head's for each prompt's last position only).

The last stage's logits are broadcast to every rank once per call; that message grows with
the vocabulary (4096 here, 152k for Qwen2), so it is taken out of the timings with the
``gloo`` cost (``measure_collective``) before the fit, and the planner adds it back for the
model it prices.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from kiln.deploy.kernel_rates import (
    DECODE_ROWS,
    NARROW,
    PREFILL_ROWS,
    WIDE,
    Cost,
    Timings,
    decoder_prefill_seconds,
    fit,
    fit_at_rate,
    matmul_params,
    prefill_flops,
    prefill_shape,
    step_seconds,
)
from kiln.models.config import ModelConfig

STEPS, REPEATS = 6, 3  # decode steps per timing, best of


def layout_engine(tp: int, pp: int, fmt: str, prefill: bool = False) -> str:
    """The rates-table name of a ``tp x pp`` layout's decode (or prefill) engine."""
    return f"{'prefill-' if prefill else ''}tp{tp}-pp{pp}-{fmt}"


def layouts_of(ranks: int) -> list[tuple[int, int]]:
    """The (tp, pp) layouts of ``ranks`` ranks that are timed: a power-of-two TP degree."""
    return [(tp, ranks // tp) for tp in (1, 2, 4, 8) if tp <= ranks and ranks % tp == 0]


Shapes = tuple[tuple[str, ModelConfig], ...]  # the calibration models, by name
SHAPES: Shapes = (("narrow", NARROW), ("wide", WIDE))


def _rank_timings(
    rank: int, world: int, tp: int, pp: int, formats: Sequence[str], shapes: Shapes
) -> dict[str, list[tuple[str, int, int, float, int]]]:
    """One rank's timings: per format, (shape, rows, kind, seconds, weight bytes it reads),
    kind 0 for a decode step and 1 for a prefill. Every rank runs the same calls."""
    from kiln.deploy.weights import store_in_format
    from kiln.models.transformer import Transformer
    from kiln.parallel.mesh import Mesh, rank_decoder
    from kiln.parallel.pp import PipelineDecoder

    mesh = Mesh.create(tp, pp)
    out: dict[str, list[tuple[str, int, int, float, int]]] = {}
    for fmt in formats:
        rows_out = out.setdefault(fmt, [])
        for name, shape in shapes:
            torch.manual_seed(0)
            built = rank_decoder(Transformer(shape).eval(), mesh, 1, shape.max_positions)
            stage = built.stage
            store_in_format(stage.model, fmt)  # after sharding, as a rank's load applies it
            nbytes = stage.weight_bytes()
            for rows in DECODE_ROWS:
                dec = PipelineDecoder(stage, mesh.pipe_ranks(), rows, 64)
                t = step_seconds(dec, rows, STEPS, REPEATS)
                rows_out.append((name, rows, 0, t, nbytes))
            for rows in PREFILL_ROWS:
                batch, tokens = prefill_shape(rows)
                dec = PipelineDecoder(stage, mesh.pipe_ranks(), batch, tokens + 4)
                best = decoder_prefill_seconds(dec, rows, REPEATS)
                rows_out.append((name, rows, 1, best, nbytes))
            del built, stage, dec
    return out


def measure_layouts(
    ranks: int,
    formats: Sequence[str],
    gloo: Cost,
    note: Callable[[str], None] = lambda _: None,
    shapes: Shapes = SHAPES,
    rounds: int = 2,
    one_process: Mapping[str, Mapping[int, Cost]] | None = None,
) -> dict[str, dict[int, Cost]]:
    """Every ``ranks``-rank layout's decode and prefill ``Cost`` per rows and format (a few
    minutes: one launch per layout and round, the layouts in turn; each point keeps its
    fastest round, as ``kernel_rates.measure_rates`` does), fitted through the two
    ``shapes``. With ``one_process`` (the one-process table at the ranks' thread count), a
    layout's rate is that of the one-process eager module (``eager-<fmt>``: a rank streams
    its shard as that module streams its weights) or prefill (``prefill-<fmt>``) at the same
    rows, and only the fixed cost per block is fitted (``fit_at_rate``): the free two-point
    fit of a layout dominated by its per-block messages moved its rate by 30% between two
    calibrations, and a 28-layer model's prediction by as much."""
    from kiln.parallel.launch import launch

    params = {name: matmul_params(cfg) for name, cfg in shapes}
    layers_of = {name: cfg.n_layers for name, cfg in shapes}
    vocab_of = {name: cfg.vocab_size for name, cfg in shapes}
    out: dict[str, dict[int, Cost]] = {}
    layouts = [(tp, pp) for tp, pp in layouts_of(ranks) if tp * pp >= 2]
    launched: dict[tuple[int, int], list[list[Any]]] = {lay: [] for lay in layouts}
    for r in range(rounds):
        for tp, pp in layouts:
            note(f"timing {ranks} ranks as tp {tp} x pp {pp} (round {r + 1} of {rounds})")
            args = (tp, pp, tuple(formats), shapes)
            launched[(tp, pp)].append(launch(_rank_timings, ranks, args, timeout_s=600.0))
    for (tp, pp), rounds_results in launched.items():
        results = rounds_results[0]
        for fmt in formats:
            runs: Timings = {}
            for i, (name, rows, kind, _, _) in enumerate(results[0][fmt]):
                # the slowest rank, in the fastest round
                seconds = min(max(r[fmt][i][3] for r in got) for got in rounds_results)
                layers = layers_of[name]
                batch = prefill_shape(rows)[0] if kind else rows
                # (never below half the timing: a noisy collective fit must not swamp it)
                seconds = max(seconds - logits_broadcast_s(gloo, batch, vocab_of[name]),
                              seconds / 2)  # fmt: skip
                if kind == 0:  # bytes along the path: each stage's widest rank, in turn
                    per_stage = [0] * pp
                    for rank, r in enumerate(results):
                        per_stage[rank // tp] = max(per_stage[rank // tp], r[fmt][i][4])
                    amount, engine = float(sum(per_stage)), layout_engine(tp, pp, fmt)
                else:
                    blocks, head = params[name]
                    amount = prefill_flops(rows, blocks // tp, head)
                    engine = layout_engine(tp, pp, fmt, prefill=True)
                runs.setdefault(engine, {}).setdefault(rows, []).append((layers, amount, seconds))
            for engine, by_rows in runs.items():
                base = f"{'prefill' if engine.startswith('prefill-') else 'eager'}-{fmt}"
                known = (one_process or {}).get(base, {})
                out[engine] = {
                    rows: fit_at_rate(points, known[rows].rate) if rows in known else fit(*points)
                    for rows, points in by_rows.items()
                }
    return out


def logits_broadcast_s(gloo: Cost | None, batch: int, vocab: int) -> float:
    """The last stage's fp32 logits (batch, vocab) broadcast to every rank."""
    return gloo.seconds(batch * vocab * 4) if gloo is not None else 0.0


def _collective_rank(
    rank: int, world: int, sizes: tuple[int, ...], repeats: int
) -> dict[int, float]:
    """One rank's median all-reduce time per message size (bytes), back to back as a
    decode step issues them (after a warm-up)."""
    import torch.distributed as dist

    out = {}
    for nbytes in sizes:
        buf = torch.zeros(nbytes // 4)
        for _ in range(10):
            dist.all_reduce(buf)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            times.append(time.perf_counter() - t0)
        out[nbytes] = statistics.median(times)
    return out


def measure_collective(world: int = 2, sizes: tuple[int, int] = (4096, 1 << 20)) -> Cost:
    """Latency and bandwidth of a gloo all-reduce between ``world`` ranks on this host (the
    slower rank's median at a small and a large message, ``fit`` through both). Broadcasts
    and sends of a message cost at most as much, and the planner prices them so."""
    from kiln.parallel.launch import launch

    results = launch(_collective_rank, world, (sizes, 60), timeout_s=60.0)
    t = [max(r[n] for r in results) for n in sizes]
    return fit((1, sizes[0], t[0]), (1, sizes[1], t[1]))
