"""`kiln generate` / `kiln run` end to end on a tiny checkpoint with its own tokenizer:
every path (eager, fast C++ step, disk offload, tensor parallel) gives the tokens that
greedy decoding with transformers gives."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kiln.cli import app
from kiln.deploy.generate_job import GenerateRequest, generate_text
from kiln.llm.generate import Sampling
from tests.models.families import VOCAB, hf_greedy, random_model

PROMPT = "It is a truth"
NEW = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen2 (q/k/v biases, tied head, GQA, one sliding-window layer) saved by
    transformers, plus a byte-level tokenizer with one token per byte (VOCAB = 256; the
    Qwen2 tokenizer class transformers picks for this folder reads it as is)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tiny-qwen2")
    random_model("qwen2").save_pretrained(folder)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    assert len(alphabet) == VOCAB
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)
    return folder


def encode(text: str) -> list[int]:
    """The fixture tokenizer, independently: one token per byte, ids in alphabet order."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    byte_chars = pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(text)
    return [alphabet.index(c) for piece, _ in byte_chars for c in piece]


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> list[int]:
    """transformers' greedy continuation of PROMPT."""
    from tests.models.families import load_reference

    ids = torch.tensor([encode(PROMPT)])
    _, tokens = hf_greedy(load_reference(checkpoint), ids, NEW - 1)  # NEW chosen tokens
    return tokens.tolist()


