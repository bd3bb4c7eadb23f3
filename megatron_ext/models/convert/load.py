"""Whole (logical) tensors into a model of any TP/PP/VPP layout, and back out of a TP1/PP1 one.

Both directions go through megatron's own sharded-state-dict metadata (`models/logical.py`), so
fused QKV, SwiGLU halves, vocab slices and pipeline stages are placed exactly where megatron
expects them, by the same rules its checkpoints use.
"""

from __future__ import annotations

from typing import Mapping

import torch
from megatron.core import parallel_state

from megatron_ext.models.convert.llama import HFAsLogical
from megatron_ext.models.convert.pretrained_model import Pretrained
from megatron_ext.models.logical import LogicalName, fill_from_logical, local_box, local_shards


def _describe(name: LogicalName) -> str:
    return name.key + (f" (layer {name.layer})" if name.index else "")


@torch.no_grad()
def load_logical(model_chunks: list, tensors: Mapping[LogicalName, torch.Tensor]) -> None:
    """Fill every tensor this rank holds from `tensors`. All of this rank's sources are looked
    up and checked first: a missing or misshapen one raises, naming it, before anything is
    copied. Each source is read once, even where megatron asks twice (SwiGLU halves)."""
    sources: dict[LogicalName, torch.Tensor] = {}
    for name, shape, _ in local_shards(model_chunks):
        if name in sources:
            continue
        try:
            sources[name] = tensors[name]  # one lookup: lazy sources read the file here
        except KeyError:
            raise KeyError(f"no source tensor for megatron's {_describe(name)}") from None
        if sources[name].shape != shape:
            raise ValueError(
                f"source tensor for megatron's {_describe(name)} has shape "
                f"{tuple(sources[name].shape)}, the model expects {tuple(shape)}"
            )
    fill_from_logical(model_chunks, lambda name, shape: sources[name])


@torch.no_grad()
def gather_logical(model_chunks: list) -> dict[LogicalName, torch.Tensor]:
    """Every logical tensor of a model that one process holds whole (TP=1, PP=1): the inverse of
    `load_logical`. Copies, so the result outlives the model."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp * parallel_state.get_pipeline_model_parallel_world_size() != 1:
        raise ValueError("gather_logical needs the whole model in this process (tp=1, pp=1)")
    tensors: dict[LogicalName, torch.Tensor] = {}
    for name, shape, sh in local_shards(model_chunks):
        whole = tensors.setdefault(name, torch.empty(shape, dtype=sh.data.dtype))
        whole[local_box(sh)] = sh.data.detach().cpu().view(sh.local_shape)
    return tensors


def load_pretrained(model_chunks: list, pretrained: Pretrained, padded_vocab: int) -> None:
    """Put a pretrained model's weights into this rank's stage (any layout)."""
    load_logical(model_chunks, HFAsLogical(pretrained.tensors, pretrained.config, padded_vocab))
