"""Streaming loads: a model filled block by block through a hook, a pipeline stage's part
or a tensor-parallel rank's slices holds exactly what the full load holds there, and
reads nothing else.

References: the full load of the same checkpoint (``load_model`` without options), cut
in memory the way ``kiln.parallel`` cuts a model (``shard_tensor_parallel``), or
quantized after loading. Tensors must be bitwise equal; logits agree to float32 rounding
(1e-6 of the largest): a tensor read into its own memory is 64-byte aligned, a view of
the mapped file is not, and the kernels' SIMD path may differ with that.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from kiln.compress import Int4WeightOnly, Int8WeightOnly, quantize_
from kiln.compress.modules import Int4Linear, Int8Linear
from kiln.models import file_reads
from kiln.models.file_reads import SafetensorsLayout
from kiln.models.load import Checkpoint, load_model, open_checkpoint
from kiln.models.parts import quantize_blocks
from kiln.models.readers import LazyTensor
from kiln.models.transformer import Block
from kiln.parallel.tp import block_slices, finish_block, shard_tensor_parallel
from tests.models.families import (
    kiln_greedy,
    one_thread,  # noqa: F401  (the fixture, used by name)
    write_checkpoint,
    write_tiny_gguf,
)
from tests.models.test_compressed_load import compressed_checkpoint
from tests.support.compare import assert_close_to_reference, assert_equal

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = torch.tensor([[3, 17, 200, 41, 9, 250, 77]])


def checkpoint(kind: str, folder: Path) -> Path:
    """A tiny checkpoint: an HF family folder, a GGUF file ("gguf"), or a folder written
    by ``kiln compress`` ("compressed": INT4 MLPs, INT8 attention)."""
    if kind == "gguf":
        return write_tiny_gguf(folder / "tiny.gguf")
    if kind == "compressed":
        compressed_checkpoint("llama", folder)
        return folder
    return write_checkpoint(kind, folder)


def state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in module.state_dict().items()}


def assert_same_state(actual: torch.nn.Module, expected: torch.nn.Module) -> None:
    got, want = state(actual), state(expected)
    assert list(got) == list(want)
    for name in want:
        assert type(actual.get_submodule(name.rpartition(".")[0])) is type(
            expected.get_submodule(name.rpartition(".")[0])
        ), name
        assert_equal(got[name], want[name])


@pytest.mark.parametrize(
    ("kind", "packed"),
    [("llama", True), ("qwen2", True), ("gpt2", True), ("gemma3", True), ("gguf", True),
     ("gguf", False), ("compressed", True)],
)  # fmt: skip
def test_block_by_block_load_computes_what_the_full_load_computes(
    kind: str, packed: bool, tmp_path: Path
) -> None:
    path = checkpoint(kind, tmp_path)
    full = load_model(path, packed=packed, with_tokenizer=False).model
    seen: list[int] = []
    streamed = load_model(
        path, packed=packed, with_tokenizer=False, on_block=lambda i, b: seen.append(i)
    ).model  # a hook: every tensor read explicitly into its own memory
    assert seen == list(range(full.cfg.n_layers))
    assert_same_state(streamed, full)
    # The same values; where a tensor lies (64-byte aligned, or at the file mapping's
    # offset) may change the kernels' SIMD path: float32 rounding apart.
    assert_close_to_reference(
        kiln_greedy(streamed, PROMPT, 3)[0], kiln_greedy(full, PROMPT, 3)[0], 1e-6
    )


def counting(ckpt: Checkpoint) -> list[str]:
    """Make every read of ``ckpt``'s tensors record its name: ``read_rows`` (whole or
    rows) as the name, ``view`` (a mapped view, which a loader may drop unused when it
    wants another dtype) as "view:" + the name."""
    reads: list[str] = []

    def wrap(name: str, lazy: LazyTensor) -> LazyTensor:
        def rows(start: int, stop: int) -> Any:
            reads.append(name)
            return lazy.read_rows(start, stop)

        def view() -> torch.Tensor:
            reads.append(f"view:{name}")
            assert lazy.view is not None
            return lazy.view()

        return replace(lazy, read_rows=rows, view=None if lazy.view is None else view)

    ckpt.tensors = {name: wrap(name, lazy) for name, lazy in ckpt.tensors.items()}
    return reads


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gguf"])  # untied; tied head; GGUF
def test_a_pipeline_stage_reads_only_its_layers(kind: str, tmp_path: Path) -> None:
    path = checkpoint(kind, tmp_path)
    full = load_model(path, with_tokenizer=False).model
    tied = full.cfg.tie_embeddings
    for layers, first, last in ((range(0, 1), True, False), (range(1, 2), False, True)):
        ckpt = open_checkpoint(path)
        reads = counting(ckpt)
        part = ckpt.load(layers=layers)
        expected = {n for n in ckpt.tensors if n.startswith(tuple(f"layers.{i}." for i in layers))}
        if first or (last and tied):  # the embedding, or the tied head
            expected.add("embed.weight")
        if last:
            expected |= {"final_norm.weight"} | (set() if tied else {"lm_head.weight"})
        copies = [n for n in reads if not n.startswith("view:")]
        assert len(copies) == len(set(copies))  # none read twice
        assert {n.removeprefix("view:") for n in reads} == expected  # nothing else
        for i, block in enumerate(part.layers):
            if i in layers:
                assert_same_state(block, full.layers[i])
            else:
                assert all(t.is_meta for t in state(block).values())
        assert part.embed.weight.is_meta == (not first and not (last and tied))
        assert part.final_norm.weight.is_meta == (not last)


def shard_hook(index: int, block: Block) -> None:
    finish_block(block, None)  # no process group: the structure is checked, not run


@pytest.mark.parametrize(
    ("kind", "packed"),
    [("llama", True), ("gpt2", True), ("gemma3", True), ("gguf", True), ("gguf", False),
     ("compressed", True)],
)  # fmt: skip
def test_a_tensor_parallel_rank_holds_the_slices_of_the_full_tensors(
    kind: str, packed: bool, tmp_path: Path
) -> None:
    path = checkpoint(kind, tmp_path)
    full = load_model(path, packed=packed, with_tokenizer=False).model
    for rank in (0, 1):
        expected = shard_tensor_parallel(copy.deepcopy(full), rank, 2)  # cut in memory
        ckpt = open_checkpoint(path, packed)
        streamed = ckpt.load(shard=block_slices(ckpt.config, rank, 2), on_block=shard_hook)
        assert_same_state(streamed, expected)
        attn = streamed.layers[0].attn
        assert (attn.n_heads, attn.n_kv_heads) == (expected.layers[0].attn.n_heads,
                                                   expected.layers[0].attn.n_kv_heads)  # fmt: skip


@pytest.fixture
def bytes_read(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Every explicit read's byte count."""
    sizes: list[int] = []
    original = file_reads.read_bytes

    def counted(path: Path, offset: int, nbytes: int) -> torch.Tensor:
        sizes.append(nbytes)
        return original(path, offset, nbytes)

    monkeypatch.setattr(file_reads, "read_bytes", counted)
    yield sizes


