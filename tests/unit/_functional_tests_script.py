"""scripts/megatron_lm_functional_tests.py as a module, loaded once, for the tests of its JSON
and of its end-to-end sample (scripts/ is not a package)."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

PATH = Path(__file__).resolve().parents[2] / "scripts" / "megatron_lm_functional_tests.py"


@functools.cache
def functional_tests_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("megatron_lm_functional_tests", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # before running it, as importing it would
    spec.loader.exec_module(module)
    return module
