"""patches/ and scripts/check_patches.py: an upstream diff for every runtime fix of
megatron_ext.platform.cpu_compat, each applying to megatron-core 0.16.1 (that all of them apply,
compile and import is checked where test_platform_cpu_compat.py builds the patched copy)."""

from __future__ import annotations

import difflib
import importlib.metadata
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.platform import cpu_compat

REPO = Path(__file__).resolve().parents[2]
PATCHES = REPO / "patches"
SCRIPT = REPO / "scripts" / "check_patches.py"


def check_patches(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120
    )


def test_every_runtime_fix_has_a_numbered_patch_with_a_header_and_a_readme_row():
    patches = sorted(PATCHES.glob("*.diff"))
    expected = [f"{i:04d}-{fix.name}.diff" for i, fix in enumerate(cpu_compat.FIXES, start=1)]
    assert [p.name for p in patches] == expected
    readme = (PATCHES / "README.md").read_text()
    for patch in patches:
        header = patch.read_text().split("\n--- a/", 1)[0]
        assert len(header.strip().splitlines()) >= 3, f"{patch.name}: no header saying what and why"
        assert re.search(rf"^\| `{patch.name}` \|", readme, re.M), f"{patch.name}: no README row"


def package_info_diff(old: str, new: str) -> str:
    """A diff of megatron/core/package_info.py that replaces `old` by `new` (for `old` not in
    the file: one that does not apply)."""
    installed = Path(importlib.util.find_spec("megatron.core").origin).parent / "package_info.py"
    before = installed.read_text().replace("PATCH = 1\n", old)
    after = before.replace(old, new)
    relpath = "megatron/core/package_info.py"
    return "".join(
        difflib.unified_diff(
            before.splitlines(True), after.splitlines(True), f"a/{relpath}", f"b/{relpath}"
        )
    )


@pytest.mark.parametrize(
    "old, new, failure",
    [
        ("PATCH = 7\n", "PATCH = 8\n", "FAILED 9999-broken.diff"),
        ("PATCH = 1\n", "PATCH = = 1\n", "FAILED compile megatron/core/package_info.py"),
        ("PATCH = 1\n", "PATCH = 1\nimport megatron.core.no_such_module\n", "FAILED import"),
    ],
    ids=["does-not-apply", "syntax-error", "import-error"],
)
def test_a_broken_patch_fails_the_check(tmp_path, old, new, failure):
    patches = tmp_path / "patches"
    shutil.copytree(PATCHES, patches)
    broken = "A deliberately broken patch.\n\n" + package_info_diff(old, new)
    (patches / "9999-broken.diff").write_text(broken)
    done = check_patches("--patches", str(patches))
    assert done.returncode == 1
    assert failure in " ".join(done.stdout.split()), done.stdout


def test_another_megatron_core_version_is_skipped_with_a_warning(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("check_patches", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.17.0")
    assert script.main([]) == 0
    warning = "WARNING: megatron-core 0.17.0 is installed; patches/ targets 0.16.1"
    assert warning in capsys.readouterr().out
