"""Axes of a dense transformer layer (megatron's TransformerLayer with SelfAttention and a
gated MLP): attention heads, ranked and cut inside each query group (GQA structure kept: the
key/value heads are never cut), and FFN neurons (both SwiGLU halves alike)."""

from __future__ import annotations

from typing import Mapping, Optional

import torch
from megatron.core import parallel_state
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch import nn

from megatron_ext.elastic.axes import (
    Axis,
    LayerAxes,
    Size,
    Touch,
    permute_,
    permute_across_tp_,
    rank_block,
    register_layer_adapter,
    resize_norm,
    set_input_size,
    set_output_size,
)
from megatron_ext.elastic.modules import SliceRule, add_rule, full_tensor


class HeadsAxis(Axis):
    """Query heads of one attention layer. Owns linear_qkv and linear_proj."""

    kind = "heads"
    tp_sharded = True

    def __init__(self, attention: SelfAttention, layer: int) -> None:
        cfg = attention.config
        self.layer = layer
        self.full = cfg.num_attention_heads
        self.quantum = self.groups = cfg.num_query_groups
        super().__init__()
        self.attention = attention
        self.head_dim = attention.hidden_size_per_attention_head
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        self.local_groups = attention.num_query_groups_per_partition
        self.per_group = self.full // self.groups
        if self.full // self.tp != self.local_groups * self.per_group:
            raise ValueError(f"elastic heads/{layer}: query groups ({self.groups}) must be a multiple of tp ({self.tp})")
        # Whole query groups live on one TP rank, so ranking inside groups is rank-local: this
        # rank's heads are the global heads [offset, offset + full / tp).
        self.offset = parallel_state.get_tensor_model_parallel_rank() * (self.full // self.tp)

    def _kept_heads(self, per_group: int) -> torch.Tensor:
        """Local head indices kept when each group keeps its first `per_group` heads."""
        base = torch.arange(self.local_groups).unsqueeze(1) * self.per_group
        return (base + torch.arange(per_group)).reshape(-1)

    def _qkv_rows(self, per_group: int, heads_order: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Rows of the fused QKV weight ([q heads of g; k_g; v_g] per group g) that hold the
        first `per_group` query heads of each group (in `heads_order` within the group)."""
        d, q = self.head_dim, self.per_group
        rows = []
        for g in range(self.local_groups):
            base = g * (q + 2) * d
            heads = torch.arange(per_group) if heads_order is None else heads_order[g * q : (g + 1) * q] - g * q
            rows.append((base + heads.unsqueeze(1) * d + torch.arange(d)).reshape(-1))
            rows.append(base + q * d + torch.arange(2 * d))
        return torch.cat(rows)

    def _proj_cols(self, heads: torch.Tensor) -> torch.Tensor:
        return (heads.unsqueeze(1) * self.head_dim + torch.arange(self.head_dim)).reshape(-1)

    def attach(self) -> None:
        def qkv_cut():
            return None if self.active == self.full else self._qkv_rows(self.active // self.groups)

        def proj_cut():
            return None if self.active == self.full else self._proj_cols(self._kept_heads(self.active // self.groups))

        add_rule(self.attention.linear_qkv, "weight", SliceRule(0, qkv_cut))
        add_rule(self.attention.linear_proj, "weight", SliceRule(1, proj_cut, self.gate_value))

    def resize(self, size: int) -> None:
        local = size // self.tp
        a, core = self.attention, self.attention.core_attention
        a.num_attention_heads_per_partition = local
        a.query_projection_size = size * self.head_dim
        a.linear_qkv.output_size_per_partition = (local + 2 * self.local_groups) * self.head_dim
        a.linear_proj.input_size_per_partition = local * self.head_dim
        core.num_attention_heads_per_partition = local
        core.hidden_size_per_partition = local * self.head_dim

    def observe(self) -> list:
        def hook(module, args):
            x = args[0].detach()
            per_head = x.reshape(-1, x.shape[-1] // self.head_dim, self.head_dim).double().norm(dim=-1)
            self.score[self.offset : self.offset + per_head.shape[1]] += per_head.sum(0).cpu()

        return [self.attention.linear_proj.register_forward_pre_hook(hook)]

    def permute(self, order: torch.Tensor) -> None:
        local = rank_block(order, self.tp, parallel_state.get_tensor_model_parallel_rank())
        permute_(full_tensor(self.attention.linear_qkv, "weight"), 0, self._qkv_rows(self.per_group, local))
        permute_(full_tensor(self.attention.linear_proj, "weight"), 1, self._proj_cols(local))

    def params(self, sizes: Mapping[str, Size]) -> Size:
        n, h = sizes[self.name], sizes["hidden"]
        return h * (n + 2 * self.groups) * self.head_dim + n * self.head_dim * h

    def export_fields(self, size: int) -> dict:
        return {"num_attention_heads": size}


class FfnAxis(Axis):
    """The intermediate neurons of one gated MLP. Owns linear_fc1 and linear_fc2.

    Under tensor parallelism rank r holds the neurons [r * full / tp, (r + 1) * full / tp) of the
    reordered parent. A size keeps the global prefix, so each rank keeps the part of the prefix
    that falls in its block (possibly all of it, possibly none): the submodel, and hence the
    whole run, does not depend on tp. The price is balance: a half-width FFN runs on the first
    half of the ranks only.

    The neurons of several MLPs of one width form one axis alike (the experts of an MoE layer,
    `moe_axes.ExpertFfnAxis`): one score summed over them, one order, one cut."""

    kind = "ffn"
    tp_sharded = True

    def __init__(self, mlp: MLP, layer: int) -> None:
        if not mlp.config.gated_linear_unit:
            raise ValueError("elastic: the FFN axis supports gated (SwiGLU) MLPs")
        self._init_neurons([mlp], layer, mlp.config.ffn_hidden_size)

    def _init_neurons(self, mlps: list[MLP], layer: int, full: int) -> None:
        self.layer, self.full = layer, full
        Axis.__init__(self)
        self.mlps = mlps
        # Expert MLPs are sharded over the expert TP group, which is the TP group (megatron's
        # expert_tensor_parallel_size defaults to tp, and the config has no other).
        self.local = mlps[0].linear_fc2.weight.shape[1]
        self.offset = parallel_state.get_tensor_model_parallel_rank() * self.local

    def _kept(self, size: int) -> int:
        """Neurons of this rank's block inside the global prefix of `size`."""
        return min(max(size - self.offset, 0), self.local)

    def attach(self) -> None:
        def fc1_cut():
            if self.active == self.full:
                return None
            kept = torch.arange(self._kept(self.active))
            return torch.cat([kept, kept + self.local])  # gate and up halves alike

        def fc2_cut():
            return None if self.active == self.full else self._kept(self.active)

        for mlp in self.mlps:
            add_rule(mlp.linear_fc1, "weight", SliceRule(0, fc1_cut))
            add_rule(mlp.linear_fc2, "weight", SliceRule(1, fc2_cut, self.gate_value))

    def resize(self, size: int) -> None:
        for mlp in self.mlps:
            mlp.linear_fc1.output_size_per_partition = 2 * self._kept(size)
            mlp.linear_fc2.input_size_per_partition = self._kept(size)

    def observe(self) -> list:
        """Post-activation magnitude per neuron (summed over the MLPs)."""

        def hook(module, args):
            x = args[0].detach()
            self.score[self.offset : self.offset + self.local] += x.abs().double().reshape(-1, x.shape[-1]).sum(0).cpu()

        return [mlp.linear_fc2.register_forward_pre_hook(hook) for mlp in self.mlps]

    def permute(self, order: torch.Tensor) -> None:
        # Neurons move between TP ranks: each rank's block is a gate half and an up half.
        for mlp in self.mlps:
            permute_across_tp_(full_tensor(mlp.linear_fc1, "weight"), 0, order, halves=2)
            permute_across_tp_(full_tensor(mlp.linear_fc2, "weight"), 1, order)

    def params(self, sizes: Mapping[str, Size]) -> Size:
        return 3 * sizes[self.name] * sizes["hidden"]

    def export_fields(self, size: int) -> dict:
        return {"ffn_hidden_size": size}


@register_layer_adapter
def dense_layer(layer: nn.Module) -> Optional[LayerAxes]:
    if not isinstance(layer, TransformerLayer):
        return None
    if not isinstance(layer.self_attention, SelfAttention) or not isinstance(layer.mlp, MLP):
        return None
    index = layer.layer_number - 1
    attn, mlp = layer.self_attention, layer.mlp
    return LayerAxes(
        axes=[HeadsAxis(attn, index), FfnAxis(mlp, index)],
        hidden=[
            Touch(layer.input_layernorm, "weight", 0, resize_norm, owned=True),
            Touch(attn.linear_qkv, "weight", 1, set_input_size),
            Touch(attn.linear_proj, "weight", 0, set_output_size),
            Touch(layer.pre_mlp_layernorm, "weight", 0, resize_norm, owned=True),
            Touch(mlp.linear_fc1, "weight", 1, set_input_size),
            Touch(mlp.linear_fc2, "weight", 0, set_output_size),
        ],
        norms=[layer.input_layernorm, layer.pre_mlp_layernorm],
    )
