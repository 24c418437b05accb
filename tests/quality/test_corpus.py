"""The Austen corpus: decoding (real data), slicing and sentence splitting (synthetic data)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.quality import corpus
from tests.quality.conftest import requires_corpus, requires_smollm2


class CharTokenizer:
    """One token per character (its code point): an independent, trivially checkable tokenizer."""

    def __call__(self, text: str, add_special_tokens: bool = True, verbose: bool = True) -> Any:
        return {"input_ids": [ord(c) for c in text]}


@pytest.fixture
def fake_novels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Small stand-in novels in a temporary $KILN_DATA_DIR."""
    monkeypatch.setenv("KILN_DATA_DIR", str(tmp_path))
    texts = {
        name: name.upper() + "\n\n" + "".join(f"Text of {name}, line {i}.\n" for i in range(5))
        for name in corpus.NOVELS
    }
    for name, text in texts.items():
        (tmp_path / f"{name}.txt").write_text(text, encoding="utf-8")
    return texts


def test_data_dir_follows_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_DATA_DIR", str(tmp_path / "d"))
    assert corpus.data_dir() == tmp_path / "d"
    monkeypatch.delenv("KILN_DATA_DIR")
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "c"))
    assert corpus.data_dir() == tmp_path / "c" / "data"


def test_missing_novel_says_make_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_DATA_DIR", str(tmp_path))
    assert not corpus.corpus_available()
    with pytest.raises(FileNotFoundError, match="make data"):
        corpus.load_novel("emma")
    with pytest.raises(ValueError, match="unknown novel"):
        corpus.load_novel("ulysses")


def test_evaluation_tokens_are_the_first_tokens(fake_novels: dict[str, str]) -> None:
    ids = corpus.evaluation_tokens(CharTokenizer(), 30)
    assert ids.dtype == torch.int64 and ids.shape == (30,)
    assert "".join(map(chr, ids.tolist())) == fake_novels["pride_and_prejudice"][:30]
    with pytest.raises(ValueError):
        corpus.evaluation_tokens(CharTokenizer(), 10**6)


def test_search_and_confirmation_tokens_come_from_two_novels(fake_novels: dict[str, str]) -> None:
    tok = CharTokenizer()
    search, confirm = corpus.search_tokens(tok, 40), corpus.confirmation_tokens(tok, 40)
    assert "".join(map(chr, search.tolist())) == fake_novels["pride_and_prejudice"][:40]
    assert "".join(map(chr, confirm.tolist())) == fake_novels["sense_and_sensibility"][:40]
    assert torch.equal(corpus.evaluation_tokens(tok, 40), search)  # the older name
    assert corpus.EVALUATION_NOVEL == corpus.SEARCH_NOVEL != corpus.CONFIRMATION_NOVEL
    roles = {corpus.CALIBRATION_NOVEL, corpus.SEARCH_NOVEL, corpus.CONFIRMATION_NOVEL}
    assert (
        len(roles) == 3 and roles <= set(corpus.NOVELS) and set(corpus.TITLES) == set(corpus.NOVELS)
    )
    with pytest.raises(ValueError, match="sense_and_sensibility"):
        corpus.confirmation_tokens(tok, 10**6)


def test_calibration_batches_are_seeded_windows_of_emma(fake_novels: dict[str, str]) -> None:
    emma = fake_novels["emma"]
    batch = corpus.calibration_batches(CharTokenizer(), n_samples=6, seq_len=17, seed=3)
    assert batch.dtype == torch.int64 and batch.shape == (6, 17)
    for row in batch.tolist():
        window = "".join(map(chr, row))
        assert window in emma  # a contiguous slice of the calibration novel
    same = corpus.calibration_batches(CharTokenizer(), n_samples=6, seq_len=17, seed=3)
    other = corpus.calibration_batches(CharTokenizer(), n_samples=6, seq_len=17, seed=4)
    assert torch.equal(batch, same) and not torch.equal(batch, other)


def test_split_sentences_keeps_titles_and_quotes() -> None:
    paragraph = (
        '"My dear Mr. Bennet," said his lady to him one day, "have you heard that '
        'Netherfield Park is let at last?" Mr. Bennet replied that he had not. Oh! Indeed.'
    )
    assert corpus.split_sentences(paragraph) == [
        '"My dear Mr. Bennet," said his lady to him one day, "have you heard that '
        'Netherfield Park is let at last?"',
        "Mr. Bennet replied that he had not.",
        "Oh!",
        "Indeed.",
    ]


