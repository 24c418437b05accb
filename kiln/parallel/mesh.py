"""Generation over tp x pp ranks: the rank layout, one rank's part, the whole job.

Layout: ``world = tp * pp``; global rank r is tensor-parallel rank ``r % tp`` of pipeline
stage ``r // tp``, so a stage's tensor-parallel group is consecutive ranks (one machine
under torchrun) and pipeline j is ranks j, j + tp, j + 2 tp, ... Each rank builds the full
model with ``model_factory`` (e.g. a loader call), trims it to its stage, shards the stage
across its tensor-parallel group, and runs the one generation loop
(``kiln.llm.generate.generate``) over a ``PipelineDecoder``, greedy or sampled::

    gen = run_parallel(partial(load, path), prompt_ids, 32, tp=2, pp=2,
                       sampling=Sampling(temperature=0.8, seed=0))
    gen.tokens  # (B, 32) new tokens, as one process with the same seed samples them
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from kiln.llm.generate import Generation, Sampling, generate
from kiln.models.transformer import Transformer
from kiln.parallel.launch import launch, progress
from kiln.parallel.pp import PipelineDecoder, PipeRanks, Stage, even_split, split_stages
from kiln.parallel.tp import shard_tensor_parallel

ModelFactory = Callable[[], Transformer]
GREEDY = Sampling()


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


def rank_decoder(
    model: Transformer,
    mesh: Mesh,
    batch: int,
    max_len: int,
    split: Sequence[int] | None = None,
    microbatches: int = 1,
    device: torch.device | None = None,
) -> PipelineDecoder:
    """This rank's part of ``model`` (the full model, consumed) as a ``Decoder``: its
    stage's layers, its tensor-parallel shard, on ``device`` (None: where the model is).
    ``split``: layers per stage (default: even)."""
    n = model.cfg.n_layers
    ranges = split_stages(n, split if split is not None else even_split(n, mesh.pp))
    if len(ranges) != mesh.pp:
        raise ValueError(f"split {list(split or [])} has {len(ranges)} stages, pp is {mesh.pp}")
    first, last = mesh.stage == 0, mesh.stage == mesh.pp - 1
    with torch.no_grad():
        stage = Stage(model, ranges[mesh.stage], first, last)
        if mesh.tp > 1:
            shard_tensor_parallel(stage.model, mesh.tp_rank, mesh.tp, mesh.tp_group)
        if device is not None:
            stage.to(device)  # only this rank's shard travels
        progress()
    return PipelineDecoder(stage, mesh.pipe_ranks(), batch, max_len, microbatches)


def rank_generate(
    model: Transformer,
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
    batch, max_len = prompt.shape[0], prompt.shape[1] + max_new_tokens
    decoder = rank_decoder(model, mesh, batch, max_len, split, microbatches, device)
    return generate(decoder, prompt, max_new_tokens, sampling, stop_ids, keep_logits=keep_logits)


def as_batch(prompt_ids: Tensor | Sequence[int]) -> Tensor:
    """Prompt token ids as a (B, T) int64 tensor (a 1-D prompt is one sequence)."""
    ids = torch.as_tensor(prompt_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.numel() == 0:
        raise ValueError(f"prompt_ids must be (T,) or (B, T) and non-empty, got {tuple(ids.shape)}")
    return ids


def _rank_main(
    rank: int, world: int, model_factory: ModelFactory, prompt: Tensor, max_new_tokens: int,
    tp: int, pp: int, split: Sequence[int] | None, microbatches: int, sampling: Sampling,
    stop_ids: tuple[int, ...], keep_logits: bool,
) -> Generation:  # fmt: skip
    mesh = Mesh.create(tp, pp)
    model = model_factory()
    progress()
    # NCCL moves CUDA tensors only: each rank runs on the GPU launch() bound it to.
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else None
    return rank_generate(
        model, prompt, max_new_tokens, mesh, split, microbatches, device, sampling, stop_ids,
        keep_logits,
    )  # fmt: skip


def run_parallel(
    model_factory: ModelFactory,
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
    """Generation on ``tp * pp`` ranks started by ``launch`` (``backend="nccl"``: one GPU
    per rank), greedy or sampled as ``sampling`` says: the ``Generation`` of the last
    stage's first rank (every rank has the same tokens; timings are that rank's).
    ``timeout_s``: longest stretch without progress (loading, or one decode step)."""
    prompt = as_batch(prompt_ids)
    args = (model_factory, prompt, max_new_tokens, tp, pp, split, microbatches, sampling,
            tuple(stop_ids), keep_logits)  # fmt: skip
    results = launch(_rank_main, tp * pp, args, timeout_s=timeout_s, backend=backend)
    out: Generation = results[(pp - 1) * tp]
    return out
