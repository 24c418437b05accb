"""Build kiln's CPU code: the runtime extension (once per machine) and generated programs.

Two kinds of native code live here:

* the **runtime extension** (``runtime.cpp``, pybind11 + ATen) that loads and calls generated
  programs. It takes ~30 s to build, so it is built once into the cache directory and later
  imported straight from the built ``.so`` (well under a second).
* **generated programs**: one C++ file per model that includes only the kiln headers of this
  folder, compiled with plain ``g++`` in ~1-2 s and cached by a content hash.

The cache directory is ``$KILN_CACHE_DIR`` or ``~/.cache/kiln``.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Literal, overload

import torch

HERE = Path(__file__).resolve().parent
HEADERS = ("kiln_rt.h", "kiln_vec.h", "kiln_vec_pow.h", "kiln_vec_trig.h", "kiln_gemm.h")
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
# /proc/cpuinfo flags that change what -march=native may emit (vector ISA extensions).
_ISA_PREFIXES = ("avx", "fma", "f16c", "bmi", "sse", "ssse", "amx", "vaes", "vpclmul", "gfni")


class KilnCompileError(RuntimeError):
    """The C++ compiler rejected a generated program; the message holds its output."""


def cache_dir() -> Path:
    """The kiln cache directory ($KILN_CACHE_DIR or ~/.cache/kiln), created if missing."""
    root = Path(os.environ.get("KILN_CACHE_DIR") or Path.home() / ".cache" / "kiln")
    root.mkdir(parents=True, exist_ok=True)
    return root


@functools.cache
def cpu_flags() -> tuple[str, ...]:
    """Sorted vector-ISA flags of this CPU from /proc/cpuinfo (empty when unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = line.split(":", 1)[1].split()
            return tuple(sorted(f for f in flags if f.startswith(_ISA_PREFIXES)))
    return ()


def isa() -> str:
    """The vector ISA kiln generates code for here: "avx512" or "avx2".

    Raises RuntimeError on a CPU without AVX2+FMA (kiln's headers need at least that).
    """
    flags = set(cpu_flags())
    if "avx512f" in flags:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    raise RuntimeError("kiln's CPU backend needs an x86-64 CPU with AVX2+FMA or AVX-512F")


def compiler() -> str:
    """The C++ compiler used for generated programs ($CXX or g++)."""
    return os.environ.get("CXX", "g++")


@functools.cache
def _compiler_version(cxx: str) -> str:
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def _header_digest(names: tuple[str, ...] = HEADERS) -> str:
    h = hashlib.sha256()
    for name in names:
        path = HERE / name
        if path.exists():
            h.update(name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def program_key(source: str) -> str:
    """Cache key of a generated program: sha256 over everything that changes its binary."""
    cxx = compiler()
    h = hashlib.sha256()
    for part in (
        source,
        " ".join(PROGRAM_FLAGS),
        _compiler_version(cxx),
        torch.__version__,
        " ".join(cpu_flags()),
        _header_digest(),
    ):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _run_compiler(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise KilnCompileError(
            f"compiling a kiln program failed ({' '.join(cmd)}):\n{proc.stderr.strip()}"
        )


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
    out_dir = cache_dir() / "programs"
    out_dir.mkdir(parents=True, exist_ok=True)
    so_path = out_dir / f"{key}.so"
    if so_path.exists():
        return (so_path, True) if return_cache_hit else so_path
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=f".{key[:16]}-") as tmp:
        src = Path(tmp) / "program.cpp"
        src.write_text(source)
        tmp_so = Path(tmp) / "program.so"
        cmd = [compiler(), *PROGRAM_FLAGS, f"-I{HERE}", str(src), "-o", str(tmp_so)]
        _run_compiler(cmd)
        os.replace(src, out_dir / f"{key}.cpp")  # kept next to the .so for debugging
        os.replace(tmp_so, so_path)
    return (so_path, False) if return_cache_hit else so_path


def _runtime_sources() -> list[Path]:
    return [HERE / "runtime.cpp"]


def _runtime_name() -> str:
    h = hashlib.sha256()
    for part in (torch.__version__, sys.version, _compiler_version(compiler())):
        h.update(part.encode() + b"\0")
    for path in _runtime_sources():
        h.update(path.read_bytes())
    h.update(_header_digest(("kiln_rt.h",)).encode())
    return f"kiln_runtime_{h.hexdigest()[:16]}"


def _import_so(name: str, path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


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
        return _import_so(name, built)
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    # torch.utils.cpp_extension serialises concurrent builds of one directory with a lock.
    module = cpp_extension.load(
        name=name,
        sources=[str(p) for p in _runtime_sources()],
        extra_cflags=["-O3", "-fopenmp", f"-I{HERE}"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        verbose=False,
    )
    return module


# ------------------------------------------------------------------ hand-written extensions
def extension_key(sources: Sequence[Path], flags: Sequence[str]) -> str:
    """Cache key of a hand-written C++ extension (woq, decode): its sources, the flags,
    compiler, CPU features, ISA and the torch and Python versions."""
    h = hashlib.sha256()
    for part in (
        *(path.read_text() for path in sources),
        " ".join(flags),
        _compiler_version(compiler()),
        " ".join(cpu_flags()),
        isa(),
        torch.__version__,
        sys.version,
        str(sysconfig.get_config_var("EXT_SUFFIX")),
    ):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def load_plain_extension(name: str, sources: Sequence[Path], flags: Sequence[str]) -> ModuleType:
    """Compile ``sources[0]`` (a Python extension module ``kiln_<name>_ext`` written against
    the CPython API only) once into the cache folder, keyed by ``extension_key``, and
    import it. Raises KilnCompileError when the compiler fails, RuntimeError on a CPU
    without AVX2+FMA. The .so appears by atomic rename, so concurrent builds are safe."""
    isa()  # raises on a CPU without AVX2+FMA
    out_dir = cache_dir() / name
    out_dir.mkdir(parents=True, exist_ok=True)
    so_path = out_dir / f"kiln_{name}_{extension_key(sources, flags)[:24]}.so"
    if not so_path.exists():
        include = sysconfig.get_paths()["include"]
        with tempfile.TemporaryDirectory(dir=out_dir, prefix=".build-") as tmp:
            tmp_so = Path(tmp) / "ext.so"
            here = sources[0].parent
            cmd = [compiler(), *flags, f"-I{include}", f"-I{here}", str(sources[0])]
            proc = subprocess.run([*cmd, "-o", str(tmp_so)], capture_output=True, text=True)
            if proc.returncode != 0:
                raise KilnCompileError(
                    f"building kiln's {name} extension failed ({' '.join(cmd)}):\n"
                    f"{proc.stderr.strip()}"
                )
            os.replace(tmp_so, so_path)
    module_name = f"kiln_{name}_ext"
    loader = importlib.machinery.ExtensionFileLoader(module_name, str(so_path))
    spec = importlib.util.spec_from_file_location(module_name, so_path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module