def test_sentences_unwrap_lines_and_drop_italics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KILN_DATA_DIR", str(tmp_path))
    text = (
        "CHAPTER I\n\n\nShe was _very_ happy that\nday, and said so. It rained.\n\n"
        "Then Mrs. Weston came\nto tea with them all."
    )
    (tmp_path / "emma.txt").write_text(text, encoding="utf-8")
    got = corpus.sentences("emma", n=2, min_words=4, seed=0)
    assert got == [
        "She was very happy that day, and said so.",
        "Then Mrs. Weston came to tea with them all.",
    ]
    with pytest.raises(ValueError, match="sentences"):
        corpus.sentences("emma", n=3, min_words=4, seed=0)


@requires_corpus
def test_real_corpus_has_six_novels() -> None:
    manifest = json.loads((corpus.data_dir() / corpus.MANIFEST).read_text(encoding="utf-8"))
    assert set(manifest["novels"]) == set(corpus.NOVELS)
    texts = {name: corpus.load_novel(name) for name in corpus.NOVELS}
    total = sum(len(t) for t in texts.values())
    assert 3_900_000 < total < 4_200_000  # ~4.0 M characters (4,025,022 in janeaustenr 1.0.0)
    assert all(300_000 < len(t) < 1_000_000 for t in texts.values())
    assert texts["emma"].startswith("EMMA")
    assert texts["pride_and_prejudice"].startswith("PRIDE AND PREJUDICE")
    assert "It is a truth universally acknowledged" in texts["pride_and_prejudice"][:500]


@requires_corpus
def test_fetch_is_a_no_op_when_present(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_subprocess(*args: object, **kwargs: object) -> None:
        raise AssertionError("fetch ran a command although the corpus is present")

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    assert corpus.fetch() == corpus.data_dir()


@requires_corpus
def test_real_sentences() -> None:
    got = corpus.sentences("pride_and_prejudice", n=200, min_words=8, seed=0)
    assert len(got) == 200 and got == corpus.sentences("pride_and_prejudice", 200, 8, 0)
    for s in got:
        assert len(s.split()) >= 8 and "\n" not in s and "_" not in s
        assert not s.endswith((" Mr.", " Mrs."))
    assert got != corpus.sentences("pride_and_prejudice", 200, 8, 1)


@requires_corpus
@requires_smollm2
def test_real_evaluation_tokens_decode_to_the_text(smollm2: tuple[Any, Any]) -> None:
    _, tokenizer = smollm2
    ids = corpus.evaluation_tokens(tokenizer, 4096)
    assert ids.shape == (4096,)
    text = tokenizer.decode(ids.tolist())
    assert corpus.load_novel("pride_and_prejudice").startswith(text)


@requires_corpus
def test_real_confirmation_text_is_sense_and_sensibility_and_shares_no_sentence() -> None:
    assert corpus.load_novel(corpus.CONFIRMATION_NOVEL).startswith("SENSE AND SENSIBILITY")
    search = corpus.sentences(corpus.SEARCH_NOVEL, 1024, seed=0)
    confirm = corpus.confirmation_sentences(1024, seed=0)
    assert len(confirm) == 1024 and set(search).isdisjoint(confirm)
    sense = corpus.load_novel("sense_and_sensibility")
    assert all(" ".join(s.split()[:4]) in " ".join(sense.split()) for s in confirm[:50])


@requires_corpus
@requires_smollm2
def test_real_search_and_confirmation_windows_share_no_text(smollm2: tuple[Any, Any]) -> None:
    """The 20,000-token search and confirmation streams: different novels, no common run of
    32 tokens (a shared passage would show as one)."""
    _, tokenizer = smollm2
    search = corpus.search_tokens(tokenizer, 20000).tolist()
    confirm = corpus.confirmation_tokens(tokenizer, 20000).tolist()
    assert corpus.load_novel("sense_and_sensibility").startswith(tokenizer.decode(confirm[:4096]))
    grams = {tuple(search[i : i + 32]) for i in range(len(search) - 31)}
    assert not any(tuple(confirm[i : i + 32]) in grams for i in range(len(confirm) - 31))
