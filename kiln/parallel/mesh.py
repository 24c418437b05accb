"""Generation over tp x pp ranks: the rank layout, one rank's part, the whole job.

Layout: ``world = tp * pp``; global rank r is tensor-parallel rank ``r % tp`` of pipeline
stage ``r // tp``, so a stage's tensor-parallel group is consecutive ranks (one machine
under torchrun) and pipeline j is ranks j, j + tp, j + 2 tp, ... Each rank keeps its
stage's layers, sharded across its tensor-parallel group, and runs the one generation
loop (``kiln.llm.generate.generate``) over a ``PipelineDecoder``, greedy or sampled.

Where a rank's part comes from:

* a ``PartLoader`` (what ``kiln generate`` uses): the rank reads only its part of the
  checkpoint — its stage's blocks, its rows / columns of each block linear (``RankPart``,
  passed to ``kiln.models.load``) — so no rank ever holds the whole model;
* a ``ModelFactory`` (a model in memory, e.g. tests' random models): each rank builds the
  full model, trims it to its stage and shards it (``Stage``, ``shard_tensor_parallel``).

::

    # load(part_of): open the checkpoint, part = part_of(config), load_model(..., layers=
    # part.layers, shard=part.shard, on_block=part.on_block); e.g. generate_job.load_rank_part
    gen = run_parallel(PartLoader(partial(load, path)), prompt_ids, 32, tp=2, pp=2,
                       sampling=Sampling(temperature=0.8, seed=0))
    gen.tokens  # (B, 32) new tokens, as one process with the same seed samples them

``run_parallel_job`` also reports each rank's weight bytes and peak resident memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor

from kiln.core.memory import peak_rss_bytes
from kiln.llm.generate import Generation, Sampling, generate
from kiln.models.config import ModelConfig
from kiln.models.parts import BlockHook, LinearSlice
from kiln.models.transformer import Block, Transformer
from kiln.parallel.launch import launch, progress
from kiln.parallel.pp import PipelineDecoder, PipeRanks, Stage, even_split, split_stages
from kiln.parallel.tp import ProcessGroup, block_slices, finish_block, shard_tensor_parallel

ModelFactory = Callable[[], Transformer]
GREEDY = Sampling()


@dataclass(frozen=True)
class RankPart:
    """What one rank holds of a model with a given config: its pipeline stage's blocks
    (``layers``; the first stage also the embedding, the last the final norm and head),
    with tensor parallelism its slice of every block linear (``shard``) and the surgery
    that makes a block loaded that way run sharded (``on_block``), and the ``device`` it
    computes on. Handed to ``kiln.models.load.load_model`` / ``Checkpoint.load`` as they
    are, nothing else of the checkpoint is read."""

    layers: range
    first: bool
    last: bool
    shard: dict[str, LinearSlice] | None  # None: whole blocks (tp = 1)
    on_block: BlockHook | None
    device: torch.device


PartOf = Callable[[ModelConfig], RankPart]


@dataclass(frozen=True)
class PartLoader:
    """A model source that reads only a rank's part: ``load(part_of)`` opens the checkpoint,
    asks ``part_of(config)`` which ``RankPart`` this rank holds and loads just that
    (``load_model(..., layers=, shard=, on_block=)``), returning a model whose other
    blocks stay on the meta device. It travels to the ranks by pickle: ``load`` must be a
    module-level function or a ``functools.partial`` of one."""

    load: Callable[[PartOf], Transformer]


ModelSource = ModelFactory | PartLoader


@dataclass(frozen=True)
class Mesh:
    """Where global ``rank`` sits in a tp x pp job, and its process groups (None for a
    group of one)."""

    tp: int
    pp: int
    rank: int
    tp_group: dist.ProcessGroup | None
    pp_group: dist.ProcessGroup | None

    @property
    def stage(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    def global_rank(self, stage: int, tp_rank: int) -> int:
        return stage * self.tp + tp_rank

    def pipe_ranks(self) -> PipeRanks:
        """The ranks of this rank's pipeline it receives from and sends to, and the rank
        whose logits all ranks take (tensor-parallel rank 0 of the last stage)."""
        s, j = self.stage, self.tp_rank
        return PipeRanks(
            prev=self.global_rank(s - 1, j) if s > 0 else None,
            next=self.global_rank(s + 1, j) if s < self.pp - 1 else None,
            source=self.global_rank(self.pp - 1, 0),
        )

    @classmethod
    def create(cls, tp: int, pp: int) -> Mesh:
        """This rank's mesh; every rank of the default group must call it (each group is
        created collectively, in the same order everywhere)."""
        world, rank = dist.get_world_size(), dist.get_rank()
        if tp < 1 or pp < 1 or tp * pp != world:
            raise ValueError(f"tp={tp} x pp={pp} does not match the {world} ranks")
        tp_group = pp_group = None
        for s in range(pp):
            ranks = [s * tp + j for j in range(tp)]
            group = dist.new_group(ranks) if tp > 1 else None
            if rank in ranks:
                tp_group = group
        for j in range(tp):
            ranks = [s * tp + j for s in range(pp)]
            group = dist.new_group(ranks) if pp > 1 else None
            if rank in ranks:
                pp_group = group
        return cls(tp, pp, rank, tp_group, pp_group)

    def part(
        self,
        cfg: ModelConfig,
        split: Sequence[int] | None = None,
        device: torch.device | None = None,
    ) -> RankPart:
        """This rank's ``RankPart`` of a model with config ``cfg``; ``split``: layers per
        stage (default: even); ``device``: where it computes (None: the CPU)."""
        n = cfg.n_layers
        ranges = split_stages(n, split if split is not None else even_split(n, self.pp))
        if len(ranges) != self.pp:
            raise ValueError(f"split {list(split or [])} has {len(ranges)} stages, pp is {self.pp}")
        shard, hook = None, None
        if self.tp > 1:
            shard, hook = block_slices(cfg, self.tp_rank, self.tp), _Finish(self.tp_group)
        return RankPart(
            ranges[self.stage], self.stage == 0, self.stage == self.pp - 1, shard, hook,
            device if device is not None else torch.device("cpu"),
        )  # fmt: skip


@dataclass(frozen=True)
class _Finish:
    """``tp.finish_block`` as a loader's per-block hook, for one tensor-parallel group."""

    group: ProcessGroup | None

    def __call__(self, index: int, block: Block) -> None:
        finish_block(block, self.group)


