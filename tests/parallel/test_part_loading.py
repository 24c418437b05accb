"""Ranks that read only their part of a checkpoint (``PartLoader``) generate what one
process generates with the whole model, and each holds only its part.

The reference is the checkpoint loaded whole in this process, decoded greedily
(``greedy_reference``). Tokens must be identical; logits agree to float32 rounding (1e-5
of the largest logit, as for the in-memory sharding of ``test_mesh``).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from kiln.models.load import load_model
from kiln.parallel import Mesh, PartLoader, block_slices, run_parallel_job
from tests.models.families import write_checkpoint
from tests.parallel.models import greedy_reference, prompts
from tests.parallel.ranks import load_part
from tests.support.compare import assert_close_to_reference

NEW = 5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen2 folder: q/k/v biases, a tied head (the last stage reads the
    embedding table), 4 query / 2 kv heads, 2 layers."""
    return write_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2"))


def test_each_rank_is_told_its_stage_and_slices(checkpoint: Path) -> None:
    cfg = load_model(checkpoint, with_tokenizer=False).config
    for rank in range(4):  # tp 2 x pp 2
        part = Mesh(2, 2, rank, None, None).part(cfg)
        stage, tp_rank = divmod(rank, 2)
        assert part.layers == range(stage, stage + 1)
        assert (part.first, part.last) == (stage == 0, stage == 1)
        assert part.shard == block_slices(cfg, tp_rank, 2) and part.on_block is not None
    whole = Mesh(1, 1, 0, None, None).part(cfg)
    assert (whole.layers, whole.shard, whole.on_block) == (range(2), None, None)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_part_loaded_ranks_generate_what_one_process_generates(
    checkpoint: Path, tp: int, pp: int
) -> None:
    prompt = prompts(2, 6, 256)
    model = load_model(checkpoint, with_tokenizer=False).model
    tokens, logits = greedy_reference(model, prompt, NEW)
    run = run_parallel_job(
        PartLoader(partial(load_part, str(checkpoint))), prompt, NEW, tp=tp, pp=pp,
        timeout_s=60, keep_logits=True,
    )  # fmt: skip
    out = run.generation
    assert out.logits is not None
    assert torch.equal(out.tokens, tokens[:, prompt.shape[1] :])
    assert_close_to_reference(out.logits, logits, rtol_to_max=1e-5)
    whole = sum(t.numel() * t.element_size() for t in model.layers.parameters())
    assert [(r.rank, r.stage, r.tp_rank) for r in run.ranks] == [
        (r, r // tp, r % tp) for r in range(tp * pp)
    ]
    for report in run.ranks:  # a rank's blocks are its part: half, or 2/3 (MLP cut 64 + 32)
        head = model.lm_head.weight.numel() * 4 if report.stage == pp - 1 else 0
        assert report.weight_bytes - head < 0.7 * whole
        assert report.peak_rss_bytes is not None and report.load_s > 0
