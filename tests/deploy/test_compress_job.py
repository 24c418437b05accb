"""`kiln compress` end to end on the small real encoder: plan, checkpoint, report, plot,
and the checkpoint read back by the loader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kiln.cli import app
from kiln.compress import load_compressed
from kiln.compress.checkpoint import compressed_layers
from kiln.deploy.parse import fraction
from tests.quality.conftest import requires_corpus, requires_minilm


def test_help_explains_the_budget_and_the_two_texts() -> None:
    result = CliRunner().invoke(app, ["compress", "--help"])
    assert result.exit_code == 0
    assert "--max-ppl-increase" in result.output and "--objective" in result.output
    text = " ".join(result.output.replace("│", " ").split())
    assert "--confirm-tokens" in text and "Sense and Sensibility" in text
    assert "held-out" not in text  # the search text is not held out


def test_budget_parsing() -> None:
    assert fraction("1%") == pytest.approx(0.01)
    assert fraction("0.5%") == pytest.approx(0.005)
    assert fraction("0.05") == pytest.approx(0.05)
    for bad in ("abc", "-1%", "0"):
        with pytest.raises(Exception, match="budget|fraction"):
            fraction(bad)


@requires_corpus
@requires_minilm
def test_compress_minilm_writes_a_loadable_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "minilm-int"
    args = ["compress", "minilm", "--min-cosine", "0.99", "--calib-samples", "2",
            "--eval-tokens", "48", "--confirm-tokens", "96", "--no-uniform",
            "--options", "int8-gptq,int4-g32-gptq", "--out", str(out)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "within budget (confirmed: 1 - cosine" in " ".join(result.output.split())
    report = (out / "report.md").read_text()
    assert report.startswith("# kiln compress minilm")
    # the report names both texts and gives the search figure, margin and confirmation
    assert "Pride and Prejudice (48 sentences)" in report
    assert "Sense and Sensibility (96 sentences)" in report
    assert "| margin | 1 - cosine (confirmation) |" in report
    info = json.loads((out / "kiln_compression.json").read_text())["info"]
    assert info["met"] and info["confirmation"]["within"]
    assert info["confirm_text"] == "Sense and Sensibility (96 sentences)"
    assert (out / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    model, tok = load_compressed(out)
    assert len(compressed_layers(model)) > 0
    from kiln.models.catalog import load_minilm
    from kiln.quality.embedding import embed, mean_cosine

    original, _ = load_minilm()
    text = ["She was the youngest of the two daughters of a most affectionate father.",
            "The weather was cold, and the roads were bad."]  # fmt: skip
    assert mean_cosine(embed(model, tok, text), embed(original, tok, text)) > 0.98
    with torch.no_grad():
        assert model(**tok(text[:1], return_tensors="pt")).last_hidden_state.shape[-1] == 384
