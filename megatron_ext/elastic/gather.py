"""The parent's tensors as one process holding the whole model has them, from a TP x PP run: what
the nested checkpoint stores, so it does not depend on the layout that trained it.

Each TP rank holds a block of every TP-sharded tensor along the dimension megatron marks
(`partition_dim`: the vocabulary of the embedding and output layer, the query groups of QKV,
the heads of the attention projection, the neurons of the MLP); the blocks are joined in rank
order, SwiGLU's fc1 half by half (each rank holds its gate rows, then its up rows). Each pipeline
stage numbers its layers from 0; the first stage receives the others' tensors under the model's
layer numbers, without the last stage's copy of a tied output layer.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.mlp import MLP
from torch import nn

from megatron_ext.elastic.axes import gather_across_tp
from megatron_ext.elastic.pipeline import stages
from megatron_ext.elastic.slicing import parent_state


def whole_parent(model: nn.Module, tensors: Optional[dict[str, torch.Tensor]] = None) -> Optional[dict[str, torch.Tensor]]:
    """On global rank 0: `tensors` (by this stage's state-dict keys; default: the model's state
    with its TP shards joined, `join_tp`) of every pipeline stage under the whole model's keys.
    None on every other rank. The data-parallel replicas hold the same weights: the first is read.
    Collective over the first replica's TP and PP ranks."""
    if parallel_state.get_data_parallel_rank() != 0:
        return None
    tensors = join_tp(model) if tensors is None else tensors
    if parallel_state.get_tensor_model_parallel_rank() != 0:
        return None
    return gather_stages(model, tensors)


def join_tp(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors (full size, no `_extra_state`) with every TP-sharded one whole, on
    every TP rank."""
    params = dict(model.named_parameters())
    halves = {
        f"{prefix}.linear_fc1.{name}": 2
        for prefix, m in model.named_modules()
        if isinstance(m, MLP) and m.config.gated_linear_unit
        for name in ("weight", "bias")
    }
    joined = parent_state(model)
    for key, value in joined.items():
        param = params.get(key)
        if param is not None and getattr(param, "tensor_model_parallel", False):
            joined[key] = torch.cat(gather_across_tp(value, param.partition_dim, halves.get(key, 1)), param.partition_dim)
    return joined


def global_key(model: nn.Module, key: str) -> str:
    """A state-dict key of this stage as a model holding every stage names it: a stage numbers
    its `decoder.layers` from 0, megatron's `layer_number` counts from the model's first layer
    (in a MambaStack and a TransformerBlock alike)."""
    prefix = "decoder.layers."
    if not key.startswith(prefix):
        return key
    local, rest = key[len(prefix) :].split(".", 1)
    return f"{prefix}{model.decoder.layers[int(local)].layer_number - 1}.{rest}"


def gather_stages(model: nn.Module, tensors: dict[str, torch.Tensor]) -> Optional[dict[str, torch.Tensor]]:
    """This stage's `tensors` and every other stage's, under global keys, on the first stage
    (None on the others; `tensors` itself without PP)."""
    tied_copy = model.share_embeddings_and_output_weights and not model.pre_process
    mine = {global_key(model, k): v.detach().cpu() for k, v in tensors.items() if not (tied_copy and k.startswith("output_layer."))}
    if stages() == 1:
        return mine
    group = parallel_state.get_pipeline_model_parallel_group()
    first = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
    per_stage = [None] * stages() if first else None
    dist.gather_object(mine, per_stage, dst=dist.get_global_rank(group, 0), group=group)
    return {k: v for stage in per_stage for k, v in stage.items()} if first else None
