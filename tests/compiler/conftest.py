"""Fixtures of the generated-code tests."""

from __future__ import annotations

import pytest

from kiln.compiler.codegen.cpu import build
from kiln.core.native import isa

ISAS = ["avx512", "avx2"] if isa() == "avx512" else ["avx2"]


@pytest.fixture(params=ISAS)
def vector_isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Generate and build programs for each vector ISA this CPU runs: on an AVX-512 host
    the AVX2 path too (``-mno-avx512f``, as the GGUF kernels' tests do)."""
    if request.param != isa():
        monkeypatch.setattr(build, "isa", lambda: request.param)
        monkeypatch.setattr(build, "PROGRAM_FLAGS", (*build.PROGRAM_FLAGS, "-mno-avx512f"))
    return str(request.param)