def request(checkpoint: Path, **kw: object) -> GenerateRequest:
    return GenerateRequest(
        checkpoint=str(checkpoint),
        prompt=PROMPT,
        max_new_tokens=NEW,
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("engine", ["eager", "auto"])
def test_single_process_matches_transformers(
    checkpoint: Path, reference: list[int], engine: str
) -> None:
    result = generate_text(request(checkpoint, engine=engine))
    assert result.generation.tokens[0].tolist() == reference
    from transformers import AutoTokenizer

    assert result.text == AutoTokenizer.from_pretrained(checkpoint).decode(reference)
    assert result.generation.ttft_s > 0 and len(result.generation.step_s) == NEW - 1


def test_offloaded_to_disk_matches_transformers(
    checkpoint: Path, reference: list[int], tmp_path: Path
) -> None:
    result = generate_text(request(checkpoint, offload=str(tmp_path / "store")))
    assert "streamed" in result.engine
    assert result.generation.tokens[0].tolist() == reference


def test_tensor_parallel_ranks_match_transformers(checkpoint: Path, reference: list[int]) -> None:
    result = generate_text(request(checkpoint, tp=2, timeout_s=90.0))
    assert result.generation.tokens[0].tolist() == reference
    assert len(result.generation.step_s) == NEW - 1


def test_pipeline_parallel_ranks_sample_as_one_process(checkpoint: Path) -> None:
    sampling = Sampling(temperature=1.2, top_k=50, top_p=0.95, seed=4)
    one = generate_text(request(checkpoint, engine="eager", sampling=sampling))
    ranks = generate_text(request(checkpoint, pp=2, sampling=sampling, timeout_s=90.0))
    assert torch.equal(ranks.generation.tokens, one.generation.tokens)
    assert ranks.text == one.text


def test_speculative_matches_transformers(checkpoint: Path, reference: list[int]) -> None:
    result = generate_text(request(checkpoint, speculate=3))
    assert result.generation.tokens[0].tolist() == reference
    assert "speculative" in result.engine and "accepted" in result.engine
    assert len(result.generation.step_s) == NEW - 1
    sampled = generate_text(request(checkpoint, speculate=3, sampling=Sampling(0.8, seed=0)))
    again = generate_text(request(checkpoint, speculate=3, sampling=Sampling(0.8, seed=0)))
    assert sampled.generation.tokens.shape == (1, NEW)
    assert torch.equal(sampled.generation.tokens, again.generation.tokens)  # seeded


def test_requests_that_cannot_run_are_refused(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="one process"):
        request(checkpoint, pp=2, offload="x")
    with pytest.raises(ValueError, match="engine"):
        request(checkpoint, engine="turbo")
    with pytest.raises(ValueError, match="one process"):
        request(checkpoint, speculate=2, tp=2)


def test_cli_prints_text_and_timing(checkpoint: Path) -> None:
    env = {**os.environ, "COLUMNS": "200"}
    res = CliRunner().invoke(
        app, ["generate", str(checkpoint), "--prompt", PROMPT, "-n", "4"], env=env
    )
    assert res.exit_code == 0, res.output
    assert "tokens/s" in res.output and "time to first token" in res.output
    bad = CliRunner().invoke(app, ["generate", str(checkpoint), "--engine", "turbo"], env=env)
    assert bad.exit_code != 0 and "engine" in bad.output
    missing = CliRunner().invoke(app, ["generate", str(checkpoint / "nope.gguf")], env=env)
    assert missing.exit_code == 2 and "error:" in missing.output and "nope.gguf" in missing.output


def test_cli_prints_the_torchrun_line_for_several_machines(checkpoint: Path) -> None:
    args = ["run", str(checkpoint), "--tp", "2", "--pp", "2", "--nnodes", "2",
            "--rdzv-endpoint", "10.0.0.1:29500"]  # fmt: skip
    res = CliRunner().invoke(app, args, env={**os.environ, "COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    assert "--nnodes=2" in res.output and "--nproc-per-node=2" in res.output
    assert "--rdzv-endpoint=10.0.0.1:29500" in res.output and "kiln.cli" in res.output


def _plan_file(checkpoint: Path, folder: Path, fmt: str, tp: int, pp: int, offload: str) -> Path:
    """A plan document for one layout of the fixture model, as ``kiln plan --out`` writes."""
    import json

    from kiln.deploy.architecture import read_architecture
    from kiln.deploy.estimate import FORMATS, Layout
    from kiln.deploy.hardware import Device, parse_hardware
    from kiln.deploy.plan_schema import plan_to_dict
    from kiln.deploy.planner import Plan, Request, evaluate

    arch = read_architecture(str(checkpoint))
    cpu = Device("cpu", "cpu", 16 * 2**30, 40.0, {"fp32": 0.2}, "shared-memory", 0.0)
    hw = parse_hardware(f"{tp * pp}xcpu" if tp * pp > 1 else "cpu", cpu=cpu)
    req = Request(batch=1, prompt_len=16, gen_len=NEW)
    lay = Layout(FORMATS[fmt], tp * pp, tp, pp, 1, 16, NEW, offload, 4)
    doc = plan_to_dict(Plan(arch, req, evaluate(arch, hw, lay, req)), str(checkpoint))
    path = folder / f"plan-{fmt}-{tp}x{pp}-{offload}.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize(("tp", "pp", "offload"), [(1, 1, "none"), (2, 1, "none"),
                                                   (1, 2, "none"), (1, 1, "disk")])  # fmt: skip
def test_kiln_run_executes_a_plan_file(
    checkpoint: Path, reference: list[int], tmp_path: Path, tp: int, pp: int, offload: str
) -> None:
    """An fp32 plan is the checkpoint's own weights: every layout gives transformers' text."""
    from kiln.deploy.plan_job import request_from_plan
    from kiln.deploy.plan_schema import load_plan

    path = _plan_file(checkpoint, tmp_path, "fp32", tp, pp, offload)
    req = request_from_plan(load_plan(str(path)), PROMPT, NEW, str(tmp_path / "store"))
    assert (req.tp, req.pp, req.weights, req.offload is not None) == (
        tp,
        pp,
        "fp32",
        offload == "disk",
    )
    assert generate_text(req).generation.tokens[0].tolist() == reference
    res = CliRunner().invoke(app, ["run", str(path), "--prompt", PROMPT, "-n", "4"],
                             env={**os.environ, "COLUMNS": "200"})  # fmt: skip
    assert res.exit_code == 0, res.output
    assert f"tp {tp}, pp {pp}, weights fp32" in res.output and "tokens/s" in res.output


def test_a_compressed_plan_runs_the_same_text_on_ranks_as_in_one_process(
    checkpoint: Path, tmp_path: Path
) -> None:
    from kiln.deploy.plan_job import request_from_plan
    from kiln.deploy.plan_schema import load_plan

    texts = []
    for tp in (1, 2):
        doc = load_plan(str(_plan_file(checkpoint, tmp_path, "int8", tp, 1, "none")))
        req = request_from_plan(doc, PROMPT, NEW)
        texts.append(generate_text(req).generation.tokens[0].tolist())
    assert texts[0] == texts[1]


def test_plans_this_machine_cannot_run_are_refused(checkpoint: Path, tmp_path: Path) -> None:
    import json

    from kiln.deploy.plan_job import request_from_plan

    doc = json.loads(_plan_file(checkpoint, tmp_path, "fp32", 1, 1, "disk").read_text())
    with pytest.raises(ValueError, match="folder for the store"):
        request_from_plan(doc, PROMPT, NEW)
    if not torch.cuda.is_available():
        doc["layout"]["device_type"] = "H100"
        with pytest.raises(ValueError, match="no GPU"):
            request_from_plan(doc, PROMPT, NEW, str(tmp_path))
