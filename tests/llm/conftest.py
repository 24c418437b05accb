"""Fixtures shared by the runtime tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """The eager reference on one thread: its tiny ops each open an OpenMP region, and on a
    loaded 2-core machine a 2-thread region can wait milliseconds for its second thread
    (the C++ step's own threading is tested with explicit ``threads``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
