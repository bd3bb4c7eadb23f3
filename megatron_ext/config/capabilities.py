"""What a plugin does to a run, declared as data, and which of those cannot meet in one run.

A plugin declares its capabilities on its section (`PluginSection.capabilities`,
config/plugin_sections.py), so that the configuration knows them without importing the plugin.
`CONFLICTS` is the one table of combinations that cannot work, each with its reason;
`refusals` derives from it, for the plugins a run lists, which pairs are refused. No plugin names
another: a new plugin that declares what it does composes with every other one, or is refused
beside it, by this table alone.

Where a hook says a capability exactly (`HOOKS`), overriding the hook is declaring it: a plugin
registered by its class alone gets the capabilities its hooks imply, and a plugin class whose
torch-free section leaves out one its hooks imply is refused at registration (megatron_ext/
plugin.py), since validation reads the section without the class.

docs/writing-a-plugin.md shows both tables, written by `python -m megatron_ext.config.plugin_tables`.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional


class Capability(str, enum.Enum):
    """One thing a plugin does to a run; its value says it in words."""

    REWRITES_LAYER_SPECS = "swaps layers of every model built through the layer spec"
    EDITS_BUILT_MODEL = "freezes, wraps or replaces modules of the built model before DDP sees it"
    OWNS_STEP = "runs each step's forward-backward in place of megatron's schedule"
    OWNS_RUN = "supplies what every worker runs, around the Trainer or instead of it (a worker pool, a loop of its own)"
    REPLACES_TRAINER_LOOP = "trains in a loop of its own: no Trainer, so no other plugin's hook runs"
    CHANGES_LAYOUT = "moves the running job to another parallel layout, carrying the Trainer's model chunks and optimizer"
    STANDBY_WORKERS = "lets a run start on a layout smaller than its world: the other workers wait on standby"
    HOLDS_EXTRA_MODULES = "holds modules of its own beside the Trainer's model chunks (e.g. a frozen teacher)"
    CHANGES_LOSS = "computes each step's loss its own way (e.g. distillation)"
    SHARES_BASE = "trains many jobs at once on one shared, frozen base model"
    ADDS_CHECKPOINT_STATE = "saves state of its own with every checkpoint"


Capabilities = frozenset[Capability]


# The hook whose override means the capability, for every capability a hook says exactly.
HOOKS: Mapping[str, Capability] = {
    "layer_spec": Capability.REWRITES_LAYER_SPECS,
    "after_model_built": Capability.EDITS_BUILT_MODEL,
    "forward_backward_func": Capability.OWNS_STEP,
    "runner": Capability.OWNS_RUN,
    "state_dict": Capability.ADDS_CHECKPOINT_STATE,
}


@dataclass(frozen=True)
class Conflict:
    """A plugin with `first` cannot run beside one with `second` (None: beside any other plugin).
    `reason` names them `{first}` and `{second}`."""

    first: Capability
    second: Optional[Capability]
    reason: str


CONFLICTS: tuple[Conflict, ...] = (
    Conflict(Capability.REPLACES_TRAINER_LOOP, None,
             "{first} trains in a loop of its own, not the Trainer's: {second}'s hooks would be ignored; "
             "run {second} without {first}"),
    Conflict(Capability.OWNS_RUN, Capability.OWNS_RUN,
             "{first} and {second} each supply what every worker runs (runner): a run can have one of them"),
    Conflict(Capability.OWNS_STEP, Capability.OWNS_STEP,
             "{first} and {second} each run the training step (forward_backward_func): the Trainer runs one, "
             "the other's would be ignored; a run can use one of them"),
    Conflict(Capability.CHANGES_LAYOUT, Capability.HOLDS_EXTRA_MODULES,
             "{second} with {first} is not supported: {first} moves the running job to another layout, carrying "
             "the Trainer's model chunks and optimizer only, and {second} holds modules of its own beside them "
             "(e.g. a frozen teacher) that the move would leave behind"),
)


def _refusal(a: tuple[str, Capabilities], b: tuple[str, Capabilities]) -> Optional[str]:
    """The reason of the first rule of `CONFLICTS` that plugins `a` and `b`, each (name,
    capabilities), meet in either order; None when they compose."""
    for rule in CONFLICTS:
        for (first, has), (second, other_has) in ((a, b), (b, a)):
            if rule.first in has and (rule.second is None or rule.second in other_has):
                return rule.reason.format(first=first, second=second)
    return None


def refusals(plugins: Iterable[tuple[str, Capabilities]]) -> list[str]:
    """Why the plugins listed, each (name, capabilities) in the run's order, cannot run together:
    one sentence per refused pair, naming both plugins; [] when they compose."""
    pairs = itertools.combinations(dict(plugins).items(), 2)
    return [reason for a, b in pairs if (reason := _refusal(a, b)) is not None]
