"""The architecture is checked, not hoped for: the import contracts in pyproject.toml hold on
kiln as it is, and they catch a wrong import when one is added (so the check is live)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")
KILN = REPO / "kiln"

pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed")


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    """Run the repo's contracts over the ``kiln`` package found in ``root``."""
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}
    cmd = [str(LINT), "--no-cache", "--no-logo", str(REPO / "pyproject.toml")]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(KILN, tmp_path / "kiln", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_contracts_hold() -> None:
    out = _lint(REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        # a low layer reaching up: core must not know about the LLM stack
        ("kiln/core/cache.py", "import kiln.llm.generate", "only the parts below"),
        # the large-model stack must not use the small-model compiler
        ("kiln/models/config.py", "import kiln.compiler.api", "never imports the small-model"),
        # a later compiler stage imported by an earlier one
        ("kiln/compiler/ir/graph.py", "import kiln.compiler.exec.report", "pipeline order"),
        # a cycle between two sibling modules of one package
        ("kiln/compress/obs.py", "import kiln.compress.verbs", "no import cycles"),
    ],
)
def test_a_wrong_import_is_caught(tmp_path: Path, module: str, line: str, broken: str) -> None:
    root = _copy(tmp_path)
    path = root / module
    path.write_text(path.read_text() + f"\n{line}  # the wrong import under test\n")
    out = _lint(root)
    assert out.returncode != 0, out.stdout
    broken_section = out.stdout.split("Broken contracts", 1)[-1]
    assert broken in broken_section, out.stdout
