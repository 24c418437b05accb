"""Jane Austen's six novels: the real text kiln measures compressed models on.

The text comes from Debian's ``r-cran-janeaustenr`` package (no R needed). ``fetch``
downloads the ``.deb`` with ``apt-get download``, unpacks it with ``dpkg-deb -x`` and decodes
the R lazy-load database inside it (``data/Rdata.rdx`` + ``Rdata.rdb``) with the ``rdata``
package: the ``.rdx`` file is a gzip'd serialized R list whose ``variables`` entry maps each
novel to an ``(offset, length)`` in the ``.rdb`` file; each blob there is a 4-byte big-endian
uncompressed length followed by zlib data, itself a serialized character vector (one element
per hard-wrapped line of the novel). Each novel is written as one UTF-8 text file (its lines
joined with ``"\\n"``) next to a ``manifest.json`` recording characters and sha256 per novel.

Roles (kept apart so that no reported accuracy is measured on text anything was tuned on):

* *Emma* (``CALIBRATION_NOVEL``): calibration (activation statistics, gradients).
* *Pride and Prejudice* (``SEARCH_NOVEL``): the text a compression plan is searched on
  (its first tokens, or sentences for an encoder). ``EVALUATION_NOVEL`` is its older name.
* *Sense and Sensibility* (``CONFIRMATION_NOVEL``): the chosen plan is confirmed there,
  on text its search never saw; that figure is the plan's reported accuracy.
* The other three novels are kept out of all tuning.

Command line: ``python -m kiln.quality.corpus fetch [--dir DIR] [--deb FILE]``.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import tempfile
import warnings
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kiln.core.cache import cache_dir

if TYPE_CHECKING:  # torch is imported lazily so that `fetch` (run by `make data`) starts fast
    import torch

DEB_PACKAGE = "r-cran-janeaustenr"
# Novel name used by kiln -> variable name inside the R package.
_R_NAMES: dict[str, str] = {
    "emma": "emma",
    "mansfield_park": "mansfieldpark",
    "northanger_abbey": "northangerabbey",
    "persuasion": "persuasion",
    "pride_and_prejudice": "prideprejudice",
    "sense_and_sensibility": "sensesensibility",
}
NOVELS: tuple[str, ...] = tuple(_R_NAMES)
CALIBRATION_NOVEL = "emma"
SEARCH_NOVEL = "pride_and_prejudice"
CONFIRMATION_NOVEL = "sense_and_sensibility"
EVALUATION_NOVEL = SEARCH_NOVEL  # the search text's older name, kept for its callers
TITLES: dict[str, str] = {
    "emma": "Emma",
    "mansfield_park": "Mansfield Park",
    "northanger_abbey": "Northanger Abbey",
    "persuasion": "Persuasion",
    "pride_and_prejudice": "Pride and Prejudice",
    "sense_and_sensibility": "Sense and Sensibility",
}
MANIFEST = "manifest.json"
_RDATA_DIR = Path("usr/lib/R/site-library/janeaustenr/data")


class Tokenizer(Protocol):
    """The slice of a Hugging Face tokenizer that this module uses."""

    def __call__(self, text: str, add_special_tokens: bool = ..., verbose: bool = ...) -> Any: ...


def data_dir() -> Path:
    """Where the novels live: ``$KILN_DATA_DIR``, else ``<kiln cache dir>/data``.

    The kiln cache dir is ``$KILN_CACHE_DIR`` or ``~/.cache/kiln``, so by default this is
    ``~/.cache/kiln/data``.
    """
    env = os.environ.get("KILN_DATA_DIR")
    return Path(env) if env else cache_dir() / "data"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _manifest_ok(directory: Path) -> bool:
    """True when every novel's file exists and matches the manifest (size and sha256)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
        novels = manifest["novels"]
        for name in NOVELS:
            entry = novels[name]
            path = directory / entry["file"]
            if path.stat().st_size != entry["bytes"] or _sha256(path) != entry["sha256"]:
                return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


def corpus_available(directory: Path | None = None) -> bool:
    """True when the six novels are present and intact (as ``make data`` leaves them)."""
    return _manifest_ok(directory or data_dir())


def _r_object(data: bytes) -> Any:
    """Decode one serialized R object (RDS format, no gzip) into Python/numpy values."""
    import rdata  # imported here: only the fetch step needs it

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rdata warns about the header-less blob format
        return rdata.conversion.convert(rdata.parser.parse_data(data, extension=".rds"))


