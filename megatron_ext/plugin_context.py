"""What a plugin's hooks receive: a narrow view of the running Trainer.

Every hook gets the same `PluginContext` (one per Trainer), not the Trainer itself: the members
below are all a plugin can reach, so the Trainer's own state (its counters, scheduler, log,
checkpoint queue, private helpers) stays its own, and the contract between the two is this
class. Code that owns a run (a plugin's `runner`, a tool) builds and drives a Trainer instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig

    from megatron_ext.config.schema import Config, ParallelConfig
    from megatron_ext.parallel.layout import ParallelLayout
    from megatron_ext.plugin import Plugin
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

    Changing the layout (a step hook, between two steps: `on_step_begin`): `install()` enters
    another layout, `close()` leaves this one (on a rank that a move leaves out of the world).
    Building a layout ahead, beside the running one (from `on_step_begin`, also in a thread it
    starts that runs while the steps do): `build_model()`, `build_optimizer()`,
    `open_datasets()` and `common_state()`.

    Every hook receives this same object, `layer_spec` and `after_model_built` included, which
    read no more than the config: one signature for all hooks reads simpler than a different
    argument per hook, and a model rewrite may need `on_cpu`, `vocab_size` or `note()` too.
    Nothing can be set on it, and no member returns the Trainer.
    """

    __slots__ = ("__trainer",)

    def __init__(self, trainer: Trainer) -> None:
        # Class-private (name-mangled): plugins reach the Trainer through the members below only.
        self.__trainer = trainer

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

    # --- changing the layout (on_step_begin) ---------------------------------------------------

    def install(self, layout: ParallelLayout, built: Any = None) -> None:
        """Leave the running layout and enter `layout` (`built`: its groups, model and optimizer
        made ahead, reshard/prebuild.py's Prebuilt); only between two steps, in `on_step_begin`.
        See `Trainer.install`."""
        self.__trainer.install(layout, built)

    def close(self, in_background: bool = False) -> None:
        """Leave the running layout without entering another (`layout` becomes None and the
        loop ends on this rank, unless `install` follows); only in `on_step_begin`."""
        self.__trainer.close(in_background)

    def build_model(
        self, parallel: ParallelConfig, groups: Any = None, initialise: bool = True, load_pretrained: bool = False
    ) -> tuple[list, TransformerConfig]:
        """Megatron's DDP-wrapped model chunks for `parallel` and their TransformerConfig, in
        the process groups `groups` (default: megatron's current ones). See `Trainer.build_model`."""
        return self.__trainer.build_model(parallel, groups, initialise, load_pretrained)

    def build_optimizer(self, model: list, model_config: TransformerConfig, parallel: ParallelConfig, groups: Any = None) -> Any:
        """Megatron's optimizer over `model`, built by `build_model` for `parallel`."""
        return self.__trainer.build_optimizer(model, model_config, parallel, groups)

    def open_datasets(self, dp: Optional[int] = None) -> tuple:
        """(training, validation) datasets sized for `dp` data-parallel ranks (default: the
        layout's). Collective over the world it is called in."""
        return self.__trainer.open_datasets(dp)

    def common_state(self) -> dict:
        """What a checkpoint holds besides tensors (counters, scheduler, plugin states, config):
        what a rank that joins the job starts from."""
        return self.__trainer.common_state()
