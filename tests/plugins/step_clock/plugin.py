"""`plugins=[step_clock]`: megatron's own schedule, run by the plugin, which notes how long each
step's forward-backward took. It owns the step (`forward_backward_func`, so Capability.OWNS_STEP
by its hook alone) and says so in words too."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from megatron_ext.config.capabilities import Capability
from megatron_ext.plugin import Plugin, PluginContext, register_plugin


@dataclass
class StepClockConfig:
    # Note the forward-backward time every this many steps.
    every: int = 1


@register_plugin
class StepClockPlugin(Plugin):
    name = "step_clock"
    config_class = StepClockConfig
    capabilities = frozenset({Capability.OWNS_STEP})  # implied by forward_backward_func as well

    def forward_backward_func(self, ctx: PluginContext) -> Callable:
        from megatron.core.pipeline_parallel import get_forward_backward_func  # heavy: on the workers only

        schedule = get_forward_backward_func()

        def timed(**kwargs):
            began = time.perf_counter()
            losses = schedule(**kwargs)
            self.seconds = time.perf_counter() - began
            return losses

        return timed

    def on_step_end(self, ctx: PluginContext, step: int, metrics: dict) -> None:
        if step % self.cfg.every == 0:
            ctx.note(f"step {step}: forward-backward {self.seconds:.3f} s")