def decode_lazyload(rdx: Path, rdb: Path) -> dict[str, list[str]]:
    """Decode the janeaustenr lazy-load database into ``{novel: lines}``."""
    index = _r_object(gzip.decompress(rdx.read_bytes()))
    blobs = rdb.read_bytes()
    novels: dict[str, list[str]] = {}
    for name, r_name in _R_NAMES.items():
        offset, length = (int(v) for v in index["variables"][r_name])
        blob = blobs[offset : offset + length]
        expected = int.from_bytes(blob[:4], "big")
        raw = zlib.decompress(blob[4:])
        if len(raw) != expected:
            raise ValueError(f"{r_name}: blob inflates to {len(raw)} bytes, header says {expected}")
        lines = _r_object(raw)
        if getattr(lines, "ndim", None) != 1:
            raise ValueError(f"{r_name}: expected a character vector, got {type(lines)}")
        novels[name] = ["" if line is None else str(line) for line in lines]
    return novels


def _download_deb(workdir: Path) -> Path:
    """``apt-get download`` the package into ``workdir``; ``apt-get update`` once on failure."""
    if shutil.which("apt-get") is None:
        raise RuntimeError(f"apt-get not found: fetch needs Debian's {DEB_PACKAGE} package")
    cmd = ["apt-get", "download", DEB_PACKAGE]
    if subprocess.run(cmd, cwd=workdir, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update"], capture_output=True, check=False)
        done = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"`apt-get download {DEB_PACKAGE}` failed:\n{done.stderr}")
    debs = sorted(workdir.glob(f"{DEB_PACKAGE}_*.deb"))
    if not debs:
        raise RuntimeError(f"apt-get download left no {DEB_PACKAGE} .deb in {workdir}")
    return debs[-1]


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def fetch(directory: Path | None = None, deb: Path | None = None, force: bool = False) -> Path:
    """Put the six novels (+ manifest) in ``directory`` (default ``data_dir()``); return it.

    Idempotent: when the files already match the manifest nothing is downloaded. ``deb``
    names an already downloaded ``r-cran-janeaustenr`` ``.deb`` to unpack instead.
    """
    out = directory or data_dir()
    if not force and _manifest_ok(out):
        return out
    if shutil.which("dpkg-deb") is None:
        raise RuntimeError("dpkg-deb not found: it unpacks the Debian package")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kiln-janeausten-") as tmp:
        work = Path(tmp)
        deb_path = deb if deb is not None else _download_deb(work)
        subprocess.run(["dpkg-deb", "-x", str(deb_path), str(work / "x")], check=True)
        rdata_dir = work / "x" / _RDATA_DIR
        novels = decode_lazyload(rdata_dir / "Rdata.rdx", rdata_dir / "Rdata.rdb")
    entries: dict[str, dict[str, Any]] = {}
    for name, lines in novels.items():
        data = "\n".join(lines).encode("utf-8")
        _write_atomic(out / f"{name}.txt", data)
        entries[name] = {
            "file": f"{name}.txt",
            "chars": len(data.decode("utf-8")),
            "lines": len(lines),
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    manifest = {"source": f"Debian {deb_path.name}", "novels": entries}
    _write_atomic(out / MANIFEST, json.dumps(manifest, indent=1).encode("utf-8"))
    return out


def load_novel(name: str, directory: Path | None = None) -> str:
    """The full text of one novel (hard-wrapped lines joined with ``"\\n"``)."""
    if name not in NOVELS:
        raise ValueError(f"unknown novel {name!r}; choose one of {', '.join(NOVELS)}")
    path = (directory or data_dir()) / f"{name}.txt"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: run `make data` (or `python -m kiln.quality.corpus fetch`)"
        )
    return path.read_text(encoding="utf-8")


def _token_ids(tokenizer: Tokenizer, text: str) -> torch.Tensor:
    """Token ids of ``text`` without special tokens, as a 1-D int64 tensor."""
    import torch

    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    return torch.as_tensor(ids, dtype=torch.int64)  # (N,)


def calibration_batches(
    tokenizer: Tokenizer, n_samples: int, seq_len: int, seed: int
) -> torch.Tensor:
    """``n_samples`` random windows of ``seq_len`` tokens of *Emma* -> (n_samples, seq_len) int64.

    Window starts are drawn uniformly (with replacement) by a generator seeded with ``seed``,
    so the same arguments always give the same batch.
    """
    import torch

    if n_samples < 1 or seq_len < 1:
        raise ValueError(f"n_samples and seq_len must be >= 1, got {n_samples}, {seq_len}")
    ids = _token_ids(tokenizer, load_novel(CALIBRATION_NOVEL))  # (N,)
    if ids.numel() < seq_len:
        raise ValueError(f"seq_len {seq_len} exceeds the calibration text ({ids.numel()} tokens)")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq_len + 1, (n_samples,), generator=gen)
    offsets = torch.arange(seq_len)
    return ids[starts[:, None] + offsets[None, :]]  # (n_samples, seq_len)


