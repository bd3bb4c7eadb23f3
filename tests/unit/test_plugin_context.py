"""The plugins' hooks receive their PluginContext, not the Trainer: in a one-rank tiny run with
two recording plugins, every hook of a plugin gets that plugin's one context object, another
than the other plugin's; each of its members reads the same-named member of the Trainer at the
time of the call (checked against the Trainer itself, and against a snapshot: the model is
empty in `setup` and built by the first step); the layout controller is given only to a plugin
that declares CHANGES_LAYOUT; nothing else of the Trainer (the Trainer, its private members, its
counters, scheduler, loop) is reachable through it, and nothing can be set on it."""

from __future__ import annotations

import inspect

import pytest
import torch.distributed as dist

from megatron_ext.config import compose_config
from megatron_ext.config.capabilities import Capability
from megatron_ext.platform.launch import join_world
from megatron_ext.plugin import Plugin
from megatron_ext.plugin_context import PluginContext
from megatron_ext.training.trainer import Trainer

TINY = [
    "experiment=none", "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
    "model.num_attention_heads=4", "model.num_query_groups=2", "model.seq_length=32",
    "train.micro_batch_size=1", "train.global_batch_size=1", "train.iters=2", "train.eval_interval=0",
    "logging.progress_bar=false", "launcher.nproc=1", "data.mock=true",
]
HOOKS = ("setup", "layer_spec", "after_model_built", "forward_backward_func", "on_step_begin", "on_step_end", "on_train_end")


PROPERTIES = sorted(n for n in dir(PluginContext) if isinstance(getattr(PluginContext, n), property))


class Recorder(Plugin):
    """Records (hook, its context argument, the number of model chunks the context shows), after
    reading every property of the context (each one readable in every hook: it declares
    CHANGES_LAYOUT, so the layout controller too)."""

    name = "recorder"
    capabilities = frozenset({Capability.CHANGES_LAYOUT})

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, object, int]] = []

    def _record(self, hook: str, ctx) -> None:
        for name in PROPERTIES:
            getattr(ctx, name)
        self.calls.append((hook, ctx, len(ctx.model)))

    def setup(self, ctx) -> None:
        self._record("setup", ctx)

    def layer_spec(self, spec, ctx):
        self._record("layer_spec", ctx)
        return spec

    def after_model_built(self, model_chunks: list, ctx) -> list:
        self._record("after_model_built", ctx)
        return model_chunks

    def forward_backward_func(self, ctx):
        self._record("forward_backward_func", ctx)
        return None

    def on_step_begin(self, ctx, step: int) -> None:
        self._record("on_step_begin", ctx)

    def on_step_end(self, ctx, step: int, metrics: dict) -> None:
        self._record("on_step_end", ctx)

    def on_train_end(self, ctx) -> None:
        self._record("on_train_end", ctx)


