"""The public verbs: every name in ``kiln.__all__`` resolves, and ``import kiln`` loads none
of kiln's parts until a verb is used."""

from __future__ import annotations

import subprocess
import sys

import kiln


def test_every_public_name_resolves() -> None:
    for name in kiln.__all__:
        assert getattr(kiln, name) is not None, name


def test_import_kiln_is_light() -> None:
    code = "import sys, kiln; print(sorted(m for m in sys.modules if m.startswith('kiln.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_verbs_are_the_parts_own() -> None:
    from kiln.compiler.api import compile as compile_
    from kiln.compress.verbs import quantize_
    from kiln.llm.generate import generate

    assert kiln.compile is compile_ and kiln.quantize_ is quantize_ and kiln.generate is generate
