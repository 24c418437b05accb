"""kiln.runtime.hugepages: parameters moved into a huge-page arena keep their values, dtypes,
shapes and ties, and the model computes the same outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from kiln.models.config import ModelConfig
from kiln.models.transformer import Transformer
from kiln.runtime import hugepages
from kiln.runtime.decode import FastDecoder

CFG = ModelConfig(
    family="llama", vocab_size=97, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2,
    head_dim=8, intermediate_size=48, max_positions=64,
)  # fmt: skip
HAVE_THP = hugepages.thp_mode() in ("always", "madvise")


@pytest.mark.skipif(not HAVE_THP, reason="transparent huge pages are off on this machine")
def test_move_keeps_values_ties_and_outputs() -> None:
    torch.manual_seed(0)
    model = Transformer(CFG).eval()
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
    model = Transformer(CFG).eval()
    dec = FastDecoder(model, 1, 8)
    assert dec.huge_pages.endswith("MiB moved") == HAVE_THP, dec.huge_pages
    assert FastDecoder(model, 1, 8, huge_pages=False).huge_pages == "not asked for"
