"""In-process checks of the parallel layout: head and feature partitions, stage splits,
the slicing interface, shard shapes and per-rank caches (no process group needed), and
run_parallel in torchrun mode with one rank."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from torch import nn

import kiln.parallel
from kiln.compress import Int4WeightOnly, quantize_
from kiln.parallel import partition_heads, run_parallel, shard_tensor_parallel, sliceable
from kiln.parallel.launch import free_port
from kiln.parallel.pp import Stage, even_split, microbatch_bounds, split_stages
from kiln.parallel.tp import DenseSlicer, HeadShard, RowParallel, local_kv_heads, partition_features
from tests.parallel.models import LLAMA, UNEVEN, build, factory, greedy_reference, prompts
from tests.support.compare import assert_close_to_reference


def test_smollm2_heads_over_two_ranks_split_unevenly() -> None:
    assert partition_heads(9, 3, 2) == [HeadShard(0, 2, 0, 6), HeadShard(2, 3, 6, 9)]


def test_fewer_kv_heads_than_ranks_replicates_them() -> None:
    shards = partition_heads(4, 1, 2)
    assert shards == [HeadShard(0, 1, 0, 2), HeadShard(0, 1, 2, 4)]
    shards = partition_heads(8, 2, 4)  # two ranks per kv head, 2 query heads each
    assert [(s.kv_start, s.q_start, s.q_stop) for s in shards] == [
        (0, 0, 2), (0, 2, 4), (1, 4, 6), (1, 6, 8),
    ]  # fmt: skip
    assert [s.q_stop - s.q_start for s in partition_heads(6, 2, 5)] == [1, 1, 1, 2, 1]
    with pytest.raises(ValueError, match="4 query heads cannot be split over 8"):
        partition_heads(4, 1, 8)


def test_mlp_features_are_cut_at_block_boundaries() -> None:
    assert partition_features(1536, 2) == [(0, 768), (768, 1536)]
    assert partition_features(1536, 3) == [(0, 512), (512, 1024), (1024, 1536)]
    assert partition_features(96, 2) == [(0, 64), (64, 96)]  # units of 32
    assert all(a % 32 == 0 for a, _ in partition_features(1536, 5))


def test_split_stages_validates() -> None:
    assert split_stages(30, [16, 14]) == [range(0, 16), range(16, 30)]
    assert even_split(30, 4) == [8, 8, 7, 7]
    for bad, msg in (([15, 14], "covers 29 layers"), ([30, 0], "positive"), ([], "no stage")):
        with pytest.raises(ValueError, match=msg):
            split_stages(30, bad)
    with pytest.raises(ValueError, match="cannot fill"):
        even_split(3, 4)
    assert microbatch_bounds(5, 2) == [(0, 3), (3, 5)]
    with pytest.raises(ValueError, match="do not fit"):
        microbatch_bounds(2, 3)


def test_dense_slicer_matches_the_layer() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(32, 24)
    s = sliceable(layer)
    assert isinstance(s, DenseSlicer)
    x = torch.randn(3, 32)
    with torch.no_grad():
        rows = s.slice_rows(8, 16)(x)
        assert torch.equal(rows, layer(x)[:, 8:16])
        halves = s.slice_cols(0, 16)(x[:, :16]) + s.slice_cols(16, 32)(x[:, 16:])
        # outputs of magnitude ~1: the old atol=rtol=1e-6 is ~1e-6 of their largest
        assert_close_to_reference(halves, layer(x) + layer.bias, rtol_to_max=1e-6)
    with pytest.raises(TypeError, match="Conv1d cannot be sharded"):
        sliceable(nn.Conv1d(2, 2, 1))


def test_shards_and_caches_hold_only_the_ranks_heads() -> None:
    shapes: list[tuple[int, int, int]] = []
    for rank in range(2):
        model = shard_tensor_parallel(build(UNEVEN, 0), rank, 2)
        block: Any = model.layers[0]
        attn, mlp = block.attn, block.mlp
        assert isinstance(attn.o, RowParallel) and isinstance(mlp.down, RowParallel)
        assert attn.o.bias is not None and attn.o.part.bias is None  # bias after the reduce
        cache = Stage(model, range(3), True, True).new_cache(2, 10)
        shapes.append((attn.q.out_features, local_kv_heads(model), mlp.up.out_features))
        assert cache.keys[2].shape == (2, local_kv_heads(model), 10, 16)
    assert shapes == [(96, 2, 64), (48, 1, 32)]


def test_compressed_layers_shard_through_their_own_methods() -> None:
    model = build(LLAMA, 0)
    quantize_(model, Int4WeightOnly(group_size=32))
    shard_tensor_parallel(model, 1, 2)
    attn: Any = cast(Any, model.layers[0]).attn
    assert type(attn.k).__name__ == "Int4Linear" and attn.k.out_features == 16
    assert type(attn.o.part).__name__ == "Int4Linear" and attn.o.part.in_features == 32


def test_parallel_code_names_no_compressed_type() -> None:
    folder = Path(kiln.parallel.__file__).parent
    for name in ("tp.py", "pp.py", "mesh.py"):
        text = (folder / name).read_text()
        assert not re.search(r"Int4Linear|Int8Linear|Sparse24|LowRank|CompressedLinear", text)


def test_a_middle_stage_releases_embeddings_and_head() -> None:
    model = build(LLAMA, 0)
    stage = Stage(model, range(1, 3), first=False, last=False)
    assert len(stage.model.layers) == 2 and stage.model.embed.weight.numel() == 0
    assert stage.model.lm_head.weight.numel() == 0
    assert sorted(stage.new_cache(1, 4).keys) == [1, 2]


def test_run_parallel_under_torchrun_with_one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for key, value in {**env, "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    prompt = prompts(2, 4, 256)
    tokens = run_parallel(factory(LLAMA), prompt, 5).tokens
    expected, _ = greedy_reference(build(LLAMA, 0), prompt, 5)
    assert torch.equal(tokens, expected[:, prompt.shape[1] :])
