"""A plugin written from docs/writing-a-plugin.md alone, in a folder of its own: the gradient norm
of each layer every `grad_norm.every` steps. Loaded with MEGATRON_EXT_PLUGINS=tests.plugins.grad_norm."""

from tests.plugins.grad_norm.plugin import GradNormConfig, GradNormPlugin

__all__ = ["GradNormConfig", "GradNormPlugin"]
