"""The parent's tensors as one process holding the whole model has them, from a TP x PP run: what
the nested checkpoint stores, so it does not depend on the layout that trained it.

Each TP rank holds a block of every TP-sharded tensor along the dimension megatron marks
(`partition_dim`: the vocabulary of the embedding and output layer, the query groups of QKV,
the heads of the attention projection, the neurons of the MLP, the groups of a Mamba mixer);
the blocks are joined in rank order, run by run where a rank's block is several tensors' (SwiGLU's
fc1: its gate rows, then its up rows; the Mamba in_proj: its z, x, B, C and dt rows; the conv:
its x, B and C channels). Each pipeline stage (each model chunk under virtual pipeline
stages) numbers its layers from 0; the first stage receives the others' tensors under the
model's layer numbers (megatron's `layer_number`, vp offsets included), without the last stage's
copy of a tied output layer. Under expert parallelism each EP rank's experts join the others' under
their global indices.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.experts import SequentialMLP
from torch import nn

from megatron_ext.elastic.axes import gather_across_tp
from megatron_ext.elastic.pipeline import chunks_of, stages
from megatron_ext.elastic.slicing import parent_state
from megatron_ext.models.mamba2 import TorchMambaMixer


Tensors = dict[str, torch.Tensor]


def whole_parent(
    model: Union[nn.Module, Sequence[nn.Module]], tensors: Optional[Union[Tensors, Sequence[Tensors]]] = None
) -> Optional[Tensors]:
    """On global rank 0: `tensors` (by this stage's state-dict keys; default: the model's state
    with its TP shards joined, `join_tp`) of every pipeline stage under the whole model's keys.
    `model` may be the rank's model chunks (virtual pipeline stages; then `tensors`, if given, is
    one dict per chunk, by the chunk's own keys). None on every other rank. The data-parallel
    replicas hold the same weights, but for the experts under EP (`join_ep`): the first is read.
    Collective over the first replica's TP and PP ranks, and under EP over every rank."""
    chunks = chunks_of(model)
    given = [None] * len(chunks) if tensors is None else [tensors] if isinstance(tensors, dict) else list(tensors)
    if len(given) != len(chunks):
        raise ValueError(f"elastic: whole_parent got tensors of {len(given)} model chunks for {len(chunks)} chunks")
    if parallel_state.get_expert_model_parallel_world_size() == 1 and parallel_state.get_data_parallel_rank() != 0:
        return None
    per_chunk = [join_ep(c, join_tp(c) if t is None else t) for c, t in zip(chunks, given)]
    if parallel_state.get_data_parallel_rank() != 0 or parallel_state.get_tensor_model_parallel_rank() != 0:
        return None
    return gather_stages(chunks, per_chunk)


def join_tp(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors (full size, no `_extra_state`) with every TP-sharded one whole, on
    every TP rank."""
    params = dict(model.named_parameters())
    runs = _runs(model)
    joined = parent_state(model)
    for key, value in joined.items():
        param = params.get(key)
        if param is not None and getattr(param, "tensor_model_parallel", False):
            joined[key] = torch.cat(gather_across_tp(value, param.partition_dim, runs.get(key, 1)), param.partition_dim)
    return joined


def join_ep(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` with every MoE layer's experts under their global indices: under expert
    parallelism EP rank r holds the experts [r * n, (r + 1) * n) as its `local_experts.0..n-1`;
    each gets the others'. Collective over the EP group."""
    group = parallel_state.get_expert_model_parallel_group()
    ep = dist.get_world_size(group)
    if ep == 1:
        return tensors
    joined = dict(tensors)
    for prefix, m in model.named_modules():
        if not isinstance(m, SequentialMLP):
            continue
        head = f"{prefix}.local_experts."
        n = len(m.local_experts)
        for key in [k for k in tensors if k.startswith(head)]:  # the same keys, in the same order, on every rank
            local, rest = key[len(head) :].split(".", 1)
            blocks = [torch.empty_like(tensors[key]) for _ in range(ep)]
            dist.all_gather(blocks, tensors[key].contiguous(), group=group)
            del joined[key]
            for r, block in enumerate(blocks):
                joined[f"{head}{r * n + int(local)}.{rest}"] = block
    return joined


def _runs(model: nn.Module) -> dict[str, Union[int, list[int]]]:
    """The keys whose block on a rank is several runs (`gather_across_tp`), at the full size."""
    runs: dict[str, Union[int, list[int]]] = {}
    for prefix, m in model.named_modules():
        if isinstance(m, MLP) and m.config.gated_linear_unit:
            runs.update({f"{prefix}.linear_fc1.{name}": 2 for name in ("weight", "bias")})
        if isinstance(m, TorchMambaMixer):
            runs[f"{prefix}.in_proj.weight"] = list(m.shape.in_proj_parts.values())
            runs.update({f"{prefix}.conv1d.{name}": list(m.shape.conv_parts.values()) for name in ("weight", "bias")})
    return runs


def global_key(model: nn.Module, key: str) -> str:
    """A state-dict key of this stage as a model holding every stage names it: a stage numbers
    its `decoder.layers` from 0, megatron's `layer_number` counts from the model's first layer
    (in a MambaStack and a TransformerBlock alike)."""
    prefix = "decoder.layers."
    if not key.startswith(prefix):
        return key
    local, rest = key[len(prefix) :].split(".", 1)
    return f"{prefix}{model.decoder.layers[int(local)].layer_number - 1}.{rest}"


def gather_stages(chunks: list[nn.Module], tensors: list[dict[str, torch.Tensor]]) -> Optional[dict[str, torch.Tensor]]:
    """This stage's `tensors` (one dict per model chunk) and every other stage's, under global
    keys, on the first stage (None on the others; this stage's alone without PP)."""
    mine = {}
    for model, chunk_tensors in zip(chunks, tensors, strict=True):
        tied_copy = model.share_embeddings_and_output_weights and not model.pre_process
        for k, v in chunk_tensors.items():
            if not (tied_copy and k.startswith("output_layer.")):
                mine[global_key(model, k)] = v.detach().cpu()
    if stages() == 1:
        return mine
    group = parallel_state.get_pipeline_model_parallel_group()
    first = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
    per_stage = [None] * stages() if first else None
    dist.gather_object(mine, per_stage, dst=dist.get_global_rank(group, 0), group=group)
    return {k: v for stage in per_stage for k, v in stage.items()} if first else None