def rank_decoder(
    model: Transformer | PartLoader,
    mesh: Mesh,
    batch: int,
    max_len: int,
    split: Sequence[int] | None = None,
    microbatches: int = 1,
    device: torch.device | None = None,
) -> PipelineDecoder:
    """This rank's part of ``model`` as a ``Decoder``: its stage's layers, its
    tensor-parallel shard, on ``device`` (None: where the model is). ``model``: the full
    model (consumed: trimmed and sharded here), or a ``PartLoader`` that reads only this
    rank's part. ``split``: layers per stage (default: even)."""
    with torch.no_grad():
        if isinstance(model, PartLoader):
            loaded = model.load(partial(mesh.part, split=split, device=device))
            part = mesh.part(loaded.cfg, split, device)
            stage = Stage(loaded, part.layers, part.first, part.last)  # already sharded
        else:
            part = mesh.part(model.cfg, split, device)
            stage = Stage(model, part.layers, part.first, part.last)
            if mesh.tp > 1:
                shard_tensor_parallel(stage.model, mesh.tp_rank, mesh.tp, mesh.tp_group)
        if device is not None:
            stage.to(device)  # only this rank's shard travels
        progress()
    return PipelineDecoder(stage, mesh.pipe_ranks(), batch, max_len, microbatches)


def rank_generate(
    model: Transformer | PartLoader,
    prompt: Tensor,
    max_new_tokens: int,
    mesh: Mesh,
    split: Sequence[int] | None = None,
    microbatches: int = 1,
    device: torch.device | None = None,
    sampling: Sampling = GREEDY,
    stop_ids: tuple[int, ...] = (),
    keep_logits: bool = False,
) -> Generation:
    """This rank's part of generation (``rank_decoder``), decoded as ``sampling`` says.
    Every rank returns the same tokens."""
    return _rank_run(
        model, prompt, max_new_tokens, mesh, split, microbatches, device, sampling, stop_ids,
        keep_logits, time.perf_counter(),
    )[0]  # fmt: skip


@dataclass(frozen=True)
class RankReport:
    """What one rank of a job held: its place, how long it took to load its part, the
    bytes of weights its decode step reads (``Stage.weight_bytes``) and its peak resident
    memory (``VmHWM``, loading included; None without Linux /proc)."""

    rank: int
    stage: int
    tp_rank: int
    load_s: float
    weight_bytes: int
    peak_rss_bytes: int | None


