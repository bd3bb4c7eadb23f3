"""What a plugin's hooks receive: a narrow view of the running Trainer.

Every hook of a plugin gets that plugin's `PluginContext` (one per plugin of a Trainer), not the
Trainer itself: the members below are all a plugin can reach, so the Trainer's own state (its
counters, scheduler, log, checkpoint queue, private helpers) stays its own, and the contract
between the two is this class. What a plugin declares decides what it gets: the layout
controller only with `Capability.CHANGES_LAYOUT`. Code that owns a run (a plugin's `runner`, a
tool) builds and drives a Trainer instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from megatron_ext.config.capabilities import Capability

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig

    from megatron_ext.config.schema import Config
    from megatron_ext.parallel.layout import ParallelLayout
    from megatron_ext.plugin import Plugin
    from megatron_ext.training.layout_controller import LayoutController
    from megatron_ext.training.trainer import Trainer


class PluginContext:
    """The running Trainer as its plugins' hooks see it (`megatron_ext.plugin.Plugin`).

    Reading the run (any hook): `cfg`, `layout`, `model`, `model_config`, `optimizer`,
    `tokenizer`, `vocab_size`, `train_ds`, `on_cpu`, `plugins`, and `note()`; `data_prefixes()`
    from `layer_spec` on. Each property reads the Trainer at the time of the call, so it follows
    a change of layout (a new model, optimizer and layout); what the Trainer has not built yet is
    still empty or None (in `setup`: the model, optimizer, tokenizer, vocabulary and datasets),
    and while it builds a model (`layer_spec`, `after_model_built`) the model, optimizer and
    datasets are those before it, if any.

    Changing the layout: `layout_controller`, for a plugin that declares
    `Capability.CHANGES_LAYOUT` (PermissionError for any other): the one interface through which
    the layout changes (prepare ahead, install, release, commit, roll back).

    Each plugin has its own context, and every hook of that plugin receives the same object,
    `layer_spec` and `after_model_built` included, which read no more than the config: one
    signature for all hooks reads simpler than a different argument per hook, and a model
    rewrite may need `on_cpu`, `vocab_size` or `note()` too. Nothing can be set on it, and no
    member returns the Trainer.
    """

    __slots__ = ("__trainer", "__plugin")

    def __init__(self, trainer: Trainer, plugin: Plugin) -> None:
        # Class-private (name-mangled): plugins reach the Trainer through the members below only.
        self.__trainer = trainer
        self.__plugin = plugin  # whose hooks receive this context: what it declares decides what it gets

    # --- reading the run ---------------------------------------------------------------------

    @property
    def cfg(self) -> Config:
        """The run's config; its `parallel` is the running layout's."""
        return self.__trainer.cfg

    @property
    def layout(self) -> Optional[ParallelLayout]:
        """The running layout, dp resolved for this world; None once a move left this rank out
        of the job's world."""
        return self.__trainer.layout

    @property
    def model(self) -> list:
        """The DDP-wrapped model chunks of this rank (one per virtual pipeline stage)."""
        return self.__trainer.model

    @property
    def model_config(self) -> Optional[TransformerConfig]:
        """Megatron's TransformerConfig of the model."""
        return self.__trainer.model_config

    @property
    def optimizer(self) -> Any:
        """Megatron's optimizer over the model."""
        return self.__trainer.optimizer

    @property
    def tokenizer(self) -> Any:
        """The run's tokenizer."""
        return self.__trainer.tokenizer

    @property
    def vocab_size(self) -> Optional[int]:
        """The padded vocabulary of the model."""
        return self.__trainer.vocab_size

    @property
    def train_ds(self) -> Any:
        """The training dataset."""
        return self.__trainer.train_ds

    @property
    def on_cpu(self) -> bool:
        """Whether the run trains on the CPU."""
        return self.__trainer.on_cpu

    @property
    def plugins(self) -> tuple[Plugin, ...]:
        """The run's plugins, in the order of `cfg.plugins` (to ask what they override, not to
        call them: plugins never reach into each other)."""
        return tuple(self.__trainer.plugins)

    def note(self, line: str) -> None:
        """Write `line` to the run's log (rank 0) and its summary's notes."""
        self.__trainer.note(line)

    def data_prefixes(self) -> list[str]:
        """The run's indexed datasets: data.data_path (a blend, weights included) or the
        default corpus, tokenized into the cache on first use."""
        return self.__trainer.data_prefixes()

    # --- changing the layout (a plugin that declares Capability.CHANGES_LAYOUT) ---------------

    @property
    def layout_controller(self) -> LayoutController:
        """The Trainer's layout controller (training/layout_controller.py): prepare a layout
        ahead (from `on_step_begin`, also in a thread it starts that runs while the steps do),
        install it, release the running one, commit or roll back; installing and releasing only
        between two steps, in `on_step_begin`. Only for a plugin whose capabilities include
        `Capability.CHANGES_LAYOUT`: the plugins it composes with are derived from that."""
        if Capability.CHANGES_LAYOUT not in self.__plugin.capabilities:
            raise PermissionError(
                f"plugin {self.__plugin.name!r} uses the layout controller but does not declare "
                "Capability.CHANGES_LAYOUT: add it to its capabilities (its section's)"
            )
        return self.__trainer.layout_controller
