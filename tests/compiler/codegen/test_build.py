"""build.py: program cache (hits skip the compiler), compiler errors, ISA, runtime loading."""

from __future__ import annotations

import time
from pathlib import Path
from types import ModuleType

import pytest

from kiln.compiler.codegen.cpu import build

SOURCE = r"""
#include "kiln_rt.h"
extern "C" int kiln_entry(void* const* buf, const KilnRuntime* rt) { return 0; }
"""


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_cache_hit_does_not_run_the_compiler(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs: list[list[str]] = []
    real = build.run_compiler

    def counting(cmd: list[str]) -> None:
        runs.append(cmd)
        real(cmd)

    monkeypatch.setattr(build, "run_compiler", counting)
    so, hit = build.compile_program(SOURCE, return_cache_hit=True)
    assert not hit and len(runs) == 1 and so.parent == cache / "programs"
    mtime = so.stat().st_mtime_ns
    again, hit = build.compile_program(SOURCE, return_cache_hit=True)
    assert hit and again == so and len(runs) == 1 and so.stat().st_mtime_ns == mtime
    assert build.compile_program(SOURCE + "\n// changed\n") != so and len(runs) == 2
    # only finished files are visible: the .so files and their sources, no temp folders
    names = sorted(p.suffix for p in (cache / "programs").iterdir())
    assert names == [".cpp", ".cpp", ".so", ".so"]


def test_compiler_flags_and_key() -> None:
    assert "-ffast-math" not in build.PROGRAM_FLAGS
    for flag in ("-O3", "-march=native", "-ffp-contract=fast", "-fno-math-errno", "-fPIC"):
        assert flag in build.PROGRAM_FLAGS
    assert build.program_key(SOURCE) == build.program_key(SOURCE)
    assert build.program_key(SOURCE) != build.program_key(SOURCE + " ")


def test_compile_error_shows_compiler_message(cache: Path) -> None:
    with pytest.raises(build.KilnCompileError, match="undeclared_thing"):
        build.compile_program("int f() { return undeclared_thing; }\n")
    assert not list((cache / "programs").glob("*.so"))


def test_isa_matches_cpu_flags() -> None:
    flags = set(build.cpu_flags())
    assert build.isa() == ("avx512" if "avx512f" in flags else "avx2")
    assert "avx2" in flags and "fma" in flags


@pytest.mark.runtime_build
@pytest.mark.serial  # timed: alone on the machine
def test_runtime_loads_from_disk_cache_quickly(runtime: ModuleType) -> None:
    assert hasattr(runtime, "Program")
    start = time.perf_counter()
    again = build.load_runtime.__wrapped__()  # bypass the in-process cache: disk only
    assert time.perf_counter() - start < 1.0
    assert again.Program is not None