@dataclass(frozen=True)
class ParallelRun:
    """A parallel generation: the last stage's first rank's ``Generation`` (every rank has
    the same tokens; timings are that rank's) and every rank's report, in rank order."""

    generation: Generation
    ranks: list[RankReport]


def _rank_run(
    model: Transformer | PartLoader, prompt: Tensor, max_new_tokens: int, mesh: Mesh,
    split: Sequence[int] | None, microbatches: int, device: torch.device | None,
    sampling: Sampling, stop_ids: tuple[int, ...], keep_logits: bool, started: float,
) -> tuple[Generation, RankReport]:  # fmt: skip
    """Generation and this rank's report; ``started``: when its loading began."""
    batch, max_len = prompt.shape[0], prompt.shape[1] + max_new_tokens
    decoder = rank_decoder(model, mesh, batch, max_len, split, microbatches, device)
    load_s = time.perf_counter() - started
    gen = generate(decoder, prompt, max_new_tokens, sampling, stop_ids, keep_logits=keep_logits)
    report = RankReport(
        mesh.rank, mesh.stage, mesh.tp_rank, load_s, decoder.stage.weight_bytes(),
        peak_rss_bytes(),
    )  # fmt: skip
    return gen, report


def as_batch(prompt_ids: Tensor | Sequence[int]) -> Tensor:
    """Prompt token ids as a (B, T) int64 tensor (a 1-D prompt is one sequence)."""
    ids = torch.as_tensor(prompt_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.numel() == 0:
        raise ValueError(f"prompt_ids must be (T,) or (B, T) and non-empty, got {tuple(ids.shape)}")
    return ids


def _rank_main(
    rank: int, world: int, source: ModelSource, prompt: Tensor, max_new_tokens: int,
    tp: int, pp: int, split: Sequence[int] | None, microbatches: int, sampling: Sampling,
    stop_ids: tuple[int, ...], keep_logits: bool,
) -> tuple[Generation, RankReport]:  # fmt: skip
    mesh = Mesh.create(tp, pp)
    started = time.perf_counter()
    model = source if isinstance(source, PartLoader) else source()
    progress()
    # NCCL moves CUDA tensors only: each rank runs on the GPU launch() bound it to.
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else None
    return _rank_run(
        model, prompt, max_new_tokens, mesh, split, microbatches, device, sampling, stop_ids,
        keep_logits, started,
    )  # fmt: skip


def run_parallel_job(
    source: ModelSource,
    prompt_ids: Tensor | Sequence[int],
    max_new_tokens: int,
    tp: int = 1,
    pp: int = 1,
    split: Sequence[int] | None = None,
    microbatches: int = 1,
    timeout_s: float = 60.0,
    backend: str = "gloo",
    sampling: Sampling = GREEDY,
    stop_ids: tuple[int, ...] = (),
    keep_logits: bool = False,
) -> ParallelRun:
    """Generation on ``tp * pp`` ranks started by ``launch`` (``backend="nccl"``: one GPU
    per rank), greedy or sampled as ``sampling`` says, each rank's part from ``source``
    (a ``PartLoader`` reading only it, or a factory of the full model): the generation and
    every rank's report. ``timeout_s``: longest stretch without progress (loading, or one
    decode step)."""
    prompt = as_batch(prompt_ids)
    args = (source, prompt, max_new_tokens, tp, pp, split, microbatches, sampling,
            tuple(stop_ids), keep_logits)  # fmt: skip
    results = launch(_rank_main, tp * pp, args, timeout_s=timeout_s, backend=backend)
    return ParallelRun(results[(pp - 1) * tp][0], [report for _, report in results])


def run_parallel(
    source: ModelSource,
    prompt_ids: Tensor | Sequence[int],
    max_new_tokens: int,
    tp: int = 1,
    pp: int = 1,
    split: Sequence[int] | None = None,
    microbatches: int = 1,
    timeout_s: float = 60.0,
    backend: str = "gloo",
    sampling: Sampling = GREEDY,
    stop_ids: tuple[int, ...] = (),
    keep_logits: bool = False,
) -> Generation:
    """``run_parallel_job``'s generation: that of the last stage's first rank (every rank
    has the same tokens; timings are that rank's)."""
    return run_parallel_job(
        source, prompt_ids, max_new_tokens, tp, pp, split, microbatches, timeout_s, backend,
        sampling, stop_ids, keep_logits,
    ).generation  # fmt: skip
