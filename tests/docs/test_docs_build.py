"""The documentation site builds with `mkdocs build --strict` (warnings are errors: a broken
link or anchor, a page missing from the nav). `slow`: the build takes 3-15 s here, and .ci/run
runs the same build before the tests."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.docs._markdown import REPO


def _missing() -> list[str]:
    """The docs extra's modules that do not import here."""
    missing = []
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # its parent package is absent
            found = False
        if not found:
            missing.append(module)
    return missing


MISSING = _missing()


@pytest.mark.slow
@pytest.mark.skipif(bool(MISSING), reason=f"the docs extra is not installed ({', '.join(MISSING)}): pip install -e '.[docs]'")
def test_mkdocs_build_strict(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