def test_a_rank_reads_only_its_rows(tmp_path: Path, bytes_read: list[int]) -> None:
    """Column-parallel layers are read as row ranges; row-parallel ones (o, down) are read
    whole and cut; everything else whole: the bytes read add up to exactly that."""
    ckpt = open_checkpoint(write_checkpoint("llama", tmp_path))
    slices = block_slices(ckpt.config, 1, 2)
    ckpt.load(shard=slices, on_block=shard_hook)
    expected = 0
    for name, lazy in ckpt.tensors.items():
        full = torch.Size(lazy.shape).numel() * 4  # fp32 on disk
        module = name.split(".", 2)[-1].rpartition(".")[0] if name.startswith("layers.") else ""
        part = slices.get(module)
        expected += (
            full * (part.stop - part.start) // lazy.shape[0]
            if part and part.axis == "rows"
            else full
        )
    assert sum(bytes_read) == expected


@pytest.mark.parametrize("config", [Int8WeightOnly(), Int4WeightOnly(group_size=32)])
def test_quantizing_while_loading_equals_quantizing_after(config: Any, tmp_path: Path) -> None:
    path = write_checkpoint("llama", tmp_path)
    after = load_model(path, with_tokenizer=False).model
    quantize_(after, config, filter_fn=lambda _m, name: name.startswith("layers."))
    during = load_model(path, with_tokenizer=False, on_block=quantize_blocks(config)).model
    kind = Int8Linear if isinstance(config, Int8WeightOnly) else Int4Linear
    assert all(isinstance(b.mlp.down, kind) and isinstance(b.attn.q, kind) for b in during.layers)
    assert_same_state(during, after)
    assert_close_to_reference(
        kiln_greedy(during, PROMPT, 3)[0], kiln_greedy(after, PROMPT, 3)[0], 1e-6
    )


def test_safetensors_rows_are_read_alone(tmp_path: Path) -> None:
    path = write_checkpoint("llama", tmp_path) / "model.safetensors"
    from safetensors.torch import save_file

    save_file({"bf16": torch.randn(6, 5).bfloat16(), "vec": torch.arange(7.0)}, tmp_path / "x.st")
    for file in (path, tmp_path / "x.st"):
        layout = SafetensorsLayout(file)
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle)
                stored = handle.get_tensor(name)
                assert_equal(layout.read(name), stored)
                n = stored.shape[0]
                assert_equal(layout.read(name, (n // 3, n - 1)), stored[n // 3 : n - 1])


def mapped_file(t: torch.Tensor) -> str:
    """The file whose mapping holds ``t``'s data ("" for anonymous memory)."""
    addr = t.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= addr < hi:
            return fields[5] if len(fields) == 6 else ""
    return ""


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_unconverted_tensors_stay_views_of_the_mapped_file(tmp_path: Path) -> None:
    """Without a hook or shard, fp32 tensors stored as fp32 are the file mapping's pages
    (no copy); asked for another dtype, or with a hook, they are the process's own."""
    path = write_checkpoint("llama", tmp_path)
    mapped = load_model(path, with_tokenizer=False).model
    own = load_model(path, with_tokenizer=False, on_block=lambda i, b: None).model
    halves = load_model(path, dtype=torch.bfloat16, with_tokenizer=False).model
    file = str(path / "model.safetensors")
    for model, is_view in ((mapped, True), (own, False), (halves, False)):
        w = model.layers[0].mlp.up.weight
        assert (mapped_file(w) == file) == is_view, (is_view, w.dtype, mapped_file(w))


def test_bad_layer_ranges_are_refused(tmp_path: Path) -> None:
    ckpt = open_checkpoint(write_checkpoint("llama", tmp_path))
    for bad in (range(0, 0), range(1, 3), range(0, 2, 2)):
        with pytest.raises(ValueError, match="not a non-empty run of the model's 2 blocks"):
            ckpt.load(layers=bad)
