"""What the configuration knows of each plugin, without importing the plugin: its config
section, the checks that need nothing but the config, and its capabilities
(config/capabilities.py), from which the plugins it composes with follow.

A plugin that ships with megatron_ext keeps these in `megatron_ext/<name>/config.py`, a module
that imports no torch and ends with `SECTION = PluginSection(...)`; composing and validating a
config imports those modules only. A plugin registered anywhere else (`megatron_ext.plugin.
register_plugin`) adds a section made from its class; its checks then run on an instance of it.

A check is `check(own, cfg, world_size)`: `own` is the plugin's section of the run's config (an
instance of `config_class`), `cfg` the run's whole config, `world_size` the number of processes.
It raises a ConfigError (or ValueError) for a setting that cannot work.
"""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Callable, Optional

from megatron_ext.config.capabilities import Capabilities

# The plugins that ship with megatron_ext: each one's section is `megatron_ext.<name>.config`'s
# SECTION, and its class sits in `megatron_ext.<name>.plugin`.
BUILTIN = ("reshard", "dpp", "elastic", "lora")
# Plugins of other packages: the modules their `megatron_ext.plugins` entry points name, and
# those listed in this environment variable (comma-separated; every launched worker inherits
# it). Each is imported before a config is composed, and registers its plugin there.
PLUGINS_ENV = "MEGATRON_EXT_PLUGINS"
ENTRY_POINTS = "megatron_ext.plugins"

Check = Callable[[Any, Any, int], None]


def no_check(own: Any, cfg: Any, world_size: int) -> None:
    """The check of a plugin with nothing to check."""


@dataclass(frozen=True)
class PluginSection:
    name: str
    # A dataclass that becomes the top-level config section `<name>` (None: no section).
    config_class: Optional[type] = None
    # Before any process starts, in the launching process.
    check: Check = no_check
    # For every parallel layout the run trains on (`cfg.parallel`): its first, each one a
    # reshard schedule names, and a live move's target before it moves.
    check_layout: Check = no_check
    # What the plugin does to a run (config/capabilities.py): which plugins it composes with
    # follows from them.
    capabilities: Capabilities = frozenset()

    def own(self, cfg: Any) -> Any:
        """This plugin's section of `cfg`; its defaults where `cfg` has none (a config built
        from the plain schema rather than composed)."""
        own = getattr(cfg, self.name, None)
        if own is None and self.config_class is not None:
            return self.config_class()
        return own


_REGISTERED: dict[str, PluginSection] = {}


@functools.cache
def builtin_sections() -> dict[str, PluginSection]:
    return {name: importlib.import_module(f"megatron_ext.{name}.config").SECTION for name in BUILTIN}


def register_section(section: PluginSection) -> None:
    """Make `section` known to the configuration: its config class becomes a section of the
    schema (for configs composed after this) and its checks run on every run that lists it."""
    known = plugin_sections().get(section.name)
    if known is not None and known is not section:
        raise ValueError(f"two plugins are named {section.name!r}")
    _REGISTERED[section.name] = section


def plugin_sections() -> dict[str, PluginSection]:
    """Every plugin the configuration knows, by name: the builtin ones, those of other packages
    and those registered."""
    import_external_plugins()
    return {**builtin_sections(), **_REGISTERED}


def external_plugin_modules() -> list[str]:
    """The modules of other packages' plugins (`ENTRY_POINTS`, then `PLUGINS_ENV`)."""
    modules = [entry.module for entry in metadata.entry_points(group=ENTRY_POINTS)]
    return modules + [m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",") if m.strip()]


_imported: set[str] = set()


def import_external_plugins() -> None:
    """Import each module of `external_plugin_modules` once (it registers its plugin)."""
    for module in external_plugin_modules():
        if module not in _imported:
            _imported.add(module)  # first: its registration asks for the sections again
            try:
                importlib.import_module(module)
            except ImportError as e:
                raise ImportError(f"plugin module {module!r} ({PLUGINS_ENV} or a {ENTRY_POINTS} entry point): {e}") from e
