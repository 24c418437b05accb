"""Build the compiler's CPU code: the runtime extension (once per machine) and generated programs.

* the **runtime extension** (``runtime.cpp``, pybind11 + ATen) that loads and calls generated
  programs. It takes ~30 s to build, so it is built once into the cache directory and later
  imported straight from the built ``.so`` (well under a second).
* **generated programs**: one C++ file per model that includes only kiln's headers (this
  folder's ``kiln_rt.h`` / ``kiln_gemm.h`` and the shared ``kiln_vec*.h`` of
  ``kiln.core.native.INCLUDE``), compiled with plain ``g++`` in ~1-2 s and cached by a
  content hash.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Literal, overload

import torch

from kiln.core.cache import cache_dir
from kiln.core.native import (
    INCLUDE,
    KilnCompileError,
    compiler,
    compiler_version,
    cpu_flags,
    header_digest,
    import_extension,
    isa,
    run_compiler,
)

HERE = Path(__file__).resolve().parent
HEADERS = (
    HERE / "kiln_rt.h",
    HERE / "kiln_gemm.h",
    HERE / "kiln_rnn.h",
    INCLUDE / "kiln_vec.h",
    INCLUDE / "kiln_vec_pow.h",
    INCLUDE / "kiln_vec_trig.h",
)
# NOT -ffast-math: nan and inf must survive. -fno-math-errno lets sqrt inline.
PROGRAM_FLAGS = (
    "-O3",
    "-march=native",
    "-ffp-contract=fast",
    "-fno-math-errno",
    "-fno-semantic-interposition",  # direct calls to the program's own inline functions
    "-shared",
    "-fPIC",
    "-std=c++17",
)
__all__ = [
    "PROGRAM_FLAGS",
    "KilnCompileError",
    "compile_program",
    "cpu_flags",
    "isa",
    "load_runtime",
    "program_key",
    "run_compiler",
]


def program_key(source: str) -> str:
    """Cache key of a generated program: sha256 over everything that changes its binary."""
    cxx = compiler()
    h = hashlib.sha256()
    for part in (
        source,
        " ".join(PROGRAM_FLAGS),
        compiler_version(cxx),
        torch.__version__,
        " ".join(cpu_flags()),
        header_digest(HEADERS),
    ):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


@overload
def compile_program(source: str) -> Path: ...
@overload
def compile_program(source: str, return_cache_hit: Literal[False]) -> Path: ...
@overload
def compile_program(source: str, return_cache_hit: Literal[True]) -> tuple[Path, bool]: ...


def compile_program(source: str, return_cache_hit: bool = False) -> Path | tuple[Path, bool]:
    """Compile generated C++ ``source`` to a shared library and return its path.

    The .so is cached under ``<cache>/programs/<sha256>.so``; a later call with the same
    source, flags, compiler, torch version, CPU ISA and kiln headers returns it without
    running the compiler. The file appears by an atomic rename, so concurrent compiles of
    the same program never expose a half-written library. Raises KilnCompileError with the
    compiler's message when compilation fails. With ``return_cache_hit=True`` returns
    ``(path, hit)`` where ``hit`` says the compiler was not run.
    """
    key = program_key(source)
    out_dir = cache_dir("programs")
    out_dir.mkdir(parents=True, exist_ok=True)
    so_path = out_dir / f"{key}.so"
    if so_path.exists():
        return (so_path, True) if return_cache_hit else so_path
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=f".{key[:16]}-") as tmp:
        src = Path(tmp) / "program.cpp"
        src.write_text(source)
        tmp_so = Path(tmp) / "program.so"
        cmd = [compiler(), *PROGRAM_FLAGS, f"-I{HERE}", f"-I{INCLUDE}", str(src), "-o", str(tmp_so)]
        run_compiler(cmd)
        os.replace(src, out_dir / f"{key}.cpp")  # kept next to the .so for debugging
        os.replace(tmp_so, so_path)
    return (so_path, False) if return_cache_hit else so_path


def _runtime_sources() -> list[Path]:
    return [HERE / "runtime.cpp"]


def _runtime_name() -> str:
    h = hashlib.sha256()
    for part in (torch.__version__, sys.version, compiler_version(compiler())):
        h.update(part.encode() + b"\0")
    for path in _runtime_sources():
        h.update(path.read_bytes())
    h.update(header_digest((HERE / "kiln_rt.h",)).encode())
    return f"kiln_runtime_{h.hexdigest()[:16]}"


@functools.cache
def load_runtime() -> ModuleType:
    """The runtime extension module (``Program``), built on first use and cached on disk.

    The build directory name is a hash of runtime.cpp, kiln_rt.h, torch, Python and the
    compiler, so any change rebuilds; an existing build is imported directly.
    """
    name = _runtime_name()
    build_dir = cache_dir() / "runtime" / name
    built = build_dir / f"{name}.so"
    # torch's build holds a "lock" file in the build directory while it runs; a .so seen
    # during another process's build may be half-linked, so then go through load() and wait.
    if built.exists() and not (build_dir / "lock").exists():
        return import_extension(name, built)
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    # torch.utils.cpp_extension serialises concurrent builds of one directory with a lock.
    module = cpp_extension.load(
        name=name,
        sources=[str(p) for p in _runtime_sources()],
        extra_cflags=["-O3", "-fopenmp", f"-I{HERE}", f"-I{INCLUDE}"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        verbose=False,
    )
    return module
