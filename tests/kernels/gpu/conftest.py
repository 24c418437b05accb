"""Triton kernels run on the GPU when there is one, else through Triton's interpreter on the CPU.

TRITON_INTERPRET must be set before ``triton.jit`` decorates the kernels, that is before
``kiln.kernels.gpu.woq_triton`` is first imported; conftest files load before their folder's tests.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where the kernels run: CUDA when present, else the CPU under the interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Every test draws the same random activations, whatever ran before it."""
    torch.manual_seed(0)
