"""Every data file of the package is shipped: each non-Python file under megatron_ext/ matches a
pattern of pyproject.toml's package-data (the globs setuptools expands), so a moved or added data
file (dpp's length histograms, the Hydra configs) cannot silently drop out of an installed copy.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

SOURCE_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = SOURCE_ROOT / "megatron_ext"


def shipped_patterns() -> list[str]:
    with open(SOURCE_ROOT / "pyproject.toml", "rb") as file:
        return tomllib.load(file)["tool"]["setuptools"]["package-data"]["megatron_ext"]


def data_files() -> set[Path]:
    """The package's files that are not Python source or its bytecode cache."""
    return {
        path for path in PACKAGE.rglob("*")
        if path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts
    }


def test_every_data_file_is_in_package_data():
    shipped = {path for pattern in shipped_patterns() for path in PACKAGE.glob(pattern)}
    missing = sorted(str(path.relative_to(PACKAGE)) for path in data_files() - shipped)
    assert not missing, f"not in pyproject.toml's [tool.setuptools.package-data]: {missing}"


def test_lengths_reads_its_histograms_from_inside_the_package():
    # The check above is empty-handed if the histograms are not where the scan looks.
    from megatron_ext.dpp.planning.lengths import DATA_DIR

    histograms = set(DATA_DIR.glob("lengths_*.json"))
    assert histograms and histograms <= data_files()
