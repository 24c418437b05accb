"""kiln.llm.hugepages: parameters moved into a huge-page arena keep their values, dtypes,
shapes and ties, and the model computes the same outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.compress import Int4WeightOnly
from kiln.llm import hugepages
from kiln.llm.fast_decoder import FastDecoder
from kiln.llm.native.step import KIND_INT4, Descriptor, dense_args
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
    monkeypatch.setattr(hugepages, "THP_ENABLED", f)
    assert hugepages.thp_mode() == "madvise"
    f.write_text("always madvise [never]\n")
    assert hugepages.thp_mode() == "never"
    assert hugepages.huge_page_arena(4096) == (None, "transparent huge pages are never")
    monkeypatch.setattr(hugepages, "THP_ENABLED", tmp_path / "missing")
    assert hugepages.thp_mode() == "unavailable"


def test_fast_decoder_reports_what_moved() -> None:
    model = tiny_transformer(CFG)
    dec = FastDecoder(model, 1, 8)
    assert dec.huge_pages.endswith("MiB moved") == HAVE_THP, dec.huge_pages
    assert FastDecoder(model, 1, 8, huge_pages=False).huge_pages == "not asked for"


@pytest.mark.skipif(not HAVE_THP, reason="transparent huge pages are off here")
def test_packed_weights_move_and_steps_are_unchanged() -> None:
    """An INT4 model's repacked weights (made by the decoder, outside the model's arena)
    move into huge pages too; the step's logits are bit-identical either way."""
    model = tiny_transformer(CFG, compression=Int4WeightOnly(group_size=32))
    moved, kept = FastDecoder(model, 1, 8), FastDecoder(model, 1, 8, huge_pages=False)
    assert "packed weights:" in moved.huge_pages and moved.huge_pages.endswith("MiB moved")
    for dec, in_arena in ((moved, True), (kept, False)):
        for _, args in dec._keep[1]:  # (first word, LinearArgs) of every linear record
            if args.kind == KIND_INT4:  # a view into the shared arena, or its own storage
                assert (args.weight.untyped_storage().nbytes() > args.weight.nbytes) == in_arena
    tok = torch.tensor([5])
    assert torch.equal(moved.step(tok, 0), kept.step(tok, 0))


def test_relocate_checks_the_copy() -> None:
    d = Descriptor()
    d.linear(dense_args(torch.randn(4, 3), None))
    with pytest.raises(ValueError, match="differs"):
        d.relocate(0, torch.zeros(3, 4))
    w = torch.randn(4, 3)
    d.relocate(0, w)
    assert d.words[4] == w.data_ptr() and d.linears[0][1].weight is w
    assert d.to_tensor()[4] == w.data_ptr()
    with pytest.raises(RuntimeError, match="after to_tensor"):
        d.relocate(0, torch.randn(4, 3))
