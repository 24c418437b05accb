"""Native builds shared by every part of kiln that compiles C++.

The compiler (``$CXX`` or g++), this CPU's vector-ISA flags (``isa()``: "avx512" or
"avx2"; an AVX-512 build is never loaded on an AVX2-only machine because the flags are in
every cache key), the shared SIMD headers in ``include/`` (``kiln_vec*.h``, used by the
compiler's generated programs, the weight-only kernels and the decode step), content
hashes, and ``load_plain_extension`` for the hand-written CPython extensions. Builds land
in ``cache_dir()`` (``$KILN_CACHE_DIR`` or ``~/.cache/kiln``).
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

import torch

from kiln.core.cache import cache_dir

INCLUDE = Path(__file__).resolve().parent / "include"  # the shared SIMD headers
# /proc/cpuinfo flags that change what -march=native may emit (vector ISA extensions).
_ISA_PREFIXES = ("avx", "fma", "f16c", "bmi", "sse", "ssse", "amx", "vaes", "vpclmul", "gfni")


class KilnCompileError(RuntimeError):
    """The C++ compiler rejected a generated program; the message holds its output."""


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
def compiler_version(cxx: str) -> str:
    """``cxx --version``'s text (cached): part of every build key."""
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def header_digest(paths: Sequence[Path]) -> str:
    """sha256 over the names and bytes of ``paths`` (missing ones are skipped)."""
    h = hashlib.sha256()
    for path in paths:
        if path.exists():
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def import_extension(name: str, path: Path) -> ModuleType:
    """Import the built extension module ``name`` from the shared library at ``path``."""
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def run_compiler(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise KilnCompileError(
            f"compiling a kiln program failed ({' '.join(cmd)}):\n{proc.stderr.strip()}"
        )


# ------------------------------------------------------------------ hand-written extensions
def extension_key(sources: Sequence[Path], flags: Sequence[str]) -> str:
    """Cache key of a hand-written C++ extension (woq, decode): its sources, the flags,
    compiler, CPU features, ISA and the torch and Python versions."""
    h = hashlib.sha256()
    for part in (
        *(path.read_text() for path in sources),
        " ".join(flags),
        compiler_version(compiler()),
        " ".join(cpu_flags()),
        isa(),
        torch.__version__,
        sys.version,
        str(sysconfig.get_config_var("EXT_SUFFIX")),
    ):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def load_plain_extension(
    name: str, sources: Sequence[Path], flags: Sequence[str], include_dirs: Sequence[Path] = ()
) -> ModuleType:
    """Compile ``sources[0]`` (a Python extension module ``kiln_<name>_ext`` written against
    the CPython API only) once into the cache folder, keyed by ``extension_key``, and
    import it. The rest of ``sources`` are the headers it includes (they only enter the
    key, so list every one); the include path is ``sources[0]``'s folder, then
    ``include_dirs``, then ``INCLUDE``. Raises KilnCompileError when the compiler fails,
    RuntimeError on a CPU without AVX2+FMA. The .so appears by atomic rename, so
    concurrent builds are safe."""
    isa()  # raises on a CPU without AVX2+FMA
    out_dir = cache_dir() / name
    out_dir.mkdir(parents=True, exist_ok=True)
    so_path = out_dir / f"kiln_{name}_{extension_key(sources, flags)[:24]}.so"
    if not so_path.exists():
        include = sysconfig.get_paths()["include"]
        with tempfile.TemporaryDirectory(dir=out_dir, prefix=".build-") as tmp:
            tmp_so = Path(tmp) / "ext.so"
            here = sources[0].parent
            dirs = (here, *include_dirs, INCLUDE)
            cmd = [compiler(), *flags, f"-I{include}", *(f"-I{d}" for d in dirs), str(sources[0])]
            proc = subprocess.run([*cmd, "-o", str(tmp_so)], capture_output=True, text=True)
            if proc.returncode != 0:
                raise KilnCompileError(
                    f"building kiln's {name} extension failed ({' '.join(cmd)}):\n"
                    f"{proc.stderr.strip()}"
                )
            os.replace(tmp_so, so_path)
    return import_extension(f"kiln_{name}_ext", so_path)


def _widest() -> str:
    return isa()


PLAIN_FLAGS = (
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-std=c++17",
)
ISA_FLAGS = {"avx512": (), "avx2": ("-mno-avx512f",)}  # added to -march=native for another ISA


class IsaExtension:
    """A plain C++ extension (``load_plain_extension``) that can be built for either ISA on
    one host, so both code paths are tested on an AVX-512 machine. Another ISA than this
    CPU's widest is built under its own module name (CPython keeps one single-phase module
    per name), passed to the source as the macro ``macro``."""

    def __init__(self, name: str, sources: Sequence[Path], macro: str, what: str) -> None:
        self.name, self.sources, self.macro, self.what = name, tuple(sources), macro, what
        self._loaded: dict[str, ModuleType] = {}

    def checked_isa(self, isa: str | None) -> str:
        """``isa`` checked ("avx512" / "avx2"), None: this CPU's widest."""
        here = _widest()  # raises on a CPU without AVX2+FMA
        want = here if isa is None else isa
        if want not in ISA_FLAGS:
            raise ValueError(f"isa must be one of {list(ISA_FLAGS)} or None, got {isa!r}")
        if want == "avx512" and here != "avx512":
            raise RuntimeError(f"the AVX-512 {self.what} need a CPU with AVX-512F")
        return want

    def build(self, isa: str) -> tuple[str, tuple[str, ...]]:
        """(extension name, flags) for a checked ``isa``."""
        if isa == _widest():
            return self.name, PLAIN_FLAGS
        name = f"{self.name}_{isa}"
        return name, (*PLAIN_FLAGS, *ISA_FLAGS[isa], f"-D{self.macro}=kiln_{name}_ext")

    def key(self, isa: str | None = None) -> str:
        """Cache key of the extension built for ``isa``."""
        return extension_key(self.sources, self.build(self.checked_isa(isa))[1])

    def load(self, isa: str | None = None) -> ModuleType:
        """The extension for ``isa`` (None: this CPU's widest), compiled on first use and
        cached on disk."""
        want = self.checked_isa(isa)
        if want not in self._loaded:
            name, flags = self.build(want)
            self._loaded[want] = load_plain_extension(name, self.sources, flags)
        return self._loaded[want]
