"""SmolLM2 GGUF files of other quant types, for benchmarking kiln and llama.cpp on them.

``python -m kiln.bench.gguf_variants q4_0 q8_0 q4_k_m`` prints each file's path and how many
of its tensors are stored in each type.

The catalog holds one real GGUF file, SmolLM2-135M-Instruct in Q4_1
(``kiln.models.catalog.smollm2_gguf_path``). ``variant_path("q8_0")`` makes its Q8_0 sibling
with llama.cpp's own quantizer (``llama_cpp.llama_model_quantize``, ``allow_requantize``) and
keeps it under the kiln cache, ``<cache>/gguf-variants/``, made once and reused. llama.cpp
requantizes from the Q4_1 blocks dequantized to fp32, so these are test files holding the same
weights for both runtimes, not the quants published for the model (those start from bf16).
llama.cpp also picks per tensor: in a Q4_K_M file some tensors are Q6_K, and a tensor whose
rows are not whole 256-value super-blocks (SmolLM2's hidden size is 576) falls back to a
32-block type such as Q5_0 or Q8_0; ``tensor_types`` shows what each file really holds.

``--gguf`` of the decode and prefill benchmarks takes ``gguf_arg``: a path, or one of the
names in ``QTYPES`` (the variants) or ``ORIGINAL`` (the catalog file itself).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from kiln.core.cache import cache_dir

QTYPES: dict[str, str] = {
    "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
    "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
    "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
}
ORIGINAL = "q4_1"  # the catalog file as it is
THREADS = 2


def gguf_arg(text: str) -> str:
    """``--gguf``'s argparse type: a quant-type name (lower-cased) or an existing ``.gguf``
    file (absolute). Nothing is made here: ``gguf_file`` makes a variant when it is used."""
    name = text.lower()
    if name in QTYPES or name == ORIGINAL:
        return name
    path = Path(text).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return str(path.resolve())
    names = ", ".join([*QTYPES, ORIGINAL])
    raise argparse.ArgumentTypeError(
        f"--gguf {text!r} is neither a quant type ({names}) nor an existing .gguf file"
    )


def gguf_file(spec: str) -> Path:
    """The file a ``gguf_arg`` value names, the variant made on first use."""
    if spec in QTYPES or spec == ORIGINAL:
        return variant_path(spec)
    return Path(spec)


def variant_path(qtype: str) -> Path:
    """SmolLM2 as a ``qtype`` file (``QTYPES`` or ``ORIGINAL``), quantized on first use."""
    from kiln.models.catalog import smollm2_gguf_path

    qtype = qtype.lower()
    source = smollm2_gguf_path()
    if qtype == ORIGINAL:
        return source
    if qtype not in QTYPES:
        raise ValueError(f"unknown quant type {qtype!r}: one of {', '.join([*QTYPES, ORIGINAL])}")
    base = source.name.removesuffix(".gguf").rsplit(".", 1)[0]  # SmolLM2-135M-Instruct
    out = cache_dir("gguf-variants") / f"{base}.{qtype.upper()}.gguf"
    if not (out.is_file() and out.stat().st_size > 0):
        quantize(source, out, qtype)
    return out


def quantize(source: Path, out: Path, qtype: str) -> None:
    """Write ``source`` requantized to ``qtype`` as ``out`` with llama.cpp's quantizer
    (through a temporary name, so a half-written file is never taken for a made one)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, QTYPES[qtype])
    params.nthread = THREADS
    params.allow_requantize = True
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    try:
        rc = llama_cpp.llama_model_quantize(
            str(source).encode(), str(tmp).encode(), ctypes.byref(params)
        )
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize({source.name} -> {qtype}) returned {rc}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def tensor_types(path: str | Path) -> dict[str, int]:
    """How many of the file's tensors are stored in each type, most first."""
    from gguf import GGUFReader

    counts = Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors)
    return dict(counts.most_common())


def file_type(path: str | Path) -> str:
    """The file's quant type as llama.cpp names its ``general.file_type`` ("q4_k_m"); the
    file name's stem when the key is missing or unknown."""
    from gguf import GGUFReader, LlamaFileType

    field = GGUFReader(str(path)).get_field("general.file_type")
    try:
        name = LlamaFileType(int(field.contents())).name if field is not None else ""
    except ValueError:
        name = ""
    return name.removeprefix("MOSTLY_").lower() or Path(path).stem.lower()


def describe(path: str | Path) -> dict[str, Any]:
    """What a result records about a GGUF file: its name, quant type and tensor types."""
    return {"file": Path(path).name, "file_type": file_type(path),
            "tensor_types": tensor_types(path)}  # fmt: skip


def format_types(types: dict[str, int]) -> str:
    """``{"Q8_0": 211, "F32": 61}`` as "Q8_0 x211, F32 x61"."""
    return ", ".join(f"{name} x{n}" for name, n in types.items())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kiln.bench.gguf_variants", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("qtypes", nargs="+", type=gguf_arg, help=f"{', '.join(QTYPES)} or {ORIGINAL}")
    args = p.parse_args(argv)
    for spec in args.qtypes:
        path = gguf_file(spec)
        print(f"{path} ({path.stat().st_size / 1e6:.1f} MB): {format_types(tensor_types(path))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
