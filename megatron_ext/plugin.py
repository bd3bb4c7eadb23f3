"""The plugin protocol: the only thing the Trainer knows about plugins.

A plugin is a class with a `name`, an optional `config_class` (a dataclass that becomes the
top-level config section `<name>`), and any of the hooks below. The Trainer calls the hooks of
the plugins listed in `cfg.plugins`, in that order. Hooks are small and named; plugins never
reach into each other.

    @register_plugin
    class MyPlugin(Plugin):
        name = "mine"
        config_class = MyConfig

        def on_step_end(self, ctx: PluginContext, step: int, metrics: dict) -> None: ...

Every hook that runs inside a Trainer receives the plugin's `PluginContext` (plugin_context.py):
what a plugin may read of the run and, for a plugin that declares `Capability.CHANGES_LAYOUT`,
the Trainer's layout controller, never the Trainer itself.

The configuration knows a plugin by its section (config/plugin_sections.py): its config class,
the checks `check` / `check_layout`, which need nothing but the config, and its capabilities
(config/capabilities.py: what it does to a run, from which the plugins it composes with follow).
A plugin that keeps them in a torch-free module (as each builtin one does in its `config.py`)
names that module's section as its `section`, and takes its name, config class, checks and
capabilities from it; then composing and validating a config never imports the plugin's own
module. A hook that says a capability exactly (`capabilities.HOOKS`: overriding `layer_spec`
rewrites the layer specs) declares it: a class without a section gets it, and registering a
class whose section leaves it out is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import TYPE_CHECKING, Any, Callable, Optional

from megatron_ext.config.capabilities import HOOKS, Capabilities
from megatron_ext.config.plugin_sections import BUILTIN, PluginSection, import_external_plugins, no_check, register_section
from megatron_ext.config.sweep import Sweep
from megatron_ext.plugin_context import PluginContext

if TYPE_CHECKING:
    from megatron.core.transformer.spec_utils import ModuleSpec


@dataclasses.dataclass(frozen=True)
class Runner:
    """What each worker of a run does, when a plugin owns the run rather than the Trainer's
    loop (a packed LoRA sweep, a worker pool whose size changes)."""

    run: Callable[[Any], dict]  # the run's config -> its summary
    # Whether a pre-emption signal stops it at a step boundary with a checkpoint (the launcher
    # then waits up to launcher.preempt_timeout_s for the workers); False: the workers end on
    # the signal as any process does.
    stops_at_a_step: bool = True


class Plugin:
    """Base class with no-op hooks; override the ones you need.

    A subclass sets `name` (the entry of `plugins=[...]` that selects it) and, for options, a
    `config_class` (a dataclass that becomes the config section `<name>`), and is made selectable
    by `register_plugin`. Instances are built with their config section (`self.cfg`) in the
    launching process and on each rank. The launching process calls `check` and `check_layout` (and `runner`, `multirun`) before
    anything starts; each rank's Trainer then calls, in the order of `cfg.plugins`: `setup`,
    `layer_spec` and `after_model_built` while it builds the model (and again for each new layout),
    `load_state_dict` on resume, `forward_backward_func` for each step's passes, `on_step_begin`
    and `on_step_end` around each step, `state_dict` with every checkpoint and `on_train_end` at
    the end. Those that take a `ctx` receive the plugin's `PluginContext`.
    """

    name: str = ""
    config_class: Optional[type] = None
    # What the plugin does to a run (config/capabilities.py), beside what its hooks imply.
    capabilities: Capabilities = frozenset()
    # Whether the Trainer reads each step's loss before `on_step_end` (else on log steps only,
    # saving a host sync per step): a plugin whose `on_step_end` reads `metrics["loss"]`, or
    # that changes the layout between steps (losses are read in the layout that computed them).
    needs_step_loss: bool = False
    # The plugin's config section and checks, kept in a torch-free module: `name`,
    # `config_class`, `capabilities` and the checks are then the section's.
    section: Optional[PluginSection] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "section" in vars(cls):
            cls.name, cls.config_class, cls.capabilities = cls.section.name, cls.section.config_class, cls.section.capabilities
        else:  # the section is made from the class: its hooks declare what they imply
            cls.capabilities = frozenset(cls.capabilities) | hook_capabilities(cls)

    def __init__(self, cfg: Any = None) -> None:
        # The plugin's own config section (an instance of `config_class`), or None.
        self.cfg = cfg

    @classmethod
    def multirun(cls, sweep: Sweep, first: Any) -> Optional[tuple[Any, Callable[[], Any]]]:
        """A Hydra multirun whose first run (`first`, composed) lists this plugin, run as one run
        of the plugin's own: (the config to check before launch; what runs them all), or None
        to leave the multirun to Hydra. `sweep`: its combinations (config/sweep.py). Raise
        ValueError for a sweep it refuses."""
        return None

    def runner(self) -> Optional[Runner]:
        """Own the run: every worker runs the returned Runner instead of the Trainer's loop.
        A run may list one plugin that does."""
        return None

    def check(self, cfg: Any, world_size: int) -> None:
        """Before any process starts (in the launching process): raise a ConfigError or
        ValueError for a setting that cannot work with the run's config `cfg` on `world_size`
        processes, so that bad input stops the run before anything is launched or written."""
        if self.section is not None:
            self.section.check(self._own(), cfg, world_size)

    def check_layout(self, cfg: Any, world_size: int) -> None:
        """Raise a ConfigError or ValueError for a parallel layout or model (`cfg.parallel`,
        `cfg.model`) this plugin cannot train: called for the run's first layout before any
        process starts, for each layout a reshard schedule names, and before a live reshard
        moves the run (a request refused this way leaves the run where it is)."""
        if self.section is not None:
            self.section.check_layout(self._own(), cfg, world_size)

    def _own(self) -> Any:
        """The plugin's config section: the one it was built with, else its defaults."""
        if self.cfg is None and self.config_class is not None:
            return self.config_class()
        return self.cfg

    def setup(self, ctx: PluginContext) -> None:
        """After the world exists, before the tokenizer, data and model are built: the place to
        read `ctx.cfg` and `ctx.layout` and make the plugin's own process groups or state.
        Called on every rank, once per `Trainer.setup`."""

    def layer_spec(self, spec: ModuleSpec, ctx: PluginContext) -> ModuleSpec:
        """Swap layers through megatron's ModuleSpec (elastic modules, LoRA linears): receives
        the decoder layer's spec as the Trainer (or the previous plugin) made it and returns the
        spec to build, e.g. with a submodule replaced by the plugin's class. Called whenever a
        model is built, for every layout."""
        return spec

    def after_model_built(self, model_chunks: list, ctx: PluginContext) -> list:
        """Before DDP wrapping: freeze, wrap or replace modules. `model_chunks` are the bare
        megatron modules of this rank (one per virtual pipeline stage), already initialised or
        loaded from `model.pretrained`; return the chunks to use, which DDP then wraps and the
        optimizer sees (frozen parameters get no gradient buffer and no optimizer state)."""
        return model_chunks

    def forward_backward_func(self, ctx: PluginContext) -> Optional[Callable]:
        """Supply the forward/backward function of a step (same signature as megatron's
        `get_forward_backward_func()` result), or None to keep megatron's schedule."""
        return None

    def on_step_begin(self, ctx: PluginContext, step: int) -> None:
        """Between steps, before step `step` (1-based) runs: gradients are zero and no pass is in
        flight, so this is the one hook that may change the layout (`ctx.layout_controller`:
        install, release, roll back), the data or the model, and where preparing a layout ahead
        starts. When a hook moves this
        rank out of the job (`ctx.layout` becomes None), the loop ends on that rank."""

    def on_step_end(self, ctx: PluginContext, step: int, metrics: dict) -> None:
        """After the optimizer step of `step` (1-based), before it is logged: `metrics` is the
        step's dict (`Trainer.train_step`: loss, lr, grad_norm, ...); on a step the fp16 loss
        scaler skipped the keys grad_norm and num_zeros_in_grad are absent (nothing measured)."""

    def state_dict(self) -> dict:
        """Extra state saved with every checkpoint under `plugins.<name>` of its common state:
        plain, picklable values, the same on all ranks (one copy is written). Returns an empty dict when the plugin has nothing to keep."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned: on resume from a checkpoint (not with
        `checkpoint.finetune`), after the model and optimizer are loaded, and when a rank joins a
        running job (`LayoutController.join`, `catch_up`); `state` is empty when the checkpoint was
        written without this plugin."""

    def on_train_end(self, ctx: PluginContext) -> None:
        """After the last step, the final checkpoint and the final evaluation, on every rank
        still in the job: the place for exports and reports (elastic's nested checkpoint)."""


