"""Rank functions the launch tests run (module level: ranks import them by name)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from kiln.llm.generate import Generation, Sampling
from kiln.models.load import open_checkpoint
from kiln.models.transformer import Transformer
from kiln.parallel import Mesh, progress, rank_generate
from kiln.parallel.mesh import PartOf
from tests.parallel.models import factory


def report(rank: int, world: int, x: float) -> dict[str, object]:
    """Sum of (rank + x) over ranks, and what this rank's environment looked like."""
    t = torch.tensor([rank + x])
    dist.all_reduce(t)
    env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    return {"sum": t, "threads": torch.get_num_threads(), "env": env, "pid": os.getpid()}


def _steps(n: int) -> None:
    for _ in range(n):
        t = torch.ones(1)
        dist.all_reduce(t)
        progress()


def raise_on_rank_1(rank: int, world: int) -> None:
    _steps(2)
    if rank == 1:
        raise ValueError("rank 1 refuses to go on")
    _steps(100)  # rank 0 waits in a collective that can never finish


def sigkill_rank_1(rank: int, world: int, pid_dir: str) -> None:
    """Every rank starts a child (same process group) and records both pids; rank 1
    then dies by SIGKILL mid-run while rank 0 waits for it."""
    child = subprocess.Popen(["sleep", "300"])
    Path(pid_dir, f"rank{rank}").write_text(f"{os.getpid()} {child.pid}")
    _steps(3)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    _steps(100)


def hang_rank_1(rank: int, world: int) -> None:
    """Rank 1 hangs in its own work of a step (never reports it); rank 0 reports the step
    and waits for rank 1 in the next one."""
    t = torch.ones(1)
    dist.all_reduce(t)
    if rank == 1:
        time.sleep(300)
    progress()
    _steps(100)


@dataclass(frozen=True)
class Scenario:
    """One parallel generation to run inside a shared launch."""

    name: str
    cfg_name: str
    compression: object
    tp: int
    pp: int
    split: tuple[int, ...] | None
    microbatches: int
    prompt: torch.Tensor
    new: int
    sampling: Sampling = Sampling()


def run_scenarios(rank: int, world: int, scenarios: list[Scenario]) -> dict[str, Generation]:
    """Several generations on the same ranks (start-up paid once)."""
    from tests.parallel import models

    out = {}
    for sc in scenarios:
        mesh = Mesh.create(sc.tp, sc.pp)
        model = factory(getattr(models, sc.cfg_name), 0, sc.compression)()  # type: ignore[arg-type]
        out[sc.name] = rank_generate(
            model, sc.prompt, sc.new, mesh, sc.split, sc.microbatches, sampling=sc.sampling,
            keep_logits=True,
        )  # fmt: skip
    return out


def load_part(folder: str, part_of: PartOf) -> Transformer:
    """A rank's part of the checkpoint in ``folder`` (a ``PartLoader``'s ``load``): only
    its stage's blocks and its tensor-parallel slices are read."""
    checkpoint = open_checkpoint(folder)
    part = part_of(checkpoint.config)
    return checkpoint.load(layers=part.layers, shard=part.shard, on_block=part.on_block)
