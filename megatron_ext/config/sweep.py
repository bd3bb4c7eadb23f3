"""A Hydra multirun's command line read as the runs it sweeps over, with Hydra's own override
parser and basic sweeper, without composing them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser


@dataclass(frozen=True)
class Sweep:
    swept: list[str]  # the keys that vary
    combinations: list[list[str]]  # the overrides of each run
    # Launcher or hydra.* options (hydra/launcher=...): Hydra runs such a multirun itself.
    hydra_options: bool


def read_sweep(argv: Sequence[str]) -> Sweep:
    """The sweep of a multirun command line (its flags, such as -m, left out)."""
    parsed = OverridesParser.create().parse_overrides([a for a in argv if not a.startswith("-")])
    return Sweep(
        swept=[o.key_or_group for o in parsed if o.is_sweep_override()],
        combinations=[c for batch in BasicSweeper.split_arguments(parsed, None) for c in batch],
        hydra_options=any(o.key_or_group.startswith("hydra") for o in parsed),
    )
