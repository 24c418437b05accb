"""The Triton backend runs on a GPU when there is one, else through Triton's interpreter
(``TRITON_INTERPRET=1``, set by the session conftest before anything imports Triton)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)
