"""Session-wide test setup, loaded before any test module.

Without a GPU, Triton kernels are tested through Triton's interpreter. TRITON_INTERPRET
must be set before the first ``triton.jit`` decoration *and* before anything (torch's
inductor included) makes Triton read its settings, so it is set here, first.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from types import ModuleType

import pytest
import torch

from kiln.compiler.codegen.cpu import build

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def compile_lib() -> Callable[[str], ctypes.CDLL]:
    """Compile a C++ source string with kiln's program flags and load it with ctypes."""

    def load(source: str) -> ctypes.CDLL:
        return ctypes.CDLL(str(build.compile_program(source)))

    return load


@pytest.fixture(scope="session")
def runtime() -> ModuleType:
    """The runtime extension, built (or loaded from the disk cache) once per session."""
    return build.load_runtime()
