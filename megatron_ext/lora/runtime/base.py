"""The frozen base a pack trains on: megatron's GPTModel on the pack's process groups (or, by
default, megatron's current parallel state), its loss over the same TP group (loss.py), with
the LoRA wrappers attached."""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_ext.config.schema import ModelConfig, ParallelConfig
from megatron_ext.lora.runtime.layers import Routing, attach_lora
from megatron_ext.lora.runtime.loss import reduce_over_own_group
from megatron_ext.models import pretrained
from megatron_ext.models.gpt import build_gpt_model, layer_spec, transformer_config
from megatron_ext.models.init import init_weights_layout_independent
from megatron_ext.platform.device import current_device


def build_base(
    model_cfg: ModelConfig,
    vocab_size: int,
    seed: int = 1234,
    dtype: Optional[torch.dtype] = None,
    groups: Optional[ProcessGroupCollection] = None,
):
    """(model, wrappers, routing): the base, initialised from `model.pretrained` or from `seed`
    (the same weights in every TP layout), frozen, with every adaptable linear wrapped.
    `dtype` casts the whole model (torch.float64 for exactness checks). `groups`: the model's
    process groups (tp, pp, cp, embd; groups.model_groups), default megatron's current ones."""
    groups = groups if groups is not None else ProcessGroupCollection.use_mpu_process_groups()
    if groups.pp.size() > 1:
        raise ValueError("lora: pipeline parallelism is not supported by the packed runtime; use parallel.pp=1")
    on_cpu = current_device().type == "cpu"
    config = transformer_config(model_cfg, ParallelConfig(tp=groups.tp.size(), pp=1), on_cpu)
    model = build_gpt_model(
        model_cfg, config, layer_spec(model_cfg, use_te=False), vocab_size, pre_process=True, post_process=True,
        pg_collection=groups,
    ).to(current_device())
    if model_cfg.pretrained:
        pretrained.load_into([model], model_cfg, vocab_size)
    else:
        init_weights_layout_independent([model], config, seed)
    if dtype is not None:
        model.to(dtype)
    reduce_over_own_group(model)
    routing = Routing()
    wrappers = attach_lora(model, routing)
    return model, wrappers, routing
