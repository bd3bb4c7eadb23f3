"""The documentation site builds with `mkdocs build --strict` (warnings are errors: a broken
link or anchor, a page missing from the nav)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.docs._markdown import REPO


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                    reason="mkdocs is not installed: pip install -e '.[docs]'")
def test_mkdocs_build_strict(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
