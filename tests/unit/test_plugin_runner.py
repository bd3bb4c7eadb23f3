"""A plugin that owns the run (`Plugin.runner`): each worker runs its Runner instead of the
Trainer's loop, the launcher learns from it whether a signal stops the run at a step, and a run
may list one such plugin."""

from __future__ import annotations

import pytest

from megatron_ext.config import compose_config
from megatron_ext.config.validate import ConfigError
from megatron_ext.plugin import Plugin, Runner, register_plugin
from megatron_ext.train import run_from_overrides, runner_of, train_one_world

BASE = ["experiment=none", "launcher.nproc=1", "launcher.device=cpu"]


def _echo(cfg) -> dict:
    return {"ran_by": "echo_runner", "iters": cfg.train.iters}


@register_plugin
class EchoRunner(Plugin):
    name = "echo_runner"

    def runner(self) -> Runner:
        return Runner(_echo, stops_at_a_step=False)


@register_plugin
class OtherRunner(Plugin):
    name = "other_runner"

    def runner(self) -> Runner:
        return Runner(_echo)


def test_the_trainer_runs_a_run_no_plugin_owns():
    runner = runner_of(compose_config(BASE))
    assert (runner.run, runner.stops_at_a_step) == (train_one_world, True)


def test_a_plugins_runner_runs_in_place_of_the_trainer():
    summary = run_from_overrides([*BASE, "plugins=[echo_runner]", "train.iters=7"])
    assert summary == {"ran_by": "echo_runner", "iters": 7}
    assert runner_of(compose_config([*BASE, "plugins=[echo_runner]"])).stops_at_a_step is False


def test_two_plugins_that_own_the_run_are_refused():
    with pytest.raises(ConfigError, match=r"plugins: echo_runner and other_runner each supply what every worker runs"):
        run_from_overrides([*BASE, "plugins=[echo_runner,other_runner]"])
