"""`import megatron_ext` refuses a torch or megatron-core outside the versions platform/ was
checked with, in one line naming the package, its version and the range (platform/versions.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.platform import versions
from megatron_ext.platform.versions import CHECKED, UnsupportedVersion, require_checked_versions

PLATFORM = Path(versions.__file__).parent


def _installed_as(monkeypatch, package: str, version: str) -> None:
    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda p: version if p == package else real(p))


@pytest.mark.parametrize(
    "package, version, line",
    [
        pytest.param("torch", "2.15.0", "torch 2.15.0 is not supported: megatron_ext's uses of its internals (megatron_ext/platform/) were checked with torch 2.11 to 2.14", id="torch_newer"),
        pytest.param("torch", "2.10.0", "torch 2.10.0 is not supported: megatron_ext's uses of its internals (megatron_ext/platform/) were checked with torch 2.11 to 2.14", id="torch_older"),
        pytest.param("torch", "2.15.0a0+git", "torch 2.15.0a0+git is not supported: megatron_ext's uses of its internals (megatron_ext/platform/) were checked with torch 2.11 to 2.14", id="torch_prerelease"),
        pytest.param("megatron-core", "0.17.0", "megatron-core 0.17.0 is not supported: megatron_ext's uses of its internals (megatron_ext/platform/) were checked with megatron-core 0.16", id="megatron_newer"),
        pytest.param("megatron-core", "0.15.2", "megatron-core 0.15.2 is not supported: megatron_ext's uses of its internals (megatron_ext/platform/) were checked with megatron-core 0.16", id="megatron_older"),
    ],
)
def test_a_version_outside_the_checked_range_is_one_line(monkeypatch, package, version, line):
    _installed_as(monkeypatch, package, version)
    with pytest.raises(UnsupportedVersion) as refused:
        require_checked_versions()
    assert str(refused.value) == line


@pytest.mark.parametrize(
    "package, version",
    [
        ("torch", "2.11.0+cu130"),
        ("torch", "2.12.1"),
        ("torch", "2.13.0+cpu"),
        ("torch", "2.14.1+cu128"),
        ("megatron-core", "0.16.0"),
        ("megatron-core", "0.16.1rc1"),
    ],
)
def test_versions_inside_the_range_pass(monkeypatch, package, version):
    _installed_as(monkeypatch, package, version)
    require_checked_versions()


def test_the_installed_versions_pass():
    require_checked_versions()


def test_every_row_names_a_platform_module_that_reads_it():
    """A row is the versions its module was checked against: the module exists and says so."""
    for use in CHECKED:
        module = PLATFORM / f"{use}.py"
        assert module.is_file(), f"versions.CHECKED[{use!r}] names no platform module"
        assert f'CHECKED["{use}"]' in module.read_text(), f"platform/{use}.py does not refer to its row"


def test_import_megatron_ext_refuses_before_importing_torch():
    """The refusal comes at `import megatron_ext`, from the version check, before torch or
    megatron is imported (importlib.metadata answers torch 2.15.0 in that process)."""
    fake = (
        "import importlib.metadata as m, sys; real = m.version; "
        "m.version = lambda p: '2.15.0' if p == 'torch' else real(p)\n"
        "try:\n    import megatron_ext\n"
        "except ImportError as e:\n    print(type(e).__name__, e, 'torch' in sys.modules); raise SystemExit(3)\n"
    )
    done = subprocess.run([sys.executable, "-c", fake], capture_output=True, text=True, env=os.environ, timeout=60)
    assert done.returncode == 3, done.stderr
    assert done.stdout.strip() == (
        "UnsupportedVersion torch 2.15.0 is not supported: megatron_ext's uses of its internals "
        "(megatron_ext/platform/) were checked with torch 2.11 to 2.14 False"
    )
