"""The frozen base a pack trains on: megatron's GPTModel in the current parallel state, with
the LoRA wrappers attached."""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core import parallel_state

from megatron_ext.config.schema import ModelConfig, ParallelConfig
from megatron_ext.lora.layers import Routing, attach_lora
from megatron_ext.models import pretrained
from megatron_ext.models.gpt import build_gpt_model, layer_spec, transformer_config
from megatron_ext.models.init import init_weights_layout_independent
from megatron_ext.platform.device import current_device


def build_base(model_cfg: ModelConfig, vocab_size: int, seed: int = 1234, dtype: Optional[torch.dtype] = None):
    """(model, wrappers, routing): the base, initialised from `model.pretrained` or from `seed`
    (the same weights in every TP layout), frozen, with every adaptable linear wrapped.
    `dtype` casts the whole model (torch.float64 for exactness checks)."""
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise ValueError("lora: pipeline parallelism is not supported by the packed runtime; use parallel.pp=1")
    on_cpu = current_device().type == "cpu"
    parallel = ParallelConfig(tp=parallel_state.get_tensor_model_parallel_world_size(), pp=1)
    config = transformer_config(model_cfg, parallel, on_cpu)
    model = build_gpt_model(
        model_cfg, config, layer_spec(model_cfg, use_te=False), vocab_size, pre_process=True, post_process=True
    ).to(current_device())
    if model_cfg.pretrained:
        pretrained.load_into([model], model_cfg, vocab_size)
    else:
        init_weights_layout_independent([model], config, seed)
    if dtype is not None:
        model.to(dtype)
    routing = Routing()
    wrappers = attach_lora(model, routing)
    return model, wrappers, routing
