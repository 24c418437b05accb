"""``kiln compile`` on a user's own model: a ``file.py:Class`` or ``module:Class`` with
input shapes, a ``torch.export.save`` file, the JSON report, and clear usage errors."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kiln.cli import app

MODELS = """
import torch


class Net(torch.nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(width, width)

    def forward(self, x, ids):
        return torch.nn.functional.gelu(self.fc(x)).softmax(-1) + ids.float().sum()


class Branchy(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x


class NeedsWidth(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
"""


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["compile", *args])
    return result.exit_code, result.output


@pytest.fixture
def models(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "user_models.py"
    path.write_text(MODELS)
    yield path
    sys.modules.pop("user_models", None)


def test_a_class_in_a_file_compiles_and_prints_the_report(models: Path) -> None:
    code, out = invoke(f"{models}:Net", "--input-shape", "4,16", "--input-shape", "4:int64")
    assert code == 0, out
    assert "kiln: Net: " in out and "verification: ok" in out
    assert "template" in out and "gemm" in out  # the kernel table


def test_a_module_class_compiles_with_a_json_report(
    models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(models.parent)
    result = CliRunner().invoke(
        app, ["compile", "user_models:Net", "--input-shape", "4,16",
              "--input-shape", "4:int64", "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["model"] == "Net" and report["verification"].startswith("ok")
    assert report["inputs"] == [
        {"shape": [4, 16], "dtype": "torch.float32"},
        {"shape": [4], "dtype": "torch.int64"},
    ]
    assert report["kernels"] and report["solver"]["status"] == "optimal"


def test_an_exported_program_file_compiles(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()).eval()
    path = tmp_path / "tiny.pt2"
    torch.export.save(torch.export.export(model, (torch.randn(3, 8),)), path)
    code, out = invoke(str(path))
    assert code == 0, out
    assert "kiln: tiny.pt2: " in out and "verification: ok" in out
    code, out = invoke(str(path), "--input-shape", "5,8")  # exported with static sizes
    assert code == 2 and "exported with shape [3, 8]" in out, out


def test_a_model_with_data_dependent_control_flow_says_where(models: Path) -> None:
    code, out = invoke(f"{models}:Branchy", "--input-shape", "4,8")
    assert code == 1
    line = MODELS.splitlines().index("        if x.sum() > 0:") + 1
    assert f"{models}:{line} in forward: if x.sum() > 0:" in out, out
    assert 'torch.compile(model, backend="kiln")' in out


@pytest.mark.parametrize(
    ("target", "args", "says"),
    [
        ("{dir}/missing.pt2", [], "no such file"),
        ("{dir}/user_models.py:Nope", ["--input-shape", "4"], "has no 'Nope'; its models: Branchy"),
        ("{dir}/user_models.py:Net", [], "give the model's input shapes"),
        ("{dir}/user_models.py:NeedsWidth", ["--input-shape", "4"], "with no arguments"),
        ("{dir}/user_models.py", [], "as {dir}/user_models.py:ClassName"),
        ("no_such_module_xyz:Net", ["--input-shape", "4"], "cannot import module"),
        ("{dir}/user_models.py:Net", ["--input-shape", "4,x"], "bad input shape"),
        ("{dir}/user_models.py:Net", ["--input-shape", "4", "--dtype", "f8"], "unknown dtype"),
        ("not_a_suite_model", [], "unknown model 'not_a_suite_model'"),
    ],
    ids=["missing", "no-class", "no-shape", "needs-args", "no-name", "no-module",
         "bad-shape", "bad-dtype", "unknown"],
)  # fmt: skip
def test_clear_usage_errors(models: Path, target: str, args: list[str], says: str) -> None:
    code, out = invoke(target.format(dir=models.parent), *args)
    assert code == 2, out
    assert squash(says.format(dir=models.parent)) in squash(out), out  # rich wraps in a box


def squash(text: str) -> str:
    return "".join(c for c in text if c not in " \n│╭╮╰╯─")
