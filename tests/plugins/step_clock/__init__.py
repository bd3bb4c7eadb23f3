"""A plugin of its own folder that runs each training step itself (it declares
Capability.OWNS_STEP): beside another plugin that runs the step it is refused before launch by
the capabilities alone, no plugin naming the other. Loaded with
MEGATRON_EXT_PLUGINS=tests.plugins.step_clock."""

from tests.plugins.step_clock.plugin import StepClockConfig, StepClockPlugin

__all__ = ["StepClockConfig", "StepClockPlugin"]
