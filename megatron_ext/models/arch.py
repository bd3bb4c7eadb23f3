"""The model family a `ModelConfig` describes (`model.arch`) and how each one is built.

Every family gives the same three steps, so the Trainer builds any of them the same way:
megatron's TransformerConfig, the layer (or stack) ModuleSpec that plugins may rewrite, and the
megatron model built from both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_ext.config.schema import ModelConfig, ParallelConfig
from megatron_ext.models import gpt, hybrid


@dataclass(frozen=True)
class Architecture:
    # (model, parallel, on_cpu) -> megatron's config
    transformer_config: Callable[[ModelConfig, ParallelConfig, bool], TransformerConfig]
    # (model, on_cpu) -> the spec handed to the model builder
    spec: Callable[[ModelConfig, bool], ModuleSpec]
    # (model, config, spec, vocab_size, pre_process, post_process, vp_stage) -> megatron model
    build: Callable


def _gpt_spec(model: ModelConfig, on_cpu: bool) -> ModuleSpec:
    return gpt.layer_spec(model, gpt.use_transformer_engine(model, on_cpu))


ARCHITECTURES = {
    "gpt": Architecture(gpt.transformer_config, _gpt_spec, gpt.build_gpt_model),
    "hybrid": Architecture(hybrid.hybrid_transformer_config, hybrid.hybrid_stack_spec, hybrid.build_hybrid_model),
}


def architecture(model: ModelConfig) -> Architecture:
    if model.arch not in ARCHITECTURES:
        raise ValueError(f"model.arch must be one of {', '.join(ARCHITECTURES)}; got {model.arch!r}")
    return ARCHITECTURES[model.arch]