_REGISTRY: dict[str, type[Plugin]] = {}


def register_plugin(cls: type[Plugin]) -> type[Plugin]:
    """Class decorator: make a plugin selectable with `plugins=[<cls.name>]`."""
    if not cls.name:
        raise ValueError(f"plugin class {cls.__qualname__} has no `name`")
    if _REGISTRY.get(cls.name) is cls:
        return cls
    if cls.name in _REGISTRY:
        raise ValueError(f"two plugins are named {cls.name!r}: {_REGISTRY[cls.name]} and {cls}")
    missing = hook_capabilities(cls) - cls.capabilities
    undeclared = [(hook, c) for hook, c in HOOKS.items() if c in missing]
    if undeclared:  # validation reads the section without the class: it would not know them
        raise ValueError(
            f"plugin {cls.name!r} overrides " + ", ".join(f"{hook} ({c.name})" for hook, c in undeclared)
            + " but its section does not declare " + ", ".join(f"Capability.{c.name}" for _, c in undeclared)
            + ": add it to the section's capabilities")
    register_section(cls.section or section_of(cls))
    _REGISTRY[cls.name] = cls
    return cls


def hook_capabilities(cls: type[Plugin]) -> Capabilities:
    """The capabilities that the hooks `cls` overrides imply (`capabilities.HOOKS`)."""
    return frozenset(c for hook, c in HOOKS.items() if getattr(cls, hook) is not getattr(Plugin, hook))