class Bystander(Plugin):
    """A plugin that changes no layout: keeps the context its step hook receives."""

    name = "bystander"

    def on_step_end(self, ctx: PluginContext, step: int, metrics: dict) -> None:
        self.ctx = ctx


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(the trainer after a two-step run, still set up; its recorder; its bystander)."""
    join_world("cpu")
    cfg = compose_config([*TINY, f"data.cache_dir={tmp_path_factory.mktemp('context') / 'cache'}"])
    recorder, bystander = Recorder(), Bystander()
    trainer = Trainer(cfg, [recorder, bystander])
    try:
        trainer.setup()
        trainer.train()
        yield trainer, recorder, bystander
    finally:
        trainer.close()
        dist.destroy_process_group()


def context_members() -> set[str]:
    return {n for n in dir(PluginContext) if not n.startswith("_")}


def test_every_hook_receives_its_plugins_one_context_not_the_trainer(run):
    trainer, recorder, bystander = run
    assert {hook for hook, _, _ in recorder.calls} == set(HOOKS)
    own = trainer.plugin_context(recorder)
    wrong = [(hook, type(ctx).__name__) for hook, ctx, _ in recorder.calls if ctx is not own]
    assert not wrong, f"hooks given something other than the plugin's PluginContext: {wrong}"
    assert type(own) is PluginContext
    assert bystander.ctx is trainer.plugin_context(bystander) and bystander.ctx is not own


def test_the_layout_controller_is_only_for_a_plugin_that_changes_the_layout(run):
    trainer, recorder, bystander = run
    assert trainer.plugin_context(recorder).layout_controller is trainer.layout_controller
    with pytest.raises(PermissionError, match="'bystander' .* does not declare Capability.CHANGES_LAYOUT"):
        _ = bystander.ctx.layout_controller


def test_the_context_reads_the_trainer_live(run):
    # A snapshot taken when the Trainer was built would show no model at the steps; while the
    # model is built, the context shows the Trainer's model so far (none).
    _, recorder, _ = run
    seen = {hook: chunks for hook, _, chunks in recorder.calls}
    hooks = ("setup", "layer_spec", "after_model_built", "on_step_begin", "on_train_end")
    assert [seen[h] for h in hooks] == [0, 0, 0, 1, 1]


@pytest.mark.parametrize("member", PROPERTIES)
def test_each_property_is_the_trainers_own_member(run, member):
    trainer, recorder, _ = run
    got, want = getattr(trainer.plugin_context(recorder), member), getattr(trainer, member)
    assert got == tuple(want) if member == "plugins" else got is want


# name -> (the call on the context, the same on the Trainer)
FORWARDED = {
    "data_prefixes": (lambda ctx: ctx.data_prefixes(), lambda t: t.data_prefixes()),
}


@pytest.mark.parametrize("through_context, on_trainer", FORWARDED.values(), ids=FORWARDED.keys())
def test_each_method_answers_as_the_trainer(run, through_context, on_trainer):
    trainer, recorder, _ = run
    assert through_context(trainer.plugin_context(recorder)) == on_trainer(trainer)


def test_note_writes_to_the_trainers_log(run):
    trainer, recorder, _ = run
    trainer.plugin_context(recorder).note("a line from a plugin")
    assert trainer.reporter.notes[-1] == "a line from a plugin"


# name -> what a plugin must not reach through the context
UNREACHABLE = {
    "the trainer": "trainer",
    "the trainer, privately": "_trainer",
    "a private member": "_contexts",
    "a private method": "_finalize_saves",
    "the counters": "state",
    "the lr scheduler": "scheduler",
    "the run's log": "reporter",
    "the loop": "train",
    "a checkpoint save": "save",
    "the contexts": "plugin_context",
    "the plugin": "plugin",
    "a layout change, but through the controller": "install",
}


@pytest.mark.parametrize("name", UNREACHABLE.values(), ids=UNREACHABLE.keys())
def test_the_rest_of_the_trainer_is_out_of_reach(run, name):
    trainer, recorder, _ = run
    with pytest.raises(AttributeError):
        getattr(trainer.plugin_context(recorder), name)


def test_no_other_member_of_the_trainer_is_reachable(run):
    trainer, recorder, _ = run
    outside = set(dir(trainer)) - context_members() - {n for n in dir(trainer) if n.startswith("__")}
    reachable = sorted(n for n in outside if hasattr(trainer.plugin_context(recorder), n))
    assert not reachable
    assert len(outside) > 30  # not vacuous: the Trainer has many more members than the context


SETS = {"a member": "model", "a new attribute": "anything"}


@pytest.mark.parametrize("name", SETS.values(), ids=SETS.keys())
def test_nothing_can_be_set_on_the_context(run, name):
    trainer, recorder, _ = run
    with pytest.raises(AttributeError):
        setattr(trainer.plugin_context(recorder), name, [])


def test_every_method_of_the_context_is_a_method_of_the_trainer_with_its_parameters(run):
    trainer, _, _ = run
    methods = [n for n in context_members() if inspect.isfunction(getattr(PluginContext, n))]
    differ = [
        n for n in methods
        if list(inspect.signature(getattr(PluginContext, n)).parameters) != list(inspect.signature(getattr(Trainer, n)).parameters)
    ]
    assert methods and not differ
