"""Measured plans kept on disk, so a long plan search that dies resumes where it was.

Each plan the search measures (which option per layer, its measured loss increase and
margin, its predicted loss, the round's predicted budget) is appended to a JSON file the
moment it is measured, written atomically (a temporary file, then ``os.replace``); so is
each chosen plan's measurement on the confirmation text (entries with ``"text":
"confirmation"``). The file is named by a hash of everything a measurement depends on
(``plan_key``): the model's weights, the task's settings (text sizes, perplexity window,
the margin's ``z``, ...) and both texts' data, and the option set. A rerun with the same
key reads it and does not measure again any plan (layer -> option assignment) already
measured on that text; any change of text, sizes or margin gives another key, so stale
measurements are never resumed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.compress.sensitivity import SensitivityTable
from kiln.core.cache import cache_dir

SUBDIR = "compress-rounds"
_SAMPLE = 4096  # elements hashed per weight tensor (strided), besides its sum


def weights_fingerprint(model: nn.Module) -> str:
    """A hash of every parameter and buffer: name, shape, dtype, a strided sample of its
    values and their float64 sum (cheap for large models; any real change shows)."""
    h = hashlib.sha256()
    state = model.state_dict()
    for name in sorted(state):
        t = state[name].detach()
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        flat = t.reshape(-1)
        if flat.numel() == 0:
            continue
        step = max(1, flat.numel() // _SAMPLE)
        sample = flat[::step].to("cpu", torch.float64)
        h.update(sample.numpy().tobytes())
        h.update(repr(float(flat.to(torch.float64).sum())).encode())
    return h.hexdigest()


def _settings(task: object) -> dict[str, Any]:
    """A task's plain settings (calibration/evaluation sizes, seed, window length, ...)."""
    if not dataclasses.is_dataclass(task):
        return {}
    out: dict[str, Any] = {}
    for f in dataclasses.fields(task):
        value = getattr(task, f.name)
        if f.init and isinstance(value, bool | int | float | str):
            out[f.name] = value
    return out


# The task methods that return what it measures on: search and confirmation data.
_DATA = (
    "eval_ids", "confirm_ids", "sentences", "confirmation_sentences", "eval_inputs",
    "confirm_inputs",
)  # fmt: skip
TEXTS = ("search", "confirmation")  # which text a kept measurement was taken on


def _evaluation_data(task: object) -> str:
    """A hash of the data the task measures on (token ids, sentences, inputs), both the
    search and the confirmation text."""
    h = hashlib.sha256()
    for attr in _DATA:
        get = getattr(task, attr, None)
        if callable(get):
            data = get()
            if isinstance(data, torch.Tensor):
                h.update(f"{attr}|{tuple(data.shape)}|{data.dtype}|".encode())
                h.update(data.detach().to("cpu").contiguous().numpy().tobytes())
            else:
                h.update(f"{attr}|{json.dumps(data, default=str)}".encode())
    return h.hexdigest()


def plan_key(task: Any, table: SensitivityTable) -> str:
    """The hash naming a search's rounds file: what a plan's measured loss depends on."""
    from kiln.quality.perplexity import window_losses  # the scoring's remaining defaults

    tok = getattr(task, "tokenizer", None)
    defaults = window_losses.__defaults__ or ()
    described = {
        "task": type(task).__name__,
        "settings": _settings(task),
        "window": [repr(d) for d in defaults] if hasattr(task, "eval_ids") else None,
        "tokenizer": None if tok is None else [getattr(tok, "name_or_path", ""), len(tok)],
        "evaluation": _evaluation_data(task),
        "weights": weights_fingerprint(task.model),
        "options": {
            layer: [[o.name, o.nbytes] for o in opts] for layer, opts in table.options.items()
        },
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:24]


def default_path(key: str, directory: Path | None = None) -> Path:
    """``<directory>/<key>.json``, the directory by default ``cache_dir("compress-rounds")``."""
    if directory is None:
        directory = cache_dir(SUBDIR)
    return Path(directory) / f"{key}.json"


class RoundStore:
    """The measured plans of one key, appended as they are measured."""

    def __init__(self, path: Path, key: str) -> None:
        self.path, self.key = Path(path), key
        self.entries: list[dict[str, Any]] = []
        if self.path.exists():
            try:
                data = json.loads(self.path.read_text())
            except (OSError, ValueError):
                data = None  # unreadable: start over (the next append rewrites it)
            if isinstance(data, dict) and data.get("key") == key:
                self.entries = [e for e in data.get("rounds", []) if _valid(e)]
        self.resumed = len(self.entries)

    def lookup(self, choice: dict[str, str], text: str = "search") -> tuple[float, float] | None:
        """(increase, margin) of this exact layer -> option assignment on ``text``
        ("search" or "confirmation"), if kept. Entries without a text are search entries,
        entries without a margin have none."""
        if text not in TEXTS:
            raise ValueError(f"text must be one of {TEXTS}, got {text!r}")
        for entry in self.entries:
            if entry["choice"] == choice and entry.get("text", "search") == text:
                return float(entry["measured"]), float(entry.get("margin", 0.0))
        return None

    def measured(self, choice: dict[str, str]) -> float | None:
        """The measured loss increase of this layer -> option assignment on the search text."""
        kept = self.lookup(choice)
        return None if kept is None else kept[0]

    def append(self, entry: dict[str, Any]) -> None:
        """Keep one more measured plan, rewriting the file atomically."""
        self.entries.append(entry)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"key": self.key, "rounds": self.entries}, indent=1)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _valid(entry: object) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("choice"), dict)
        and isinstance(entry.get("measured"), int | float)
        and isinstance(entry.get("margin", 0.0), int | float)
        and entry.get("text", "search") in TEXTS
    )