def section_of(cls: type[Plugin]) -> PluginSection:
    """The section of a plugin class that has no torch-free one: its checks run on an instance
    of the class, built with the run's section of the config."""
    return PluginSection(
        cls.name,
        cls.config_class,
        check=_instance_hook(cls, "check"),
        check_layout=_instance_hook(cls, "check_layout"),
        capabilities=cls.capabilities,
    )


def _instance_hook(cls: type[Plugin], hook: str):
    if getattr(cls, hook) is getattr(Plugin, hook):
        return no_check  # not overridden: no instance needed
    return functools.partial(_call_instance_hook, cls, hook)


def _call_instance_hook(cls: type[Plugin], hook: str, own: Any, cfg: Any, world_size: int) -> None:
    getattr(cls(own), hook)(cfg, world_size)


def registered_plugins() -> dict[str, type[Plugin]]:
    """Every plugin class by name: the builtin ones (importing their modules, and with them
    torch), other packages' (config/plugin_sections.py) and those registered."""
    for name in BUILTIN:
        importlib.import_module(f"megatron_ext.{name}.plugin")
    import_external_plugins()
    return dict(_REGISTRY)


def plugin_classes(names: list[str]) -> list[type[Plugin]]:
    """The classes of the plugins named, importing only their modules (a builtin plugin's
    module imports torch where it needs it)."""
    for name in names:
        if name in BUILTIN:
            importlib.import_module(f"megatron_ext.{name}.plugin")
    import_external_plugins()
    unknown = [n for n in names if n not in _REGISTRY]
    if unknown:
        raise ValueError(f"plugins: unknown plugin(s) {unknown}; registered: {sorted(registered_plugins())}")
    return [_REGISTRY[n] for n in names]


def build_plugins(names: list[str], cfg: Any) -> list[Plugin]:
    """Instantiate the plugins named in the config, each with its own config section."""
    return [cls(getattr(cfg, cls.name, None)) for cls in plugin_classes(names)]
