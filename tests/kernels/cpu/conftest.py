"""Shared fixtures for kiln's CPU kernel tests: compiling test programs, the runtime build."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from types import ModuleType

import pytest

from kiln.kernels.cpu import build


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "runtime_build: builds the kiln runtime extension (~30-60 s the first time)"
    )


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
