"""What a benchmark needs beyond megatron_ext's own dependencies, checked when it starts.

A benchmark measures for minutes to hours and draws at the end; a package missing for the
drawing (matplotlib for `--plot`) or for one measurement must end it before it measures, not
after. Each script calls `require` right after reading its arguments, naming what this run
needs and why; a package that does not import ends it there, in one line that names the extra
of pyproject.toml that installs it, with exit code 2 (argparse's for a command that cannot run).
Every script writes its JSON before it draws, so a drawing that fails anyway loses no measurement.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Optional

# importable module -> the extra of pyproject.toml that installs it
EXTRA_OF = {"matplotlib": "bench", "ortools": "lora", "transformers": "test"}


def _imports(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def require(script: str, needs: dict[str, Optional[str]]) -> None:
    """Exit 2 with one line when a module this run needs does not import. `needs`: module ->
    what needs it in this run (e.g. "--plot"), or None where this run does not."""
    missing = {module: why for module, why in needs.items() if why and not _imports(module)}
    if missing:
        extras = ",".join(sorted({EXTRA_OF[module] for module in missing}))
        what = "; ".join(f"{why} needs {module}" for module, why in missing.items())
        print(f"{Path(script).name}: {what}, which does not import here: pip install -e '.[{extras}]'", file=sys.stderr)
        raise SystemExit(2)
