"""`model.moe_layer_freq` in the form megatron's TransformerConfig takes it."""

from __future__ import annotations

from megatron_ext.config.moe_pattern import moe_layer_pattern
from megatron_ext.config.schema import ModelConfig


def megatron_moe_layer_freq(model: ModelConfig):
    """TransformerConfig.moe_layer_freq: the integer, or the pattern as a list."""
    text = str(model.moe_layer_freq).strip()
    return int(text) if text.isdigit() else moe_layer_pattern(model)
