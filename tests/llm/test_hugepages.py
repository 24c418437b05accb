"""kiln.llm.hugepages: parameters moved into a huge-page arena keep their values, dtypes,
shapes and ties, and the model computes the same outputs."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from torch import nn

from kiln.compress import Int4WeightOnly, Int8WeightOnly
from kiln.compress.gguf_linear import GgufLinear
from kiln.core import huge_pages
from kiln.llm import hugepages
from kiln.llm.fast_decoder import FastDecoder
from kiln.llm.native.step import KIND_INT4, KIND_INT8
from tests.support.gguf_quants import random_blocks
from tests.support.models import TINY_LLAMA, tiny_transformer

CFG = TINY_LLAMA
HAVE_THP = hugepages.thp_mode() in ("always", "madvise")


@pytest.mark.skipif(not HAVE_THP, reason="transparent huge pages are off on this machine")
def test_move_keeps_values_ties_and_outputs() -> None:
    model = tiny_transformer(CFG)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tokens = torch.randint(0, CFG.vocab_size, (2, 7))
    with torch.no_grad():
        expected = model(tokens, 0, model.new_cache(2, 8))
    moved, why = hugepages.move_to_huge_pages_(model)
    assert why == "" and moved >= sum(p.numel() * 4 for p in before.values())
    ptrs = [p.data_ptr() for p in model.parameters()]
    assert min(ptrs) % hugepages.HUGE_PAGE == 0 and all(q % hugepages.ALIGN == 0 for q in ptrs)
    assert max(ptrs) - min(ptrs) < moved  # one arena
    for name, p in model.named_parameters():
        assert isinstance(p, nn.Parameter) and torch.equal(p, before[name]), name
    assert model.lm_head.weight is model.embed.weight  # still tied
    with torch.no_grad():
        assert torch.equal(model(tokens, 0, model.new_cache(2, 8)), expected)
    assert hugepages.move_to_huge_pages_(model) == (0, "no CPU parameters outside huge pages")


@pytest.mark.skipif(not HAVE_THP, reason="transparent huge pages are off on this machine")
def test_gguf_blocks_move_and_their_kernel_follows() -> None:
    """A GGUF layer's blocks (a buffer the decode step streams in place) move too; the
    layer's kernel holds the same tensor, so it computes from the moved bytes."""
    raw = torch.from_numpy(random_blocks(gguf.GGMLQuantizationType.Q8_0, 48, 64))
    block = nn.Sequential(GgufLinear(raw.clone(), 8, 64, None), nn.Linear(48, 4))
    x = torch.randn(2, 64)
    with torch.no_grad():
        expected = block(x)
        moved, why = hugepages.move_to_huge_pages_(block)
        assert why == "" and moved >= raw.numel()
        layer = block[0]
        assert isinstance(layer, GgufLinear) and torch.equal(layer.blocks, raw)
        assert layer.blocks.data_ptr() % hugepages.ALIGN == 0
        assert torch.equal(block(x), expected)


def test_mixed_dtypes_move_with_their_dtypes() -> None:
    block = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2).to(torch.float16))
    before = [p.detach().clone() for p in block.parameters()]
    moved, why = hugepages.move_to_huge_pages_(block)
    assert (moved > 0) == HAVE_THP, why
    for p, b in zip(block.parameters(), before):
        assert p.dtype == b.dtype and torch.equal(p, b)


def test_thp_mode_reads_the_bracketed_choice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    monkeypatch.setattr(huge_pages, "THP_ENABLED", f)
    assert hugepages.thp_mode() == "madvise"
    f.write_text("always madvise [never]\n")
    assert hugepages.thp_mode() == "never"
    assert huge_pages.huge_page_arena(4096) == (None, "transparent huge pages are never")
    monkeypatch.setattr(huge_pages, "THP_ENABLED", tmp_path / "missing")
    assert hugepages.thp_mode() == "unavailable"


def test_fast_decoder_reports_what_moved() -> None:
    model = tiny_transformer(CFG)
    dec = FastDecoder(model, 1, 8)
    assert dec.huge_pages.endswith("MiB moved") == HAVE_THP, dec.huge_pages
    assert FastDecoder(model, 1, 8, huge_pages=False).huge_pages == "not asked for"


@pytest.mark.skipif(not HAVE_THP, reason="transparent huge pages are off here")
def test_packed_weights_are_shared_with_the_layers_kernels_and_in_huge_pages() -> None:
    """An INT4 / INT8 model's repacked weights: one copy, used by the layer's own kernel
    (eager prefill) and by every decoder's step, born in huge pages; steps are unchanged."""
    for config in (Int4WeightOnly(group_size=32), Int8WeightOnly()):
        model = tiny_transformer(CFG, compression=config)
        with torch.no_grad():  # the eager layers build their kernels first
            model(torch.tensor([[1, 2, 3]]), 0, model.new_cache(1, 8))
        a, b = FastDecoder(model, 1, 8), FastDecoder(model, 1, 8, huge_pages=False)
        kinds = (KIND_INT4, KIND_INT8)
        packed_a = [args.weight for _, args in a._keep[1] if args.kind in kinds]
        packed_b = [args.weight for _, args in b._keep[1] if args.kind in kinds]
        assert packed_a and all(x is y for x, y in zip(packed_a, packed_b, strict=True))
        layer = model.layers[0].mlp.up
        assert any(layer._kernel._small._w is w for w in packed_a)  # the eager kernel's own
        for w in packed_a:  # carved from a 2 MB-aligned arena
            assert w.untyped_storage().nbytes() >= hugepages.HUGE_PAGE
        tok = torch.tensor([5])
        assert torch.equal(a.step(tok, 0), b.step(tok, 0))
