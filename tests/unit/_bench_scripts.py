"""Importing a script of scripts/bench/ by name, as the scripts import each other (and as a
process they spawn finds them): their folder on sys.path while the module is in use."""

from __future__ import annotations

import contextlib
import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator

BENCH = str(Path(__file__).parents[2] / "scripts" / "bench")


@contextlib.contextmanager
def bench_script(name: str) -> Iterator[ModuleType]:
    sys.path.insert(0, BENCH)
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(BENCH)