def first_tokens(novel: str, tokenizer: Tokenizer, n_tokens: int) -> torch.Tensor:
    """The first ``n_tokens`` tokens of ``novel`` -> (n_tokens,) int64.

    The whole novel is tokenized and then cut, so the last tokens are exactly those of the
    full text (tokenizing a character prefix could split the final word differently).
    """
    ids = _token_ids(tokenizer, load_novel(novel))  # (N,)
    if not 1 <= n_tokens <= ids.numel():
        raise ValueError(f"n_tokens must be in [1, {ids.numel()}] for {novel}, got {n_tokens}")
    return ids[:n_tokens].clone()


def search_tokens(tokenizer: Tokenizer, n_tokens: int) -> torch.Tensor:
    """The first ``n_tokens`` tokens of *Pride and Prejudice*, the search text -> (n_tokens,)."""
    return first_tokens(SEARCH_NOVEL, tokenizer, n_tokens)


def confirmation_tokens(tokenizer: Tokenizer, n_tokens: int) -> torch.Tensor:
    """The first ``n_tokens`` tokens of *Sense and Sensibility*, the confirmation text (a
    different novel from the search text, so no token of one is in the other) -> (n_tokens,)."""
    return first_tokens(CONFIRMATION_NOVEL, tokenizer, n_tokens)


evaluation_tokens = search_tokens  # the older name, kept for its callers


# Words ending in "." that do not end a sentence in these novels.
_ABBREVIATIONS = frozenset({"Mr", "Mrs", "Dr", "St", "Col", "Capt", "Esq", "Messrs", "Rev"})
_SENTENCE_END = re.compile(r"[.!?]+[\"']?\s+(?=[\"']?[A-Z])")


def _paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs, unwrapped onto one line, italics marks removed."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        flat = " ".join(block.replace("_", "").split())
        if flat:
            paragraphs.append(flat)
    return paragraphs


def split_sentences(paragraph: str) -> list[str]:
    """Split one unwrapped paragraph at sentence ends (not after "Mr.", "Mrs.", ...)."""
    sentences, start = [], 0
    for match in _SENTENCE_END.finditer(paragraph):
        words = paragraph[start : match.start()].split()
        if match.group().startswith(".") and words and words[-1].lstrip("\"'(") in _ABBREVIATIONS:
            continue
        sentences.append(paragraph[start : match.end()].strip())
        start = match.end()
    sentences.append(paragraph[start:].strip())
    cleaned = []
    for sentence in sentences:
        if sentence.count('"') % 2:  # a quotation opened or closed in a neighbouring sentence
            sentence = sentence.strip('"').strip()
        if sentence:
            cleaned.append(sentence)
    return cleaned


def sentences(novel: str, n: int, min_words: int = 8, seed: int = 0) -> list[str]:
    """``n`` real sentences of ``novel`` with at least ``min_words`` words, in text order.

    The novel's hard-wrapped lines are unwrapped into paragraphs and split at sentence ends;
    ``n`` of the sentences that are long enough are drawn without replacement (seeded).
    Use *Emma* for calibration, *Pride and Prejudice* for a search and *Sense and
    Sensibility* to confirm its result (``confirmation_sentences``).
    """
    pool = [
        s
        for paragraph in _paragraphs(load_novel(novel))
        for s in split_sentences(paragraph)
        if len(s.split()) >= min_words
    ]
    if not 1 <= n <= len(pool):
        raise ValueError(f"{novel} has {len(pool)} sentences of >= {min_words} words; asked {n}")
    picked = sorted(random.Random(seed).sample(range(len(pool)), n))
    return [pool[i] for i in picked]


def confirmation_sentences(n: int, min_words: int = 8, seed: int = 0) -> list[str]:
    """``n`` sentences of *Sense and Sensibility*, the confirmation text (see ``sentences``)."""
    return sentences(CONFIRMATION_NOVEL, n, min_words, seed)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kiln.quality.corpus fetch [--dir DIR] [--deb FILE] [--force]``."""
    parser = argparse.ArgumentParser(prog="python -m kiln.quality.corpus", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    fetch_cmd = sub.add_parser("fetch", help="download and decode the six novels (idempotent)")
    fetch_cmd.add_argument("--dir", type=Path, default=None, help="target (default: data_dir())")
    fetch_cmd.add_argument("--deb", type=Path, default=None, help="use this .deb, no download")
    fetch_cmd.add_argument("--force", action="store_true", help="decode again even if present")
    args = parser.parse_args(argv)
    out = fetch(args.dir, deb=args.deb, force=args.force)
    manifest = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
    total = sum(entry["chars"] for entry in manifest["novels"].values())
    print(f"{len(manifest['novels'])} novels, {total:,} characters in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
