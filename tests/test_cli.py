"""The kiln command line: help text and a compile of a suite model."""

from __future__ import annotations

from typer.testing import CliRunner

from kiln.cli import app


def test_help_lists_the_commands() -> None:
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("demo", "compile", "bench", "calibrate"):
        assert command in result.output


def test_compile_prints_report_and_kernel_table() -> None:
    result = CliRunner().invoke(app, ["compile", "tcnn_mlp", "--profile"])
    assert result.exit_code == 0, result.output
    assert "solver blp: optimal" in result.output
    assert "meas us" in result.output
    assert "gemm" in result.output or "chain" in result.output  # one GEMM kernel or a chain
