"""``--gguf`` of the decode and prefill benchmarks and the quant-type table
(``kiln.bench.gguf_variants``, ``kiln.bench.gguf_quants``): argument parsing, the file reaching
a plugged-in decode contender's worker, the tables, and llama.cpp's quantizer on a tiny file
when ``llama_cpp`` is installed."""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from kiln.bench import gguf_quants, llm_decode, prefill
from kiln.bench.gguf_variants import file_type, gguf_arg, gguf_file, quantize, tensor_types
from kiln.bench.llm_decode_peers import Generation, build

HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
HERE = "tests.bench.test_gguf_quants"


def write_small_gguf(path: Path) -> Path:
    """A GGUF file of two tensors (Q8_0, F32) that says it is a Q8_0 file; no model."""
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    q = gguf.GGMLQuantizationType.Q8_0
    w.add_tensor("a.weight", gguf.quants.quantize(np.ones((4, 64), np.float32), q), raw_dtype=q)
    w.add_tensor("b.weight", np.zeros(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_arg_names_paths_and_errors(tmp_path: Path) -> None:
    assert gguf_arg("Q8_0") == "q8_0" and gguf_arg("q4_k_m") == "q4_k_m"
    assert gguf_arg("q4_1") == "q4_1"  # the catalog file itself
    f = write_small_gguf(tmp_path / "small.gguf")
    assert gguf_arg(str(f)) == str(f.resolve()) and gguf_file(str(f)) == f.resolve()
    with pytest.raises(argparse.ArgumentTypeError, match="neither a quant type .q4_0, q8_0"):
        gguf_arg("q9_9")
    with pytest.raises(argparse.ArgumentTypeError, match="nor an existing .gguf file"):
        gguf_arg(str(tmp_path / "missing.gguf"))


@pytest.mark.parametrize(
    ("main", "argv"),
    [(llm_decode.main, ["--gguf", "q5_x"]), (prefill.main, ["--gguf", "q5_x"]),
     (gguf_quants.main, ["--qtypes", "q4_0,q5_x"])],
)  # fmt: skip
def test_bad_gguf_name_stops_each_command(
    main: Callable[[list[str]], int], argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert "is neither a quant type" in capsys.readouterr().err


def test_file_type_and_tensor_types(tmp_path: Path) -> None:
    f = write_small_gguf(tmp_path / "small.gguf")
    assert file_type(f) == "q8_0" and tensor_types(f) == {"Q8_0": 1, "F32": 1}


class _FileFake:
    """A torch-free contender that takes a GGUF file: 1 ms a step, its file name in facts."""

    def __init__(self, gguf: str | None) -> None:
        self.gguf = gguf

    def prepare(self, batches: Sequence[int], max_len: int) -> dict[str, Any]:
        return {"weight_bytes": 10**6, "kv_bytes_per_position": 100,
                "file": Path(self.gguf).name if self.gguf else None}  # fmt: skip

    def generate(self, prompt: Sequence[int], n_new: int, batch: int) -> Generation:
        t0 = time.perf_counter()
        time.sleep(0.001 * n_new)
        t1 = time.perf_counter()
        return Generation(t1 - t0, t1 - t0, t1 - t0, [[0] * n_new])


def file_contender(gguf: str | None = None) -> _FileFake:
    return _FileFake(gguf)


def test_build_refuses_a_contender_without_a_file_option() -> None:
    with pytest.raises(ValueError, match="'hf' cannot run on a given GGUF file"):
        build("hf", "x.gguf")
    c = build(f"{HERE}:file_contender", "x.gguf")
    assert isinstance(c, _FileFake) and c.gguf == "x.gguf"


def test_run_decode_passes_the_file_to_the_worker(tmp_path: Path) -> None:
    f = write_small_gguf(tmp_path / "small.gguf")
    result = llm_decode.run_decode(
        [f"{HERE}:file_contender"], [1], n_new=3, repeats=1, out_dir=tmp_path,
        prompt_ids=[7, 8], bandwidth_mb=16, quiet_wait_s=0.1, gguf=gguf_arg(str(f)),
        log=lambda s: None,
    )  # fmt: skip
    assert Path(result["path"]).name.endswith("-q8_0.json")  # the quant type in the name
    saved = json.loads(Path(result["path"]).read_text())
    assert saved["contenders"][f"{HERE}:file_contender"]["file"] == "small.gguf"
    assert saved["gguf"] == {"file": "small.gguf", "file_type": "q8_0",
                             "tensor_types": {"Q8_0": 1, "F32": 1}}  # fmt: skip
    md = Path(result["markdown_path"]).read_text()
    assert "GGUF file small.gguf (q8_0): Q8_0 x1, F32 x1." in md


def _decode(kiln: float | None, llama: float) -> dict[str, Any]:
    results = [{"contender": "llamacpp", "batch": 1, "decode_tokens_per_s": llama}]
    results.append({"contender": "kiln-int4", "batch": 1, "rounds": [], "error": "boom"}
                   if kiln is None else
                   {"contender": "kiln-int4", "batch": 1, "decode_tokens_per_s": kiln})  # fmt: skip
    return {
        "path": "results/decode-x-q8_0.json", "results": results,
        "gguf": {"file": "m.Q8_0.gguf", "file_type": "q8_0", "tensor_types": {"Q8_0": 211}},
        "contenders": {"llamacpp": {}, "kiln-int4": {"dtype": "GGUF as stored, packed (Q8_0 x211)"}},
    }  # fmt: skip


def _prefill(kiln: float, llama: float) -> dict[str, Any]:
    return {"path": "results/prefill-x-q8_0.json", "contenders": {
        "llamacpp": {}, "kiln-after": {}}, "results": [
        {"contender": "llamacpp", "length": 512, "tokens_per_s": llama},
        {"contender": "kiln-after", "length": 512, "tokens_per_s": kiln}]}  # fmt: skip


def test_quant_table_rows_and_markdown() -> None:
    rows = [gguf_quants.collect("q8_0", _decode(80.0, 100.0), _prefill(600.0, 400.0)),
            gguf_quants.collect("q8_0", _decode(None, 100.0), _prefill(600.0, 400.0))]  # fmt: skip
    assert rows[0]["decode"] == {"llamacpp": 100.0, "kiln": 80.0, "ratio": 0.8}
    assert rows[0]["prefill"]["ratio"] == 1.5 and rows[0]["errors"] == []
    assert rows[1]["decode"]["ratio"] is None and rows[1]["errors"] == ["kiln-int4: boom"]
    result = {
        "device": {"name": "CPU", "isa": "avx512"}, "threads": 2, "date": "2026-01-01T00:00",
        "batch": 1, "n_new": 64, "repeats": 3, "length": 512, "prefill_repeats": 5,
        "rows": rows,
    }  # fmt: skip
    md = gguf_quants.render_markdown(json.loads(json.dumps(result)))
    assert "CPU (avx512, 2 threads)" in md
    assert "| q8_0 | 100.0 | 80.0 | 0.80 | 400 | 600 | 1.50 |" in md
    assert "| q8_0 | 100.0 | – | – | 400 | 600 | 1.50 |" in md
    assert "m.Q8_0.gguf: Q8_0 x211; kiln: GGUF as stored, packed (Q8_0 x211)" in md
    assert "  * error: kiln-int4: boom" in md


@pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="llama-cpp-python (the bench extra) not installed")
def test_llama_cpp_quantizes_a_tiny_model(tmp_path: Path) -> None:
    from tests.models.families import write_tiny_gguf

    source = write_tiny_gguf(tmp_path / "tiny.gguf")  # Q4_1, Q4_0, Q8_0, F16, F32 tensors
    out = tmp_path / "tiny.Q8_0.gguf"
    quantize(source, out, "q8_0")
    assert file_type(out) == "q8_0" and set(tensor_types(out)) == {"Q8_0", "F32"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.Q8_0.gguf", "tiny.gguf"]  # no temp
